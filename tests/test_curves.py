"""Curves to look at: --tensorboard's events, and tools.plot drawing several runs into one PNG."""
import json

import pytest
from script_runs import TINY, check, launcher, read_metrics, run, run_main

from safety_net.metrics_log import MetricsLog
from tools import plot


@pytest.mark.slow  # a run of its own (10 s of the quick subset, which stays under 2 minutes)
def test_tensorboard_events_hold_the_metrics_and_the_training_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    check(run(launcher("python", "distributed.py") + TINY + ["--epochs", "2", "--tensorboard",
                                                             "--output-dir", str(out)]))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out)
    steps = 3  # TINY: 48 images, global batch 16
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 2 * steps + 1))  # --print-freq 1: every step
    for name in ("top1", "train_loss", "test_loss", "images_per_s"):
        scalars = events.Scalars(f"epoch/{name}")
        assert [e.step for e in scalars] == [steps, 2 * steps]
        assert [e.value for e in scalars] == pytest.approx([r[name] for r in records], rel=1e-6)


def epoch_record(epoch: int, top1: float = 10.0) -> dict:
    """An epoch's line as the safety net hands it to MetricsLog.write."""
    return {"epoch": epoch, "train_loss": 1.0, "test_loss": 1.0, "top1": top1, "top5": 50.0, "lr": 0.1,
            "epoch_time_s": 1.0, "images_per_s": 1.0}


def test_a_resumed_run_replaces_the_events_written_after_its_checkpoint_and_keeps_those_before(tmp_path, capsys):
    """Epoch 1 of 3 steps checkpointed, epoch 2 logged, then a crash before its checkpoint; the run resumed from epoch
    1 logs epoch 2 again. TensorBoard shows one curve: every event up to the checkpoint, epoch 1's metrics at step 3
    among them (hidden by each resume while purge_step was the checkpoint's own step), then the resumed run's alone
    (without purge_step, the crashed run's epoch 2 metrics stay beside the new ones at the same step)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    crashed = MetricsLog(str(tmp_path), is_main=True, done_epochs=0, steps_per_epoch=3, tensorboard=True)
    for step in (1, 2, 3):
        crashed.train_loss(0, step, 1.0)
    crashed.write(epoch_record(1, top1=10.0))
    for step in (1, 2, 3):  # past the checkpoint: to be replaced
        crashed.train_loss(1, step, 9.0)
    crashed.write(epoch_record(2, top1=15.0))
    crashed.events.close()
    resumed = MetricsLog(str(tmp_path), is_main=True, done_epochs=1, steps_per_epoch=3, tensorboard=True)
    for step in (1, 2, 3):
        resumed.train_loss(1, step, 2.0)
    resumed.write(epoch_record(2, top1=20.0))
    resumed.events.close()
    capsys.readouterr()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    assert [(e.step, e.value) for e in events.Scalars("epoch/top1")] == [(3, 10), (6, 20)]


def test_an_epoch_line_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, capsys):
    """metrics.jsonl is a record, not the run's state: a failed write (here a folder in the file's place) costs that
    epoch's line and one warning saying so, never the run; the next epoch's line is written once writing works."""
    log = MetricsLog(str(tmp_path), is_main=True, done_epochs=0)
    path = tmp_path / "metrics.jsonl"
    path.unlink()
    path.mkdir()
    record = epoch_record(1)
    log.write(record)
    said = capsys.readouterr()
    assert said.err == (f"warning: could not write {path} (Is a directory); this epoch's line is missing from it, "
                        "and training goes on\n"), said.err
    assert said.out.startswith("epoch 1: train_loss 1.0000"), said.out  # the epoch's line is still printed
    path.rmdir()
    log.write({**record, "epoch": 2})
    assert read_metrics(tmp_path) == [{**record, "epoch": 2}]


def test_tensorboard_without_the_package_is_a_one_line_error(monkeypatch, capsys):
    import importlib.util

    import distributed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as stopped:
        distributed.parse_args(["--tensorboard"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "pip install tensorboard" in err[0], err


def fake_run(directory, losses):
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(
        json.dumps({"epoch": i + 1, "train_loss": loss, "top1": 10.0 * (i + 1), "epoch_time_s": 30.0}) + "\n"
        for i, loss in enumerate(losses)))


def test_plot_draws_several_runs_into_one_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    fake_run(tmp_path / "ddp", [4.0, 3.0, 2.5])
    fake_run(tmp_path / "dataparallel", [4.1, 3.2])
    output = tmp_path / "curves.png"
    result = check(run_main(plot.main, [str(tmp_path / "ddp"), str(tmp_path / "dataparallel"), "--output", str(output)],
                            capsys))
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000
    assert "2 run(s) drawn" in result.stdout


@pytest.mark.parametrize(("make", "says"), [(lambda d: d.mkdir(), "holds no metrics.jsonl"),
                                            (lambda d: fake_run(d, []), "no finished epoch")])
def test_plot_of_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path, make, says, capsys):
    make(tmp_path / "empty")
    result = run_main(plot.main, [str(tmp_path / "empty"), "--output", str(tmp_path / "x.png")], capsys)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert not (tmp_path / "x.png").exists()
