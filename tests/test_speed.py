"""The speed techniques through the real scripts: the exact ones leave the weights unchanged to the bit,
the approximate ones stay close, DDP has no communication hook unless asked, and the benchmark writes its
table, chart and numbers."""
import json
import sys

import pytest
import torch
from script_runs import TINY, check, launcher, load_checkpoint, read_metrics, run, run_main

from speed import techniques
from utils import models

LIVE_RECOVERY = "DDP, live recovery (torchft, a replica group per process)"


@pytest.mark.slow
def test_exact_ddp_settings_give_the_same_weights_bit_for_bit(runs):
    """Buckets, their views, the static graph and the foreach SGD step change how the work is done,
    not the arithmetic of any element: the weights after 3 steps equal the default run's to the bit."""
    settings = ["--bucket-cap-mb", "64", "--no-gradient-as-bucket-view", "--static-graph",
                "--optimizer-impl", "foreach"]
    expected = load_checkpoint(runs("torchrun", "torchrun", "distributed.py"))
    got = load_checkpoint(runs("ddp-settings", "torchrun", "distributed.py", *settings))
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


@pytest.mark.slow
@pytest.mark.parametrize("technique", [["--comm-hook", "fp16"], ["--comm-hook", "bf16"],
                                       ["--channels-last", "--optimizer-impl", "fused"]])
def test_approximate_techniques_stay_close(runs, technique):
    """Compressed gradients and NHWC convolutions round differently: the same 3 steps, a close loss."""
    reference = read_metrics(runs("torchrun", "torchrun", "distributed.py"))[0]
    record = read_metrics(runs("-".join(technique), "torchrun", "distributed.py", *technique))[0]
    assert record["train_loss"] == pytest.approx(reference["train_loss"], rel=2e-2)


@pytest.mark.slow
def test_powersgd_runs_beside_syncbatchnorm(tmp_path):
    """PowerSGD issues all-reduces from callback threads; before CpuSyncBatchNorm had a process group of its
    own, their order against its all-reduces differed between ranks and gloo aborted (a collective mismatch).
    6 steps: PowerSGD compresses from the second epoch on."""
    check(run(launcher("torchrun", "distributed.py") + TINY + ["--epochs", "2", "--comm-hook", "powersgd",
                                                              "--output-dir", str(tmp_path)]))
    first, second = read_metrics(tmp_path)
    assert second["epoch"] == 2 and 0 < second["train_loss"] < 20


def test_ddp_runs_as_torch_ships_it_unless_a_comm_hook_is_asked_for():
    """No hook by default (DDP's built-in all-reduce); --comm-hook installs torch's own."""
    from types import SimpleNamespace
    hooks = []
    model = SimpleNamespace(register_comm_hook=lambda state, hook: hooks.append(hook.__name__))
    techniques.register_comm_hook(model, "none", steps_per_epoch=3)
    assert hooks == []
    for name in ("fp16", "bf16", "powersgd"):
        techniques.register_comm_hook(model, name, steps_per_epoch=3)
    assert hooks == ["fp16_compress_hook", "bf16_compress_hook", "powerSGD_hook"]


class _Built(Exception):
    """Raised by the stand-in for DDP once the script has built it: the run goes no further."""


def ddp_options_of(script, argv: list[str], monkeypatch) -> dict:
    """The keyword arguments `script`'s train() gives DistributedDataParallel for these flags (no process group:
    DDP is replaced by a recorder that stops the run there)."""
    from types import SimpleNamespace

    def recorded(model, **options):
        raise _Built(options)

    monkeypatch.setattr(script, "DDP", recorded)
    env = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), is_main=True)
    with pytest.raises(_Built) as built:
        script.train(script.parse_args(TINY + argv), env, safety=None)
    return built.value.args[0]


def test_technique_flags_have_help_and_defaults(monkeypatch):
    import dataparallel
    import distributed
    import distributed_apex
    args = distributed.parse_args([])
    assert (args.comm_hook, args.bucket_cap_mb, args.gradient_as_bucket_view, args.static_graph) == \
        ("none", None, True, False)
    assert (args.channels_last, args.compile, args.optimizer_impl) == (False, False, "auto")
    assert not hasattr(args, "loader") and not hasattr(args, "cuda_graphs")  # the fast GPU path is apex's alone
    apex = distributed_apex.parse_args([])
    assert (apex.loader, apex.cuda_graphs) == ("dataloader", False)
    # the flags reach DDP as its keyword arguments, the defaults and each changed
    assert ddp_options_of(distributed, ["--no-sync-bn"], monkeypatch) == {
        "device_ids": None, "bucket_cap_mb": None, "gradient_as_bucket_view": True, "static_graph": False}
    assert ddp_options_of(distributed, ["--no-sync-bn", "--bucket-cap-mb", "64", "--no-gradient-as-bucket-view",
                                        "--static-graph"], monkeypatch) == {
        "device_ids": None, "bucket_cap_mb": 64.0, "gradient_as_bucket_view": False, "static_graph": True}
    dp = dataparallel.parse_args([])
    assert not hasattr(dp, "comm_hook") and hasattr(dp, "channels_last")


@pytest.mark.parametrize("argv", [["--comm-hook", "int8"], ["--bucket-cap-mb", "0"], ["--optimizer-impl", "x"]])
def test_bad_technique_flags_are_one_line_errors(argv, capsys):
    import distributed
    result = run_main(distributed.main, argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_fused_optimizer_impl_needs_torch_sgd(monkeypatch, capsys):
    assert techniques.sgd_kernel("fused") == {"fused": True}
    assert techniques.sgd_kernel("foreach") == {"foreach": True} and techniques.sgd_kernel("for-loop") == \
        {"foreach": False}
    # auto: torch's choice, but the fused step under --cuda-graphs (it reads the rate from a tensor the graph sees)
    assert techniques.sgd_kernel("auto") == {}
    assert techniques.sgd_kernel("auto", cuda_graphs=True) == {"fused": True}
    # with apex's FusedSGD an --optimizer-impl is refused when the flags are parsed (utils/precision.py)
    import distributed_apex
    from utils import precision
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if NVIDIA apex were installed
    monkeypatch.setattr(precision.launch, "resolve_device", lambda device: "cuda")  # and a GPU visible
    said = run_main(distributed_apex.main, ["--optimizer", "apex-fused-sgd", "--optimizer-impl", "fused"], capsys)
    assert said.returncode == 2 and len(said.stderr.strip().splitlines()) == 1, said.stderr
    assert "--optimizer-impl fused applies to torch.optim.SGD; drop it with apex-fused-sgd" in said.stderr


@pytest.mark.slow
def test_benchmark_writes_table_chart_and_numbers(tmp_path):
    """Two rows, one timed step: the plumbing of benchmarks.run, not a speed. The second, live recovery, runs two
    replica groups of one process under a torchft lighthouse of its own, and reads group 0's metrics."""
    result = check(run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", "DDP (torchrun),live recovery",
                        "--steps", "1", "--batch-size", "4", "--output-dir", str(tmp_path)]))
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert [row["name"] for row in results["rows"]] == ["DDP (torchrun)", LIVE_RECOVERY]
    for row in results["rows"]:
        assert row["processes"] == 2 and row["images_per_s"] > 0, row
    assert results["meta"]["ideal"]["float32"]["images_per_s"] > 0
    assert 3.2e9 < results["meta"]["flops_per_image"] < 3.4e9  # ResNet-18 at 32x32, forward + backward
    table = (tmp_path / "benchmark.md").read_text()
    assert "| DDP (torchrun) | `distributed.py` | 2 |" in table and table in result.stdout
    assert f"| {LIVE_RECOVERY} | `distributed_live_recovery.py` | 2 |" in table
    assert (tmp_path / "benchmark.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["--epochs", "1"], ["--only", "no such row"], ["--batch-size", "6"],
                                  ["--nprocs", "0"], ["--workers", "-1"], ["--device", "cpu", "--only", "CUDA graphs"]])
def test_benchmark_bad_input_is_one_line(argv, tmp_path, capsys):
    from benchmarks import run as bench
    result = run_main(bench.main, ["--output-dir", str(tmp_path)] + argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "benchmark.md").exists()


def fake_measurements(monkeypatch, native_bfloat16: bool):
    """benchmarks.run with every measurement replaced by a number: the selection, the tables and the output."""
    from benchmarks import run as bench
    monkeypatch.setattr(bench.precision, "cpu_has_native_bfloat16", lambda: native_bfloat16)
    monkeypatch.setattr(bench, "ideal", lambda args, amp: {"images_per_s": 100.0, "peak_memory_mb": 1.0})
    monkeypatch.setattr(bench, "device_peak", lambda args, dtype: 1.0)
    monkeypatch.setattr(bench, "flops_per_image", lambda: 3.3e9)
    rates = {"DataParallel": 50.0, "DataParallel + mixed precision": 80.0, "DDP (torchrun)": 60.0,
             "DDP + bfloat16 autocast": 100.0, "plain tutorial DDP loop": 50.0, "Lightning Trainer, DDP": 40.0,
             "plain tutorial DDP loop + bfloat16 autocast": 80.0, "Lightning Trainer, DDP, bf16-mixed": 75.0,
             "no SyncBatchNorm": 70.0, "DDP + bfloat16 autocast, no SyncBatchNorm": 90.0, "bare step, compiled": 120.0,
             bench.TUNED_LOOP_BF16: 85.0}
    monkeypatch.setattr(bench, "run_row", lambda row, args: {
        "processes": 2, "images_per_s": rates[row.name], "peak_memory_mb": 1.0, "wall_s": 0.0})
    return bench


def test_seed_table_has_the_seed_projects_four_rows(monkeypatch, tmp_path, capsys):
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    bench.main(["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)])
    table = (tmp_path / "benchmark.md").read_text()
    assert "| DataParallel + apex | DataParallel + mixed precision | `dataparallel.py --opt-level O1 --amp-dtype " \
           "bfloat16` | 625.0 | 1.60 |" in table
    assert "| DDP + apex | DDP + bfloat16 autocast |" in table and "| DDP | DDP (torchrun) |" in table
    assert "### Techniques" not in table  # no technique row was run
    said = capsys.readouterr().out
    assert "[5/7] DDP (torchrun): 60.0 images/s (0 s); under a minute left" in said  # 2 ideals, 4 rows, the ideal again


def test_a_stopped_benchmark_keeps_the_rows_it_measured_and_says_it_is_unfinished(monkeypatch, tmp_path, capsys):
    """The tables are written after every row, so a run killed at row 3 (SIGKILL, a time limit) leaves rows 1-2;
    Ctrl-C there ends it with one line and exit status 130, the files saying the run is unfinished."""
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    measure = bench.run_row

    def row_3_interrupted(row, args):
        written = json.loads((tmp_path / "benchmark.json").read_text()) if (tmp_path / "benchmark.json").exists() \
            else {"rows": []}
        if len(written["rows"]) == 2:  # what a kill now would leave: the two rows before
            raise KeyboardInterrupt
        return measure(row, args)

    monkeypatch.setattr(bench, "run_row", row_3_interrupted)
    result = run_main(bench.main, ["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)],
                      capsys)
    assert result.returncode == 130
    assert result.stderr.strip() == f"stopped by Ctrl-C after 2 of 4 rows: {tmp_path / 'benchmark.md'} has the " \
                                    "rows measured"
    written = json.loads((tmp_path / "benchmark.json").read_text())
    assert [r["name"] for r in written["rows"]] == ["DataParallel", "DataParallel + mixed precision"]
    table = (tmp_path / "benchmark.md").read_text()
    assert "**Unfinished:** 2 of 4 rows measured when this was written" in table
    assert "| DataParallel | DataParallel | `dataparallel.py` | 1000.0 | 1.00 |" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmark.json", "benchmark.md"]  # no scratch files


def test_a_benchmark_stopped_before_any_row_writes_nothing(monkeypatch, tmp_path, capsys):
    bench = fake_measurements(monkeypatch, native_bfloat16=True)

    def ctrl_c(args, amp):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "ideal", ctrl_c)
    result = run_main(bench.main, ["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)],
                      capsys)
    assert result.returncode == 130
    assert result.stderr.strip() == "stopped by Ctrl-C before any row was measured: nothing written"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_stops_the_benchmark_as_ctrl_c_does(monkeypatch, tmp_path, capsys):
    import os
    import signal
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    measure = bench.run_row

    def terminated_at_row_2(row, args):
        if row.name == "DataParallel + mixed precision":
            os.kill(os.getpid(), signal.SIGTERM)  # what kill -TERM does while a row is measured
        return measure(row, args)

    monkeypatch.setattr(bench, "run_row", terminated_at_row_2)
    result = run_main(bench.main, ["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)],
                      capsys)
    assert result.returncode == 128 + signal.SIGTERM
    assert result.stderr.strip() == f"stopped by SIGTERM after 1 of 4 rows: {tmp_path / 'benchmark.md'} has the " \
                                    "rows measured"
    assert [r["name"] for r in json.loads((tmp_path / "benchmark.json").read_text())["rows"]] == ["DataParallel"]


def test_a_row_stopped_with_the_benchmark_gets_sigterm_and_time_to_exit(tmp_path):
    """Ctrl-C while a row runs: its launcher is sent SIGTERM and waited for, so it can stop its ranks (here: a
    child that takes 0.5 s to exit on SIGTERM and writes a file as it does), before the KeyboardInterrupt goes on."""
    import signal
    import sys

    from benchmarks import harness
    marker = tmp_path / "exited"
    child = ("import signal, sys, time\n"
             "def stop(*_):\n    time.sleep(0.5)\n    open(sys.argv[1], 'w').write('cleanly')\n    sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, stop)\nprint('ready', flush=True)\ntime.sleep(60)\n")

    def ctrl_c(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 1.5)  # Ctrl-C 1.5 s into the row
    try:
        with pytest.raises(KeyboardInterrupt):
            harness.run_stoppable([sys.executable, "-c", child, str(marker)], env=None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert marker.read_text() == "cleanly"


def test_a_rows_launcher_is_out_of_reach_of_the_terminals_ctrl_c():
    """In a session of its own, so that a terminal's Ctrl-C reaches the benchmark alone and the launcher gets the
    one SIGTERM run_stoppable sends: torchrun given a second signal stops waiting for its ranks."""
    import os
    import sys

    from benchmarks import harness
    result = harness.run_stoppable([sys.executable, "-c", "import os; print(os.getsid(0), os.getpgrp())"], env=None)
    session, group = map(int, result.stdout.split())
    assert session != os.getsid(0) and group != os.getpgrp()


def test_a_stop_while_the_launcher_starts_leaves_nothing_running(monkeypatch, tmp_path):
    """Ctrl-C as Popen is starting the row's launcher: the launcher runs, but the benchmark holds no handle on it;
    run_stoppable still finds it by its mark and kills it (the old code left it: a flaky Ctrl-C test of
    benchmarks.diloco found one of its processes alive)."""
    import subprocess

    from processes import processes_naming

    from benchmarks import harness
    start = subprocess.Popen._execute_child  # private: where the child exists before Popen has returned

    def started_then_stopped(self, *args, **kwargs):
        start(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "_execute_child", started_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        harness.run_stoppable([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)], env=None)
    assert not processes_naming(tmp_path)


def test_a_finished_benchmark_is_not_said_to_be_unfinished(monkeypatch, tmp_path):
    """Nor does it leave its SIGTERM and SIGHUP handlers behind in a process that calls its main()."""
    import signal
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    handlers = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)]
    bench.main(["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)])
    assert [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)] == handlers
    assert "Unfinished" not in (tmp_path / "benchmark.md").read_text()
    assert "unfinished" not in json.loads((tmp_path / "benchmark.json").read_text())["meta"]


def test_quick_leaves_out_bfloat16_rows_on_a_cpu_without_it_and_says_so(monkeypatch, tmp_path, capsys):
    bench = fake_measurements(monkeypatch, native_bfloat16=False)
    bench.main(["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert [r["name"] for r in results["rows"]] == ["DataParallel", "DDP (torchrun)"]
    assert list(results["meta"]["ideal"]) == ["float32"]  # no bfloat16 ideal or peak measured either
    said = capsys.readouterr().out
    assert "--quick left out 2 bfloat16 row(s)" in said and "no native bfloat16" in said
    assert "--quick left out" in (tmp_path / "benchmark.md").read_text()


def test_only_a_whole_row_name_selects_that_row_and_a_part_of_one_every_row_that_has_it(monkeypatch, tmp_path):
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    bench.main(["--quick", "--device", "cpu", "--only", "no SyncBatchNorm,DDP (torchrun)", "--output-dir",
                str(tmp_path / "whole")])
    rows = json.loads((tmp_path / "whole" / "benchmark.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["no SyncBatchNorm", "DDP (torchrun)"]  # in the order named
    bench.main(["--quick", "--device", "cpu", "--only", "no SyncBatch", "--output-dir", str(tmp_path / "part")])
    rows = json.loads((tmp_path / "part" / "benchmark.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["DDP + bfloat16 autocast, no SyncBatchNorm", "no SyncBatchNorm"]
    # a whole name with commas in it is one --only value; the rows run in the order named, each once
    named = bench.rows_named(["DDP + bfloat16, CUDA graphs", "seed,DDP (torchrun)"], "cuda")
    assert [r.name for r in named] == ["DDP + bfloat16, CUDA graphs", *bench.seed_rows("cuda").values()]
    assert bench.rows_named(["seed,no such row"], "cpu").startswith("--only 'no such row' matches no row (the rows: ")


def test_peers_table_beside_ddp_torchrun(monkeypatch, tmp_path):
    """--only peers: DDP (torchrun) and DDP + bfloat16 autocast (on the CPU also both without SyncBatchNorm, as
    the peers are there), the plain loop and Lightning in float32 and in bfloat16, with the ideal as the eager
    ceiling; each of ours against the plain loop of its precision; --quick leaves out the compiled ceiling
    and the CPU the CUDA graphs one, each saying so in one line."""
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    monkeypatch.setattr(bench.harness, "importable", lambda module: True)
    monkeypatch.setattr(bench, "ideal", lambda args, amp: {"images_per_s": 200.0 if amp else 100.0})
    bench.main(["--quick", "--device", "cpu", "--only", "peers", "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(r["name"], r["table"], r["amp"]) for r in results["rows"]] == [
        ("DDP (torchrun)", "method", None), ("DDP + bfloat16 autocast", "method", "bfloat16"),
        ("DDP + bfloat16 autocast, no SyncBatchNorm", "method", "bfloat16"), ("no SyncBatchNorm", "technique", None),
        ("plain tutorial DDP loop", "peer", None), ("Lightning Trainer, DDP", "peer", None),
        ("plain tutorial DDP loop + bfloat16 autocast", "peer", "bfloat16"),
        ("Lightning Trainer, DDP, bf16-mixed", "peer", "bfloat16")]
    table = (tmp_path / "benchmark.md").read_text()
    # the bfloat16 rows against the bfloat16 ideal (200 images/s), each started as its row starts it
    assert "| DDP + bfloat16 autocast | `python distributed_apex.py --nprocs 2 --amp-dtype bfloat16` | 2 | 100.0 " \
           "| 500.0 | 0.50 | 1.67 |" in table
    assert "| plain tutorial DDP loop + bfloat16 autocast | `torchrun --nproc_per_node=2 -m " \
           "benchmarks.peers.plain_ddp --precision bfloat16` | 2 | 80.0 | 625.0 | 0.40 | 1.33 |" in table
    assert "`distributed_apex.py --amp-dtype bfloat16` (DDP + bfloat16 autocast) runs at 1.25x the plain tutorial " \
           "DDP loop + bfloat16 autocast." in table
    assert "`distributed.py --no-sync-bn` (no SyncBatchNorm) runs at 1.40x the plain tutorial DDP loop." in table
    # on a GPU the peers synchronise BatchNorm as our rows do: no rows without it beside them
    assert bench.keyword_rows("cuda")["peers"] & {"no SyncBatchNorm", "DDP + bfloat16 autocast, no SyncBatchNorm"} \
        == set()
    assert "### Peers" in table and "### Techniques" in table  # "no SyncBatchNorm" is a technique row
    assert "| bare step, eager float32 (the float32 ideal) | `benchmarks/bare_step.py`, 2 side by side | 2 | 100.0 " \
           "| 500.0 | 1.00 | 1.67 |" in table  # each ideal named by its precision, its ratio against its own
    assert "| bare step, eager bfloat16 (the bfloat16 ideal) | `benchmarks/bare_step.py --amp-dtype bfloat16`, 2 " \
           "side by side | 2 | 200.0 | 250.0 | 1.00 | 3.33 |" in table
    assert "| DDP (torchrun) | `torchrun --nproc_per_node=2 distributed.py` | 2 | 60.0 | 833.3 | 0.60 | 1.00 |" in table
    assert "| plain tutorial DDP loop | `torchrun --nproc_per_node=2 -m benchmarks.peers.plain_ddp` | 2 | 50.0 " \
           "| 1000.0 | 0.50 | 0.83 |" in table
    assert "| Lightning Trainer, DDP | `torchrun --nproc_per_node=2 -m benchmarks.peers.lightning_ddp` |" in table
    assert "`distributed.py` (DDP (torchrun)) runs at 1.20x the plain tutorial DDP loop." in table
    assert "Our fastest row in this run, DDP + bfloat16 autocast, is 1.25x the fastest peer, plain tutorial DDP " \
           "loop + bfloat16 autocast." in table
    assert "bare step, compiled: left out, not in --quick" in table
    assert "bare step, CUDA graphs: left out, it needs a GPU." in table


def test_peers_without_quick_measure_the_compiled_ceiling(monkeypatch, tmp_path):
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    monkeypatch.setattr(bench.harness, "importable", lambda module: True)
    bench.main(["--device", "cpu", "--only", "peers", "--output-dir", str(tmp_path)])
    table = (tmp_path / "benchmark.md").read_text()
    assert "| bare step, compiled | `benchmarks/bare_step.py --compile default`, 2 side by side | 2 | 120.0 " \
           "| 416.7 | 1.20 | 2.00 |" in table
    assert "bare step, compiled: left out" not in table and "bare step, CUDA graphs: left out" in table
    # the tuned peer (compiled like the compiled ceiling: not in --quick on the CPU), and the fastest peer it is
    assert "| tuned tutorial DDP loop + bfloat16 autocast (compiled, channels-last, fused SGD) | `torchrun " \
           "--nproc_per_node=2 -m benchmarks.peers.plain_ddp --precision bfloat16 --tuned` | 2 | 85.0 |" in table
    assert "the fastest peer, tuned tutorial DDP loop + bfloat16 autocast" in table


def test_lightning_row_is_left_out_in_one_line_where_lightning_is_missing(monkeypatch, tmp_path, capsys):
    bench = fake_measurements(monkeypatch, native_bfloat16=True)
    monkeypatch.setattr(bench.harness, "importable", lambda module: module != "lightning")
    bench.main(["--quick", "--device", "cpu", "--only", "peers", "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert "Lightning Trainer, DDP" not in [r["name"] for r in results["rows"]]
    line = "Lightning Trainer, DDP: left out, `lightning` is not installed (an optional dependency: pip install " \
           "lightning)."
    table = (tmp_path / "benchmark.md").read_text()
    assert table.splitlines().count(line) == 1 and "| Lightning" not in table
    assert line in results["meta"]["left_out"] and line in capsys.readouterr().out


def test_a_peer_is_read_from_its_epoch_lines(monkeypatch):
    """Lightning prints lines of its own: the epoch lines are picked out, and epochs 2..N give the median."""
    from argparse import Namespace
    from subprocess import CompletedProcess

    from benchmarks import run as bench
    lines = ["GPU available: False, used: False"] + [json.dumps(
        {"epoch": e, "images_per_s": rate, "epoch_time_s": 1.0, "train_loss": 4.6, "world_size": 2,
         "outputs": "float32"}) for e, rate in ((1, 5.0), (2, 30.0), (3, 10.0), (4, 20.0))]
    monkeypatch.setattr(bench.harness, "run_stoppable", lambda cmd, env: CompletedProcess(cmd, 0, "\n".join(lines), ""))
    args = Namespace(nprocs=2, device="cpu", batch_size=4, steps=1, epochs=4, workers=0)
    (plain,) = [r for r in bench.rows("cpu") if r.name == "plain tutorial DDP loop"]
    (plain_bf16,) = [r for r in bench.rows("cpu") if r.name == "plain tutorial DDP loop + bfloat16 autocast"]
    measured = bench.run_peer(plain, args)
    assert (measured["processes"], measured["images_per_s"]) == (2, 20.0)
    # a row that did not compute in the precision its name says is an error, not a figure
    assert bench.run_peer(plain_bf16, args)["error"] == "its model's outputs were float32, not bfloat16"
    lines.pop()  # an epoch line missing: an error, not a median of the others
    assert bench.run_peer(plain, args)["error"] == "printed 3 epoch lines for 4 epochs"


@pytest.mark.slow
@pytest.mark.parametrize("name, outputs", [("plain tutorial DDP loop", "float32"),
                                           ("plain tutorial DDP loop + bfloat16 autocast", "bfloat16")])
def test_plain_tutorial_loop_trains_under_torchrun_and_reports_images_per_s(name, outputs):
    """The plain loop's real launch (torchrun, 2 CPU processes, a DataLoader worker each), 2 epochs of 1 step,
    in float32 and under bfloat16 autocast."""
    from argparse import Namespace

    from benchmarks import run as bench
    (plain,) = [r for r in bench.rows("cpu") if r.name == name]
    args = Namespace(nprocs=2, device="cpu", batch_size=4, steps=1, epochs=2, workers=1)
    result = check(run(bench.peer_command(plain, args), timeout=180))
    epochs = bench.peer_epochs(result.stdout)
    assert [(e["epoch"], e["world_size"], e["outputs"]) for e in epochs] == [(1, 2, outputs), (2, 2, outputs)]
    assert all(e["images_per_s"] > 0 and 0 < e["train_loss"] < 20 for e in epochs), epochs
    assert epochs[1]["images_per_s"] == pytest.approx(8 / epochs[1]["epoch_time_s"])  # 1 step of 4 images x 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("name, outputs", [("Lightning Trainer, DDP", "float32"),
                                           ("Lightning Trainer, DDP, bf16-mixed", "bfloat16")])
def test_lightning_peer_trains_under_torchrun(name, outputs):
    """Where lightning is installed (an optional dependency): its Trainer under torchrun, 2 CPU processes, in
    float32 and in its bf16-mixed precision."""
    pytest.importorskip("lightning")
    from argparse import Namespace

    from benchmarks import run as bench
    (row,) = [r for r in bench.rows("cpu") if r.name == name]
    args = Namespace(nprocs=2, device="cpu", batch_size=4, steps=1, epochs=2, workers=0)
    epochs = bench.peer_epochs(check(run(bench.peer_command(row, args), timeout=180)).stdout)
    assert [(e["epoch"], e["world_size"], e["outputs"]) for e in epochs] == [(1, 2, outputs), (2, 2, outputs)]
    assert all(e["images_per_s"] > 0 and 0 < e["train_loss"] < 20 for e in epochs), epochs


@pytest.mark.parametrize("argv", [["--compile", "reduce-overhead"], ["--device", "cuda:x"], ["--steps", "0"]])
def test_bare_step_bad_input_is_one_line(argv, capsys):
    from benchmarks import bare_step
    result = run_main(bare_step.main, ["--device", "cpu"] + argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_device_peak_is_the_faster_of_matmuls_and_convolutions():
    from benchmarks.bare_step import device_peak
    peak = device_peak(torch.device("cpu"), torch.float32, seconds=0.05)
    assert peak["peak_tflops"] == max(peak["matmul_tflops"], peak["conv_tflops"]) > 0


@pytest.mark.slow
def test_worker_start_benchmark_times_both_loaders_in_a_spawned_rank():
    result = check(run([sys.executable, "-m", "benchmarks.worker_start", "--images", "64", "--workers", "1",
                        "--batch-size", "8", "--epochs", "2"]))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(report["seconds"]) == ["scripts' loader", "plain DataLoader"]
    assert all(len(s) == 2 and min(s) > 0 for s in report["seconds"].values()), report
    assert "scripts' loader: first batch of epoch 1 after" in result.stdout


@pytest.mark.slow
def test_fsdp_profile_compares_the_layouts_and_lists_what_grows():
    """One timed and one profiled step of each layout on the CPU proxy (the thin model, one thread): the plumbing of
    benchmarks.fsdp_profile, not a speed. Each layout dispatches aten operators; the proxy keeps all 62 parameters."""
    from benchmarks import fsdp_profile
    result = check(run([sys.executable, "-m", "benchmarks.fsdp_profile", "--proxy", "--precision", "bfloat16",
                        "--steps", "1", "--profile-steps", "1", "--top", "3"]))
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.endswith("x DDP")]
    assert [row[:44].strip() for row in rows] == list(fsdp_profile.LAYOUTS) and "1.00x DDP" in rows[0], result.stdout
    assert all(int(row.split(" aten ops")[0].split()[-1]) > 100 for row in rows), result.stdout
    assert "the proxy (channels / 16, 1 thread, foreach SGD)" in lines[0], result.stdout
    listed = lines[lines.index(next(line for line in lines if line.startswith("operators whose"))) + 1:]
    assert len([line for line in listed if " -> " in line]) == 3, result.stdout
    thin = fsdp_profile.thin(models.resnet18_cifar(), 16)
    assert len(list(thin.parameters())) == len(list(models.resnet18_cifar().parameters())) == 62
    assert thin.layer4[1].conv2.weight.shape == (32, 32, 3, 3) and thin.fc.weight.shape == (100, 32)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--precision", "float16"], ["--device", "cuda"],
                                  ["--proxy", "--thin", "3"], ["--proxy", "--device", "cuda"]])
def test_fsdp_profile_bad_input_is_one_line(argv, capsys):
    """Refused before its process group of one forms: main(argv) in this process, as python -m runs it."""
    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from benchmarks import fsdp_profile
    result = run_main(fsdp_profile.main, argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_every_row_of_ours_gives_flags_its_script_accepts(monkeypatch):
    """Each row of the scripts (not the peers or the bare step), on the CPU and on a GPU, parses with its script's
    own parser: a flag that moved to another script (--loader, --cuda-graphs: distributed_apex.py's alone) would
    make its row fail. The device-side data path is the float32 twin of DDP (torchrun), the row it is compared with."""
    import importlib

    from benchmarks import harness
    from benchmarks import run as bench
    from speed import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_no_gpu", lambda args: None)  # the GPU rows' --cuda-graphs, as on a GPU
    for device in ("cpu", "cuda"):
        for row in bench.rows(device):
            if row.table == "peer" or row.needs and not harness.importable(row.needs):  # an optional dependency
                continue
            script = importlib.import_module(row.script.removesuffix(".py"))
            script.parse_args(row.flags)
    (data_path,) = [r for r in bench.rows("cpu") if r.name == "device-side data path"]
    assert (data_path.script, data_path.start, data_path.flags, data_path.table) == \
        ("distributed_apex.py", "torchrun", ["--opt-level", "O0", "--loader", "device"], "technique")


def test_the_cuda_graph_rows_stand_beside_the_bfloat16_peers_and_two_runs_cover_every_row():
    """On a GPU: the graph path's two rows beside the plain loop in bfloat16; "seed,peers" and then "others" name
    every row (docs/speed.md: the whole GPU table in two calls), "others" with DDP (torchrun) to compare with."""
    from benchmarks import run as bench
    gpu = {r.name: r for r in bench.rows("cuda")}
    for name in ("DDP + bfloat16, CUDA graphs", "DDP + bfloat16, CUDA graphs, no SyncBatchNorm"):
        row = gpu[name]
        assert row.gpu_only and row.amp == "bfloat16" and {"--cuda-graphs", "device"} <= set(row.flags)
        assert row.script == "distributed_apex.py"  # the fast GPU path is its alone
        assert bench.ours_beside_peers("cuda")[name] == bench.PLAIN_LOOP_BF16
        assert name not in bench.ours_beside_peers("cpu")
    words = bench.keyword_rows("cuda")
    assert set(gpu) == words["seed"] | words["peers"] | words["others"] and "DDP (torchrun)" in words["others"]
    assert not (words["seed"] | words["peers"]) & (words["others"] - {"DDP (torchrun)"})
