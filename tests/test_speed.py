"""The speed techniques through the real scripts: the exact ones leave the weights unchanged to the bit,
the approximate ones stay close, the all-reduce count is what DDP's buckets and no_sync() say it is,
and the benchmark writes its table, chart and numbers."""
import json
import sys

import pytest
import torch
from conftest import TINY, check, launcher, load_checkpoint, read_metrics, run, run_main

from utils import techniques


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


@pytest.mark.slow
def test_accumulation_makes_one_all_reduce_per_optimizer_step(runs):
    """k=4 micro-batches under no_sync(): the gradients cross once per optimizer step, in one bucket
    with --bucket-cap-mb 64 (ResNet-18's 45 MB of gradients); without no_sync it would be 4."""
    out = runs("accumulation-k4-one-bucket", "spawn", "distributed_gradient_accumulation.py",
               "--grad-accu-steps", "4", "--bucket-cap-mb", "64")
    (record,) = read_metrics(out)
    assert record["grad_allreduces_per_step"] == 1


@pytest.mark.slow
def test_default_buckets_are_counted(runs):
    """torch's default buckets for ResNet-18: one bucket in the first step, three after DDP rebuilds them
    in the order the gradients became ready (3 steps: (1 + 3 + 3) / 3)."""
    (record,) = read_metrics(runs("torchrun", "torchrun", "distributed.py"))
    assert record["grad_allreduces_per_step"] == pytest.approx(7 / 3)
    assert record["peak_memory_mb"] > 100


def test_technique_flags_have_help_and_defaults():
    import dataparallel
    import distributed
    args = distributed.parse_args([])
    assert (args.comm_hook, args.bucket_cap_mb, args.gradient_as_bucket_view, args.static_graph) == \
        ("none", None, True, False)
    assert (args.channels_last, args.compile, args.optimizer_impl, args.loader) == \
        (False, False, "auto", "dataloader")
    assert techniques.ddp_options(args) == {"bucket_cap_mb": None, "gradient_as_bucket_view": True,
                                            "static_graph": False}
    dp = dataparallel.parse_args([])
    assert not hasattr(dp, "comm_hook") and hasattr(dp, "channels_last")


@pytest.mark.parametrize("argv", [["--comm-hook", "int8"], ["--bucket-cap-mb", "0"], ["--optimizer-impl", "x"]])
def test_bad_technique_flags_are_one_line_errors(argv, capsys):
    import distributed
    result = run_main(distributed.main, argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_fused_optimizer_impl_needs_torch_sgd():
    from types import SimpleNamespace

    from utils.errors import UsageError
    assert techniques.optimizer_options(SimpleNamespace(optimizer_impl="fused"), torch.optim.SGD) == {"fused": True}
    with pytest.raises(UsageError):
        techniques.optimizer_options(SimpleNamespace(optimizer_impl="fused"), torch.optim.Adam)


@pytest.mark.slow
def test_benchmark_writes_table_chart_and_numbers(tmp_path):
    """One row, one timed step: the plumbing of benchmarks.run, not a speed."""
    result = check(run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", "DDP (torchrun)",
                        "--steps", "1", "--batch-size", "4", "--output-dir", str(tmp_path)]))
    results = json.loads((tmp_path / "benchmark.json").read_text())
    (row,) = results["rows"]
    assert row["processes"] == 2 and row["images_per_s"] > 0 and row["grad_allreduces_per_step"] == 3
    assert results["meta"]["ideal"]["float32"]["images_per_s"] > 0
    assert 3.2e9 < results["meta"]["flops_per_image"] < 3.4e9  # ResNet-18 at 32x32, forward + backward
    table = (tmp_path / "benchmark.md").read_text()
    assert "| DDP (torchrun) | `distributed.py` | 2 |" in table and table in result.stdout
    assert (tmp_path / "benchmark.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["--epochs", "1"], ["--only", "no such row"], ["--batch-size", "6"],
                                  ["--nprocs", "0"], ["--workers", "-1"]])
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
             "DDP + bfloat16 autocast": 100.0}
    monkeypatch.setattr(bench, "run_row", lambda row, args: {
        "processes": 2, "images_per_s": rates[row.name], "peak_memory_mb": 1.0, "grad_allreduces_per_step": 3,
        "wall_s": 0.0})
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


def test_quick_leaves_out_bfloat16_rows_on_a_cpu_without_it_and_says_so(monkeypatch, tmp_path, capsys):
    bench = fake_measurements(monkeypatch, native_bfloat16=False)
    bench.main(["--quick", "--device", "cpu", "--only", "seed", "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert [r["name"] for r in results["rows"]] == ["DataParallel", "DDP (torchrun)"]
    assert list(results["meta"]["ideal"]) == ["float32"]  # no bfloat16 ideal or peak measured either
    said = capsys.readouterr().out
    assert "--quick left out 2 bfloat16 row(s)" in said and "no native bfloat16" in said
    assert "--quick left out" in (tmp_path / "benchmark.md").read_text()


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
