"""python -m benchmarks.gpu_check: what the CPU can prove of the GPU check (its steps, limits, report and refusals);
its steps themselves run on a lent GPU."""
import json
import sys

import pytest
import torch
from script_runs import run_main

from benchmarks import gpu_check


def test_dry_run_lists_every_step_with_its_limit_and_fits_one_call_to_a_lent_gpu(capsys):
    """The plan fits the 9 minutes of one call by its own limits: the default budget is within them, and the steps
    before the benchmark leave it at least 90 s even if each ran to its limit."""
    gpu_check.main(["--dry-run"])
    said = capsys.readouterr().out
    chosen = gpu_check.steps(gpu_check.Path("runs/gpu_check"))
    for step in chosen[:-1]:
        assert f"{step.name}" in said and f"at most {step.limit_s:3d} s" in said
    before = sum(step.limit_s for step in chosen[:-1])
    assert f"benchmark                  the rest, {530 - before - gpu_check.GRACE_S:3d} s at least" in said
    assert 530 - before - gpu_check.GRACE_S >= 90 and gpu_check.CALL_S == 540
    assert "--cuda-graphs" in said and "'DDP + bfloat16, CUDA graphs, compiled'" in said
    assert "budget: 530 s in all (within the 540 s of one call to a lent GPU)" in said


def test_the_steps_run_in_the_planned_order_and_the_benchmark_names_whole_rows():
    """The issue's order: versions, the tests selected by their mark (not by file), the fastest command's job and
    its host waits, distributed.py's timeline, FSDP's profile, then the rows: our fastest, the tuned peer, the
    plain peer, the bare step's split, FSDP's variants, and in the end every row."""
    steps = gpu_check.steps(gpu_check.Path("out"))
    assert [s.name for s in steps] == ["versions", "tests", "job-compiled-cuda-graphs", "graph-waits", "timeline",
                                       "fsdp-profile", "benchmark"]
    tests = steps[1].command
    assert tests[tests.index("-m", 2) + 1] == "gpu" and tests[-1] == "tests"  # every test marked gpu, in any file
    assert "distributed.py" in steps[4].command[-1] and "benchmarks.timeline" in steps[4].command[-1]
    assert steps[5].command[2:] == ["benchmarks.fsdp_profile", "--device", "cuda", "--batch-size", "256",
                                    "--precision", "bfloat16"]
    from benchmarks import run as bench
    chosen = bench.rows_named(gpu_check.BENCHMARK_ROWS, "cuda")  # every value names a row: none is a typo
    assert [r.name for r in chosen[:5]] == ["DDP + bfloat16, CUDA graphs, compiled", bench.TUNED_LOOP_BF16,
                                            "plain tutorial DDP loop + bfloat16 autocast", "bare step, compiled",
                                            "bare step, CUDA graphs"]
    names = [r.name for r in chosen]
    fsdp = ["FSDP + bfloat16 policy", "FSDP + bfloat16 autocast, one unit", "FSDP, no reshard after forward"]
    assert [names.index(name) for name in fsdp] == sorted(names.index(name) for name in fsdp)
    assert names.index(fsdp[-1]) < names.index("DataParallel")
    assert {r.name for r in chosen} == {r.name for r in bench.rows("cuda")}  # in the end, every row


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would run")
@pytest.mark.parametrize(("argv", "says"), [([], "no GPU is visible"), (["--only", "nothing"], "names no step"),
                                            (["--budget-s", "0"], "--budget-s")])
def test_bad_input_and_no_gpu_are_one_line_and_exit_2(argv, says, tmp_path, capsys):
    result = run_main(gpu_check.main, ["--output-dir", str(tmp_path / "out"), *argv], capsys)
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def fake_steps(out):
    """Quick steps as the check runs them: one passes, one leaves a process behind, one overruns the budget, and
    the last finds too little of it left."""
    python = [sys.executable, "-c"]
    return [gpu_check.Step("passes", 30, "prints its JSON", [*python, "print('{\"waits\": 0, \"batches\": 4, "
                                                                      "\"where\": []}')"], read="waits"),
            gpu_check.Step("orphan", 30, "leaves a sleeping child", [*python, "import subprocess, sys; subprocess."
                                                                     "Popen([sys.executable, '-c', 'import time; "
                                                                     "time.sleep(60)']); print('{}')"]),
            gpu_check.Step("overruns", 60, "sleeps past the budget", [*python, "import time; time.sleep(60)"]),
            gpu_check.Step("late", 30, "starts with too little of the budget left", [*python, "print('{}')"])]


def test_a_step_past_its_limit_is_stopped_what_it_leaves_is_killed_and_the_report_follows_each_step(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "steps", fake_steps)
    monkeypatch.setattr(gpu_check, "GRACE_S", 2)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 5)  # the overrun is stopped when the budget is spent: none is left
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    result = run_main(gpu_check.main, ["--output-dir", str(tmp_path), "--budget-s", "12"], capsys)
    assert result.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    passes, orphan, overruns, late = report["steps"]
    assert passes["ok"] and passes["summary"] == "0 host wait(s) in 4 batches"
    assert not overruns["ok"] and overruns["timed_out"] and "stopped at its limit of" in overruns["summary"]
    assert not orphan["ok"] and len(orphan["left_running"]) == 1 and "left running, killed" in orphan["summary"]
    assert late.get("skipped") and "not started" in late["summary"]
    table = (tmp_path / "report.md").read_text()
    assert "| passes | prints its JSON | ok: 0 host wait(s) in 4 batches |" in table and "**FAILED**" in table
    assert "===== overruns" in (tmp_path / "log.txt").read_text()
    assert report["unfinished"] is None


def test_the_readers_turn_each_steps_output_into_one_line(tmp_path):
    records = [{"images_per_s": 10000.0 * k, "train_loss": 4.0 - k, "test_loss": 4.1 - k, "top1": k,
                "epoch_time_s": 6.0 / k, "peak_memory_mb": 900} for k in (1, 2, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    job = gpu_check.read_job("", tmp_path)
    assert job["ok"] and job["found"]["s_per_epoch"] == [2.5, 1.25]
    assert job["summary"] == "1.25 s per 50,000-image epoch (epochs 2-3: 2.50, 1.25); epoch 1's training steps " \
                             "(compilation, warm-up) 6.0 s; train_loss 3.000, 2.000, 0.000"
    pytest_output = "PASSED tests/test_gpu.py::test_a\nFAILED tests/test_gpu.py::test_b - AssertionError: no\n" \
                    "==== 1 failed, 1 passed, 3 deselected in 12.5s ====\n"
    tests = gpu_check.read_pytest(pytest_output, tmp_path)
    assert not tests["ok"] and tests["failures"] == ["FAILED tests/test_gpu.py::test_b: AssertionError: no"]
    assert tests["summary"] == "1 failed, 1 passed, 3 deselected"
    quiet = "PASSED tests/test_gpu.py::test_a\nSKIPPED [1] tests/test_gpu.py:57: needs 2 GPUs\n" \
            "11 passed, 3 skipped in 174.29s (0:02:54)\n"  # pytest -q's last line, as a lent H200 printed it
    assert gpu_check.read_pytest(quiet, tmp_path) | {"tests": None} == {
        "ok": True, "summary": "11 passed, 3 skipped", "tests": None, "failures": []}
    (tmp_path / "host_reads.txt").write_text("2 item of torch.float32 at safety_net:10\n")
    assert gpu_check.read_waits("", tmp_path)["summary"].startswith("2 host read(s) or wait(s)")



def test_only_the_host_waits_are_counted_not_the_debug_modes_notice(monkeypatch):
    """torch.cuda.set_sync_debug_mode("warn") first warns that it is a prototype (a lent H200 counted that notice
    as a wait); each wait it finds is worded "called a synchronizing CUDA operation". The notice is passed on to
    whatever showed warnings before (here pytest.warns), not swallowed."""
    import collections
    import warnings

    import script_driver
    reads = collections.Counter()
    with pytest.warns(UserWarning, match="prototype feature") as shown:
        monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # put back after the test
        script_driver.SyncWaits(reads)
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning, stacklevel=1)
        warnings.warn(f"{gpu_check.SYNC_WARNING} (function copy_kernel_cuda)", UserWarning, stacklevel=1)
    assert list(reads.values()) == [1] and "called a synchronizing CUDA operation" in next(iter(reads))
    assert [str(w.message) for w in shown if gpu_check.SYNC_WARNING in str(w.message)] == []  # a wait: counted only
