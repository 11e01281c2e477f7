"""python -m lent_gpu.check: what the CPU can prove of the GPU check (its steps, limits, report and refusals);
its steps themselves run on a lent GPU."""
import json
import sys

import pytest
import torch
from script_runs import run_main

from lent_gpu import check as gpu_check


def plan_lines(said: str) -> tuple[list[tuple], int]:
    """The budget table --dry-run printed: (name, cells, worst, total) per line, and its "worst case" figure."""
    lines = said.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("step ")) + 1
    last = next(i for i, line in enumerate(lines) if line.startswith("worst case: "))
    table = []
    for line in lines[first:last]:
        tokens = line[26:].split()
        table.append((line[:26].rstrip(), tokens[:4], int(tokens[4]), int(tokens[5])))
    return table, int(lines[last].split()[2])


@pytest.mark.parametrize("budget", [None, 400, 120])
def test_dry_run_prints_the_budget_line_by_line_and_its_worst_case_fits_the_budget(budget, capsys):
    """Every allowance counted: the check's own start, each step's start-up, limit, grace (with SIGKILL's wait) and
    wrap-up, the last report. Each running total is the one before plus the line's worst case; the total is the sum
    of the printed lines and within the budget (480 s by default: 8 minutes, inside the 9 of one call); a step that
    no longer fits is skipped with its need printed, a benchmark or test step shortened first."""
    gpu_check.main(["--dry-run"] + ([] if budget is None else ["--budget-s", str(budget)]))
    said = capsys.readouterr().out
    budget = budget or 480
    assert gpu_check.BUDGET_S == 480 and gpu_check.CALL_S == 540
    table, total = plan_lines(said)
    chosen = {step.name: step for step in gpu_check.steps(gpu_check.Path("runs/gpu_check"))}
    assert [name for name, *_ in table] == ["this check's own start", *chosen, "the last report"]
    running = 0
    for name, cells, worst, line_total in table:
        running += worst
        assert line_total == running
        numbers = [int(cell) for cell in cells if cell != "-"]
        assert sum(numbers) == worst  # start-up + limit + grace + wrap-up
        if name in chosen and worst:
            step = chosen[name]
            startup, limit, grace, wrap = map(int, cells)
            assert (startup, grace, wrap) == (step.starts * gpu_check.START_S,
                                              step.grace_s + gpu_check.KILL_WAIT_S, gpu_check.WRAP_S)
            assert limit == step.limit_s or (step.min_s <= limit < step.limit_s and "shortened from" in said)
    assert total == running == sum(worst for *_, worst, _ in table) <= budget
    assert table[0][2] == gpu_check.CHECK_START_S and table[-1][2] == gpu_check.FINISH_S
    assert f"worst case: {total} s of the {budget} s budget (within it" in said
    if budget == 480:  # the default: the first rows, the graph's waits and the whole test step fit its worst case
        assert total == 478 and [name for name, _, worst, _ in table if worst][1:-1] == [
            "versions", "rows-first", "graph-waits", "tests"]
        assert "skipped in the worst case: needs 67 s, 2 s left" in said  # fsdp-profile, when all else ran long
    if budget == 400:
        assert "tests                            20     77      5       2    104    398  shortened from 155 s" in said
    assert "--cuda-graphs" in said and "'DDP + bfloat16, CUDA graphs, compiled'" in said


def test_the_steps_run_in_the_planned_order_and_the_rows_that_answer_open_questions_first(capsys):
    """The issue's order: versions, the rows that answer open questions (our fastest, the tuned peer, FSDP's one
    unit and its default layout) under the float32 and bfloat16 ideals only, the graph path's waits, the tests
    selected by their mark (not by file), FSDP's profile, the fastest command's job, distributed.py's timeline,
    then the other rows, and the float16 rows (with the float16 ideal) last; in the end, every row once."""
    steps = gpu_check.steps(gpu_check.Path("out"))
    assert [s.name for s in steps] == ["versions", "rows-first", "graph-waits", "tests", "fsdp-profile",
                                       "job-compiled-cuda-graphs", "timeline", "rows-rest", "rows-float16"]
    tests = steps[3].command
    assert tests[tests.index("-m", 2) + 1] == "gpu" and tests[-1] == "tests"  # every test marked gpu, in any file
    assert tests[tests.index("--dist") + 1] == "load" and "lent_gpu.check" in tests  # each result as it ends
    assert "distributed.py" in steps[6].command[-1] and "tools.timeline" in steps[6].command[-1]
    assert steps[4].command[2:] == ["benchmarks.fsdp_profile", "--device", "cuda", "--batch-size", "256",
                                    "--precision", "bfloat16"]
    from benchmarks import run as bench

    def named(step):  # the rows a benchmark step names, as benchmarks.run reads its --only values, in its order
        values = [step.command[i + 1] for i, arg in enumerate(step.command) if arg == "--only"]
        chosen = bench.rows_named(values, "cuda")
        assert not isinstance(chosen, str), chosen  # every value names a row: none is a typo
        assert step.command[-2:] == ["--output-dir", str(gpu_check.Path("out", step.name))]
        return chosen

    first, rest, float16 = named(steps[1]), named(steps[-2]), named(steps[-1])
    fastest = ("distributed_apex.py", ["--amp-dtype", "bfloat16", "--loader", "device", "--cuda-graphs", "--compile"])
    assert (first[0].script, first[0].flags) == fastest
    assert first[1].name == bench.TUNED_LOOP_BF16
    assert (first[2].script, first[2].flags) == ("distributed_fsdp.py", ["--units", "model", "--amp-dtype", "bfloat16"])
    assert (first[3].script, first[3].flags) == ("distributed_fsdp.py", ["--amp-dtype", "bfloat16"])  # default units
    assert len(first) == 4 and {r.amp for r in first + rest} <= {None, "bfloat16"}  # no float16 ideal before them
    assert float16 and {r.amp for r in float16} == {"float16"}
    assert [r.name for r in rest[:8]] == [  # DDP in bfloat16 (what FSDP's rows are compared with) first of the rest
        "DDP + bfloat16 autocast", "plain tutorial DDP loop + bfloat16 autocast", "bare step, compiled",
        "bare step, CUDA graphs", "DDP + bfloat16, CUDA graphs", "DDP + bfloat16, all techniques",
        "FSDP (fully_shard)", "FSDP, no reshard after forward"]
    names = [r.name for r in first + rest + float16]
    assert len(names) == len(set(names)) and set(names) == {r.name for r in bench.rows("cuda")}  # every row, once
    gpu_check.main(["--dry-run"])
    said = capsys.readouterr().out
    assert said.index("--only 'DDP + bfloat16, CUDA graphs, compiled' --only 'tuned tutorial DDP loop") < said.index(
        "--only 'FSDP + bfloat16 autocast, one unit' --only 'FSDP + bfloat16 policy' --output-dir")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would run")
@pytest.mark.parametrize(("argv", "says"), [([], "no GPU is visible"), (["--only", "nothing"], "names no step"),
                                            (["--budget-s", "0"], "--budget-s")])
def test_bad_input_and_no_gpu_are_one_line_and_exit_2(argv, says, tmp_path, capsys):
    result = run_main(gpu_check.main, ["--output-dir", str(tmp_path / "out"), *argv], capsys)
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def fake_steps(out, child_pid_file):
    """Quick steps as the check runs them (no torch: no start-up allowance): one passes, one leaves a process behind
    in its session, one overruns what is left of the budget and has a child in a session of its own (as the
    benchmark's rows are), and the last finds too little of the budget left."""
    python = [sys.executable, "-c"]
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']" \
            f", start_new_session=True); open({str(child_pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    return [gpu_check.Step("passes", 4, "prints its JSON", [*python, "print('{\"waits\": 0, \"batches\": 4, "
                                                                     "\"where\": []}')"], read="waits", starts=0,
                           grace_s=1),
            gpu_check.Step("orphan", 3, "leaves a sleeping child", [*python, "import subprocess, sys; subprocess."
                                                                    "Popen([sys.executable, '-c', 'import time; "
                                                                    "time.sleep(60)']); print('{}')"], starts=0,
                           grace_s=1),
            gpu_check.Step("overruns", 60, "sleeps past the budget", [*python, child], starts=0, grace_s=1, min_s=2),
            gpu_check.Step("late", 3, "starts with too little of the budget left", [*python, "print('{}')"], starts=0,
                           grace_s=1)]


def test_a_step_past_its_limit_is_stopped_what_it_leaves_is_killed_and_the_report_follows_each_step(
        monkeypatch, tmp_path, capsys):
    """The budget counts from the check's own start (here 3 s before main) and holds: the overrun is shortened to
    what is left and stopped there, its child in another session killed with it; the last step, whose worst case
    no longer fits, is skipped saying so; the whole run ends within the budget."""
    import functools
    import time

    from examples.local_processes import alive
    monkeypatch.setattr(gpu_check, "steps", functools.partial(fake_steps, child_pid_file=tmp_path / "child.pid"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    began = time.monotonic()
    main = functools.partial(gpu_check.main, started=began - 3)
    result = run_main(main, ["--output-dir", str(tmp_path / "out"), "--budget-s", "18"], capsys)
    took = time.monotonic() - began + 3
    assert result.returncode == 1 and took <= 18
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["startup_s"] >= 3 and report["seconds"] <= 18 and report["unfinished"] is None
    passes, orphan, overruns, late = report["steps"]
    assert passes["ok"] and passes["summary"] == "0 host wait(s) in 4 batches"
    assert not orphan["ok"] and len(orphan["left_running"]) == 1 and "left running, killed" in orphan["summary"]
    assert not overruns["ok"] and overruns["timed_out"] and 2 <= overruns["limit_s"] < 60
    assert f"stopped at its limit of {overruns['limit_s']} s" in overruns["summary"]
    child = int((tmp_path / "child.pid").read_text())
    assert [line.split()[0] for line in overruns["killed_at_limit"]] == [str(child)] and not alive([child])
    assert late.get("skipped") and late["summary"].startswith("not started: its worst case is 8 s, ")
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| passes | prints its JSON | ok: 0 host wait(s) in 4 batches | 4 |" in table and "**FAILED**" in table
    assert "===== overruns" in (tmp_path / "out" / "log.txt").read_text()


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
        "ok": True, "summary": "11 passed, 3 skipped", "tests": None, "failures": [], "running": []}
    (tmp_path / "host_reads.txt").write_text("2 item of torch.float32 at safety_net:10\n")
    assert gpu_check.read_waits("", tmp_path)["summary"].startswith("2 host read(s) or wait(s)")
    # a pytest stopped at its limit prints no summary: tests.jsonl says what each test that ended said, and which ran
    (tmp_path / "tests.jsonl").write_text("\n".join(json.dumps(line) for line in [
        {"test": "t.py::a"}, {"test": "t.py::b"}, {"test": "t.py::c"},
        {"test": "t.py::a", "when": "call", "outcome": "passed", "duration_s": 40.0, "why": ""},
        {"test": "t.py::b", "when": "call", "outcome": "passed", "duration_s": 50.0, "why": ""},
        {"test": "t.py::b", "when": "teardown", "outcome": "failed", "duration_s": 0.1, "why": "OSError: busy"},
        {"test": "t.py::d", "when": "setup", "outcome": "skipped", "duration_s": 0.0, "why": "needs 2 GPUs"}]) +
        '\n{"test": "t.py::e", "wh')  # a line cut short by the kill
    stopped = gpu_check.read_pytest("..s.\n", tmp_path, tmp_path)
    assert stopped == {"ok": False, "summary": "1 passed, 1 error, 1 skipped before it was stopped; running then: "
                                               "t.py::c", "tests": ["PASSED t.py::a", "ERROR t.py::b",
                                                                    "SKIPPED t.py::d"],
                       "failures": ["ERROR t.py::b: OSError: busy"], "running": ["t.py::c"]}


def test_pytest_with_this_module_as_its_plugin_writes_each_tests_result_as_it_ends(tmp_path):
    """What the tests step runs: pytest -p lent_gpu.check, under xdist (its controller writes, not its
    workers), a line as each test starts and one as it ends, its outcome and why."""
    import os
    import subprocess
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\ndef test_passes():\n    pass\n\ndef test_fails():\n    assert 1 == 2, 'no'\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n")
    log = tmp_path / "tests.jsonl"
    env = {**os.environ, gpu_check.TESTS_LOG: str(log)}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lent_gpu.check",
                          "-n", "1", str(tmp_path / "test_some.py")], cwd=gpu_check.ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 1 and "1 failed, 1 passed, 1 skipped" in ran.stdout, ran.stdout + ran.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["test"].split("::")[1] for line in lines if "outcome" not in line] == [
        "test_passes", "test_fails", "test_skipped"]  # each written once: by the controller
    ended = {line["test"].split("::")[1]: (line["outcome"], line["why"]) for line in lines if "outcome" in line}
    assert ended == {"test_passes": ("passed", ""), "test_fails": ("failed", "AssertionError: no\nassert 1 == 2"),
                     "test_skipped": ("skipped", "Skipped: not here")}
    results, running = gpu_check.read_test_log(log)
    assert len(results) == 3 and running == []


def test_the_budget_counts_from_the_process_start():
    """process_age: the seconds since this process started, read from /proc, Python's start and imports included:
    at least the time since this module was imported, and not the machine's uptime."""
    import time
    age = gpu_check.process_age()
    assert time.monotonic() - gpu_check._PYTEST_STARTED - 0.05 <= age
    with open("/proc/uptime") as file:
        assert age < float(file.read().split()[0])



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
