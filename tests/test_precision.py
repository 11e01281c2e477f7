"""--opt-level/--amp-dtype: the autocast dtype asked for on each device, and bfloat16 only where a CPU has it."""
import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from utils import precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def flags(opt_level="O1", amp_dtype="auto"):
    """A new run: no checkpoint to continue."""
    return SimpleNamespace(opt_level=opt_level, amp_dtype=amp_dtype, evaluate=False, resume=None, restart=False,
                           output_dir="/nonexistent/run")


def test_auto_on_a_cpu_without_native_bfloat16_trains_float32_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_has_native_bfloat16", lambda: False)
    assert precision.autocast_dtype(flags(), CPU, is_main=True) is None
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "no native bfloat16" in said[0] and "float32" in said[0], said
    assert precision.autocast_dtype(flags(), CPU, is_main=False) is None
    assert capsys.readouterr().err == ""  # one line for the job, from rank 0
    assert precision.autocast_dtype(flags(amp_dtype="bfloat16"), CPU, is_main=True) is torch.bfloat16


def test_auto_picks_bfloat16_on_a_cpu_that_has_it_and_float16_on_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_has_native_bfloat16", lambda: True)
    assert precision.autocast_dtype(flags(), CPU, is_main=True) is torch.bfloat16
    assert precision.autocast_dtype(flags(), CUDA, is_main=True) is torch.float16
    assert precision.autocast_dtype(flags(opt_level="O0"), CUDA, is_main=True) is None
    assert precision.autocast_dtype(flags(amp_dtype="float16"), CPU, is_main=True) is torch.float16
    assert capsys.readouterr().err == ""


def test_the_detection_asks_torch_for_the_instructions(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not precision.cpu_has_native_bfloat16()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_native_bfloat16()


@pytest.mark.parametrize(("text", "says"), [("O2", "use O1"), ("O3", "use O1"), ("O4", "expected O0")])
def test_opt_levels_torch_amp_has_not_are_refused_with_the_reason(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        precision.opt_level(text)
    assert precision.opt_level("O0") == "O0"


def test_dataparallel_autocast_is_inside_the_forward_and_the_checkpoint_holds_the_bare_weights():
    import dataparallel
    from safety_net import checkpoint
    from utils import models
    model = models.resnet18_cifar()
    images = torch.randn(2, 3, 32, 32)
    assert dataparallel.AutocastInForward(model, torch.bfloat16)(images).dtype == torch.bfloat16
    assert dataparallel.AutocastInForward(model, None)(images).dtype == torch.float32
    wrapped = torch.nn.DataParallel(dataparallel.AutocastInForward(model, torch.bfloat16), device_ids=[])
    assert checkpoint.unwrap(wrapped) is model
    assert dataparallel.parse_args([]).opt_level == "O0"  # float32 unless asked, as the seed's DataParallel


def test_dataparallel_mixed_precision_trains_and_its_checkpoint_evaluates_exactly(tmp_path):
    """bfloat16 runs on any CPU; float16 is the same code path with the GradScaler on (see tests/test_gpu.py)."""
    from script_runs import check, launcher, load_checkpoint, read_metrics, run
    small = ["--dataset", "synthetic", "--train-samples", "16", "--test-samples", "5", "--batch-size", "16",
             "--workers", "0", "--opt-level", "O1", "--amp-dtype", "bfloat16", "--output-dir", str(tmp_path)]
    check(run(launcher("python", "dataparallel.py") + small + ["--epochs", "1"]))
    saved = load_checkpoint(tmp_path)
    assert not any(key.startswith("module.") for key in saved["model"]), list(saved["model"])[:3]
    assert saved["resolved"]["precision"] == "bfloat16" and not saved["resolved"]["loss_scaling"]
    check(run(launcher("python", "dataparallel.py") + small + ["--epochs", "1", "--evaluate"]))
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    (record,) = read_metrics(tmp_path)
    assert evaluated["samples"] == 5 and evaluated["test_loss"] == pytest.approx(record["test_loss"])
