"""Checkpoints that travel and storage that fails: what a resume may change, the precision a run keeps,
--init-from, --keep, one run per output directory, and a write that fails."""
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from processes import Run
from script_runs import ROOT, TINY, check, launcher, load_checkpoint, read_metrics, run
from torch import nn

from examples.local_processes import alive, process_tree
from safety_net import checkpoint
from safety_net.stop_errors import StorageError
from utils import models, precision
from utils.errors import UsageError

CPU = torch.device("cpu")


def run_args(tmp_path, **changed):
    return SimpleNamespace(**{**dict(output_dir=str(tmp_path), seed=0, batch_size=4, epochs=3, lr=0.1, momentum=0.9,
                                     weight_decay=0.0, resume=None, restart=False, evaluate=False, init_from=None,
                                     keep=2, save_every_steps=0, opt_level="O1", amp_dtype="auto"), **changed})


def opts(args) -> checkpoint.Options:
    """What SafetyNet tells its checkpoints, from these flags."""
    return checkpoint.Options.from_flags(args)


def one_process():
    return SimpleNamespace(is_main=True, world_size=1, device=CPU)


def model_and_optimizer(impl: dict, scaled: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **impl)
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=scaled)


def train_step(model, optimizer, scaler):
    images, targets = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(images), targets)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize(("saved", "now"), [({"fused": True}, {"foreach": True}),
                                            ({"foreach": True}, {"fused": True}),
                                            ({"foreach": False}, {"fused": True})])
def test_the_optimizer_implementation_given_now_is_in_force_with_float16_loss_scaling(tmp_path, saved, now):
    """load_state_dict alone would bring back the saved foreach/fused settings; with a GradScaler a fused
    SGD built as another then fails its first step ("Expected grad_scale and found_inf to be None")."""
    args = run_args(tmp_path, amp_dtype="float16")
    model, optimizer, scaler = model_and_optimizer(saved, scaled=True)
    train_step(model, optimizer, scaler)
    checkpoint.Checkpoint(opts(args), one_process(), "distributed_apex.py", precision=torch.float16, model=model,
                          optimizer=optimizer, scaler=scaler).save(epoch=1)
    model, optimizer, scaler = model_and_optimizer(now, scaled=True)
    resumed = checkpoint.Checkpoint(opts(args), one_process(), "distributed_apex.py", precision=torch.float16,
                                    model=model, optimizer=optimizer, scaler=scaler)
    assert resumed.resume() == (1, 0)
    assert all(group.get(key) == value for group in optimizer.param_groups for key, value in now.items())
    assert scaler.get_scale() == 2.0 ** 16 and optimizer.state  # the saved scale and momentum came back
    train_step(model, optimizer, scaler)
    saved_state = load_checkpoint(tmp_path)
    assert saved_state["resolved"] == {"precision": "float16", "loss_scaling": True,
                                       "optimizer": {"foreach": saved.get("foreach"), "fused": saved.get("fused")}}


def write_checkpoint(tmp_path, precision_name, **resolved):
    args = run_args(tmp_path)
    model = models.resnet18_cifar()
    state = checkpoint.Checkpoint(opts(args), one_process(), "distributed_apex.py", model=model).state(
        model.state_dict(), epoch=1, step=0, epoch_loss=(0.0, 0.0))
    state["resolved"] = {"precision": precision_name, **resolved}
    torch.save(state, tmp_path / "checkpoint.pt")
    return args


def resolved_dtype(args):
    """What the scripts' autocast_dtype line gives for these flags and <output-dir>'s checkpoint."""
    path, state, _ = checkpoint.newest_readable(opts(args))
    recorded = checkpoint.recorded_precision(opts(args), path, state)
    return precision.autocast_dtype(args, CPU, is_main=True, recorded=recorded)


def test_auto_on_resume_keeps_the_precision_the_checkpoint_trained_in(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_has_native_bfloat16", lambda: True)  # a new run here: bfloat16
    args = write_checkpoint(tmp_path, "float16")  # as a GPU would have written it
    assert resolved_dtype(args) is torch.float16
    said = capsys.readouterr().err
    assert "continuing in float16" in said and "would pick bfloat16" in said
    args.amp_dtype = "float16"  # named, and the same: nothing to say
    assert resolved_dtype(args) is torch.float16
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("opt_level", "amp_dtype", "flag"), [("O1", "bfloat16", "--amp-dtype bfloat16"),
                                                              ("O0", "auto", "--opt-level O0")])
def test_another_precision_on_resume_is_refused_naming_the_flag(tmp_path, opt_level, amp_dtype, flag):
    args = write_checkpoint(tmp_path, "float16")
    args.opt_level, args.amp_dtype = opt_level, amp_dtype
    with pytest.raises(UsageError) as refused:
        resolved_dtype(args)
    assert "trained in float16" in str(refused.value) and f"without {flag}" in str(refused.value)
    assert "--init-from" in str(refused.value)


def test_a_new_run_or_evaluate_does_not_look_at_the_old_precision(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bfloat16", lambda: True)
    args = write_checkpoint(tmp_path, "float16")
    args.restart = True
    assert resolved_dtype(args) is torch.bfloat16
    args.restart, args.evaluate = False, True
    assert resolved_dtype(args) is torch.bfloat16


def test_keep_rotates_and_a_truncated_newest_falls_back_to_the_one_before(tmp_path, capsys):
    args = run_args(tmp_path)
    model = nn.Linear(3, 2)
    saver = checkpoint.Checkpoint(opts(args), one_process(), "distributed.py", model=model)
    for epoch in (1, 2, 3):
        saver.save(epoch=epoch)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == ["checkpoint.1.pt", "checkpoint.pt"]
    assert [checkpoint.load(p)["epoch"] for p in checkpoint.kept_paths(str(tmp_path))] == [3, 2]

    newest = tmp_path / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:200])  # a disk that died mid-write
    again = checkpoint.Checkpoint(opts(args), one_process(), "distributed.py", model=nn.Linear(3, 2))
    assert again.resume() == (2, 0)
    said = capsys.readouterr().out
    assert f"{newest} is not a readable checkpoint" in said and "continuing from" in said and "checkpoint.1.pt" in said
    assert len(list(tmp_path.glob("checkpoint.pt.unreadable-*"))) == 1
    again.save(epoch=3)  # the unreadable one is out of the rotation: the good epoch 2 stays kept
    assert [checkpoint.load(p)["epoch"] for p in checkpoint.kept_paths(str(tmp_path))] == [3, 2]


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "sharded directories"])
def test_rotation_keeps_the_newest_n_and_removes_the_rest(tmp_path, sharded):
    """rotate_in, the one rotation of checkpoint.pt files and of sharded checkpoint.dcp directories."""
    def written(n: int) -> str:  # a whole checkpoint that says n
        tmp = tmp_path / f"{n}.tmp"
        if sharded:
            tmp.mkdir()
        (tmp / "run.pt" if sharded else tmp).write_text(str(n))
        return str(tmp)

    def says(path: str) -> int:
        return int(Path(path, "run.pt" if sharded else "").read_text())

    for keep in (1, 2, 3):
        out = tmp_path / f"keep{keep}"
        out.mkdir()
        for n in range(1, 5):
            checkpoint.rotate_in(written(n), checkpoint.kept_path(str(out), 0, sharded), keep, sharded)
            assert [says(p) for p in checkpoint.kept_paths(str(out), sharded)] == [*range(n, max(n - keep, 0), -1)]
        assert len(os.listdir(out)) == keep
    assert not list(tmp_path.glob("*.tmp"))


def test_when_no_checkpoint_can_be_read_the_newest_is_refused_and_all_left_untouched(tmp_path):
    for name in ("checkpoint.pt", "checkpoint.1.pt"):
        (tmp_path / name).write_bytes(b"PK\x03\x04 half")
    with pytest.raises(UsageError, match="checkpoint.pt is not a readable checkpoint"):
        checkpoint.Checkpoint(opts(run_args(tmp_path)), one_process(), "distributed.py", model=nn.Linear(3, 2)).resume()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.pt", "checkpoint.pt", "run.lock"]


@pytest.mark.parametrize(("where", "code"), [("fsync", errno.ENOSPC), ("fsync", errno.EIO), ("replace", errno.EROFS)])
def test_a_failed_write_names_the_file_and_the_room_it_needed_and_keeps_the_previous(tmp_path, monkeypatch,
                                                                                     where, code):
    saver = checkpoint.Checkpoint(opts(run_args(tmp_path, keep=1)), one_process(), "distributed.py",
                                  model=nn.Linear(1000, 100))
    saver.save(epoch=1)
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def fails(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, where, fails)
    with pytest.raises(StorageError) as failed:
        saver.save(epoch=2)
    monkeypatch.undo()
    message = str(failed.value)
    assert f"could not write {tmp_path / 'checkpoint.pt'} ({os.strerror(code)};" in message
    assert "needs about 0 MB" in message and "is intact" in message  # 100,100 floats: 0.4 MB
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left


def test_init_from_reads_any_checkpoint_or_a_plain_state_dict(tmp_path):
    model = models.resnet18_cifar()
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp_state_dict.pt")
    weights = checkpoint.weights_of(str(tmp_path / "ddp_state_dict.pt"))
    assert weights.keys() == model.state_dict().keys()
    (tmp_path / "notes.pt").write_bytes(b"not a tensor file")
    with pytest.raises(UsageError, match="--init-from .*notes.pt is not readable"):
        checkpoint.weights_of(str(tmp_path / "notes.pt"))
    torch.save({"lr": 0.1}, tmp_path / "numbers.pt")
    with pytest.raises(UsageError, match="neither a checkpoint"):
        checkpoint.weights_of(str(tmp_path / "numbers.pt"))


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_costs_one_epoch_and_init_from_starts_a_new_run(tmp_path):
    """A world of one (the cheapest real run): the newest checkpoint truncated, the run redoes the epoch
    from the one before and ends with the same weights to the bit; then a new run from those weights."""
    first, second = tmp_path / "first", tmp_path / "second"
    base = launcher("python", "distributed.py") + TINY[:-2] + ["--epochs", "2"]
    check(run(base + ["--output-dir", str(first)]))
    finished = load_checkpoint(first)
    newest = first / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:4096])
    again = check(run(base + ["--output-dir", str(first)]))
    assert "is not a readable checkpoint" in again.stdout
    assert "checkpoint.1.pt, the checkpoint before it" in again.stdout
    assert "resuming from" in again.stdout and "epoch 2, step 0" in again.stdout
    redone = load_checkpoint(first)
    assert all(torch.equal(redone["model"][k], t) for k, t in finished["model"].items())
    assert [r["epoch"] for r in read_metrics(first)] == [1, 2]

    started = check(run(base + ["--epochs", "1", "--init-from", str(newest), "--output-dir", str(second)]))
    assert f"starting a new run from the weights in {newest}" in started.stdout
    new = load_checkpoint(second)
    assert new["run"]["init_from"] == str(newest) and new["epoch"] == 1
    assert (new["scheduler"]["last_epoch"], new["scheduler"]["T_max"]) == (1, 1)  # a fresh schedule of 1 epoch
    assert new["optimizer"]["param_groups"][0]["initial_lr"] == 0.1 * 16 / 256  # the default rate of batch 16
    assert not torch.equal(new["model"]["fc.weight"], finished["model"]["fc.weight"])  # and it trained on


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from safety_net import checkpoint; "
                               f"checkpoint.lock_output_dir({str(tmp_path)!r}); print('held', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError) as busy:
            checkpoint.check_output_dir_free(str(tmp_path))
        assert f"--output-dir {tmp_path} is in use by another run (process {holder.pid}" in str(busy.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    checkpoint.check_output_dir_free(str(tmp_path))  # no stale lock after a SIGKILL
    os.close(checkpoint.lock_output_dir(str(tmp_path)))


@pytest.mark.slow
def test_a_second_run_on_the_same_output_dir_stops_at_once_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    long = ["--dataset", "synthetic", "--train-samples", "1600", "--test-samples", "16", "--batch-size", "16",
            "--epochs", "1", "--workers", "0", "--print-freq", "1", "--output-dir", str(out)]
    first = Run(launcher("spawn", "distributed_mp.py") + long)  # 100 steps: it runs while the others try
    try:
        first.wait_for("epoch 1/1 step 1/100")
        files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        second = run(launcher("spawn", "distributed_mp.py") + long, timeout=120)  # the same job, submitted twice
        assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert f"error: --output-dir {out} is in use by another run (process" in second.stderr
        assert "distributed_mp.py --nprocs 2" in second.stderr  # who holds it
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files  # nothing touched, nothing new
        assert "step 2/100" in first.text or first.wait_for("step 3/100") is None  # the first one goes on
    finally:
        first.proc.send_signal(signal.SIGTERM)
        status, _ = first.finish(timeout=120)
    assert status == 128 + signal.SIGTERM, first.output
    assert load_checkpoint(out)["step"] >= 3  # its own checkpoint, written at its stop


def mount_tmpfs(path: Path, megabytes: int) -> bool:
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                            capture_output=True)
    return result.returncode == 0


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_with_one_line_and_the_previous_checkpoint_intact(tmp_path):
    disk = tmp_path / "small_disk"
    if not mount_tmpfs(disk, 150):  # room for one ResNet-18 checkpoint (about 86 MB), not for the next
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        started = Run(launcher("spawn", "distributed_mp.py") + TINY[:-2] + [
            "--epochs", "2", "--print-freq", "100", "--output-dir", str(disk / "run")])
        status, _ = started.finish(timeout=240)
        said = [line for line in started.text.splitlines() if "could not write" in line]
        assert status == 1 and len(said) == 1, started.output
        assert f"could not write {disk / 'run' / 'checkpoint.pt'} (No space left on device" in said[0]
        assert "a checkpoint needs about 8" in said[0] and "is intact" in said[0], said[0]
        assert "Traceback" not in started.text, started.output
        assert load_checkpoint(disk / "run")["epoch"] == 1
        assert not list((disk / "run").glob("*.tmp"))
        assert json.loads((disk / "run" / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 2
        assert not alive(process_tree(started.proc.pid)[1:])
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_cpu_float16_checkpoint_continues_with_another_optimizer_impl(tmp_path):
    """Resumed at an epoch's last step (the stop lands there), with --optimizer-impl fused instead of
    for-loop and float16 loss scaling on: the run continues, quietly, to its end. The signal comes after the
    last step, so the evaluation gives way and the ranks agree there: no float16 step (11 s on a CPU that
    emulates it) stands between the signal and the checkpoint."""
    # one step per epoch: each float16 step costs seconds on a CPU without float16 arithmetic
    small = ["--dataset", "synthetic", "--train-samples", "4", "--test-samples", "2", "--batch-size", "4",
             "--epochs", "2", "--workers", "0", "--print-freq", "1", "--amp-dtype", "float16",
             "--output-dir", str(tmp_path)]
    started = Run(launcher("spawn", "distributed_apex.py") + small + ["--optimizer-impl", "for-loop"])
    started.wait_for("epoch 1/2 step 1/1")
    started.proc.send_signal(signal.SIGTERM)
    status, _ = started.finish(timeout=120)
    assert status == 128 + signal.SIGTERM, started.output
    stopped = load_checkpoint(tmp_path)
    assert (stopped["epoch"], stopped["step"]) == (0, 1), started.output
    assert stopped["resolved"]["precision"] == "float16" and stopped["resolved"]["loss_scaling"]
    continued = check(run(launcher("spawn", "distributed_apex.py") + small + ["--optimizer-impl", "fused"]))
    assert "resuming from" in continued.stdout and "lr_scheduler" not in continued.stderr, continued.stderr
    final = load_checkpoint(tmp_path)
    assert final["epoch"] == 2 and final["resolved"]["optimizer"]["fused"] is True
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]
