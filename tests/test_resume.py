"""Checkpoints and resume: a killed rank costs the steps since the last checkpoint, never the run."""
import datetime
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from script_runs import (
    ROOT,
    check,
    launcher,
    load_checkpoint,
    read_metrics,
    run,
    run_main,
    stop_handlers_undone,
    subprocess_env,
)
from torch import nn

from examples.local_processes import descendants
from safety_net import checkpoint
from utils.errors import UsageError

# 2 epochs of 6 steps, a checkpoint every 2 steps; lr 0.01 keeps float32 runs at other world sizes close
RUN = ["--dataset", "synthetic", "--train-samples", "96", "--test-samples", "16", "--batch-size", "16",
       "--epochs", "2", "--lr", "0.01", "--workers", "0", "--print-freq", "1", "--save-every-steps", "2"]


@pytest.fixture(scope="module")
def reference(module_dir):
    """An uninterrupted 2-rank run (torchrun and spawn give the same weights to the bit)."""
    out = module_dir("reference")
    check(run(launcher("torchrun", "distributed.py") + RUN + ["--output-dir", str(out)]))
    return out


def is_rank(pid: int, rank: int) -> bool:
    """A worker process of rank `rank`: torchrun exports RANK; spawn's workers are counted in start order."""
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return f"RANK={rank}".encode() in environ or (b"spawn_main" in cmdline and rank == -1)


def run_and_kill(cmd: list[str], kill_after_line: str, rank: int):
    """Start cmd; when rank 0 prints kill_after_line, SIGKILL a worker. Returns (process result, output,
    seconds from the kill to the first training step after it)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output, killed_at, back_after = [], None, None
    for line in proc.stdout:
        output.append(line)
        if killed_at is None and kill_after_line in line:
            workers = [p for p in descendants(proc.pid) if is_rank(p, rank)]
            os.kill(workers[-1], signal.SIGKILL)
            killed_at = time.perf_counter()
        elif killed_at and back_after is None and " step " in line and "loss" in line:
            back_after = time.perf_counter() - killed_at
    proc.wait(timeout=300)
    assert killed_at, "".join(output)
    return proc, "".join(output), back_after


def without_progress(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if " step " not in line)[-6000:]


def assert_same_weights_bit_for_bit(a: Path, b: Path, epochs: int = 2):
    expected, got = load_checkpoint(a), load_checkpoint(b)
    assert (got["epoch"], got["step"]) == (expected["epoch"], expected["step"]) == (epochs, 0)
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    for want, have in zip(expected["optimizer"]["state"].values(), got["optimizer"]["state"].values(),
                          strict=True):
        assert torch.equal(have["momentum_buffer"], want["momentum_buffer"])


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_as_if_never_killed(reference, tmp_path):
    cmd = [*launcher("torchrun", "distributed.py")[:3], "--max-restarts=1", *launcher("torchrun", "distributed.py")[3:]]
    proc, output, back_after = run_and_kill(cmd + RUN + ["--output-dir", str(tmp_path)], "epoch 1/2 step 3/6",
                                            rank=1)
    assert proc.returncode == 0, without_progress(output)
    # the kill lands after step 3, during step 4: the last whole checkpoint is step 2 (or 4, if it was written)
    assert "resuming from" in output and ("epoch 1, step 2" in output or "epoch 1, step 4" in output), output
    print(f"\nfrom the kill to training again: {back_after:.1f} s")
    assert_same_weights_bit_for_bit(reference, tmp_path)
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]
    for got, want in zip(read_metrics(tmp_path), read_metrics(reference), strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)  # the whole epoch's mean


@pytest.mark.slow
def test_spawn_script_killed_and_restarted_by_hand(reference, tmp_path):
    out = tmp_path / "run"
    cmd = launcher("spawn", "distributed_mp.py") + RUN + ["--output-dir", str(out)]
    proc, output, _ = run_and_kill(cmd, "epoch 2/2 step 3/6", rank=-1)
    # mp.spawn stops the other rank, and the user learns which one died and how
    assert proc.returncode != 0 and "terminated with signal SIGKILL" in output, without_progress(output)
    assert not [p for p in descendants(proc.pid)]
    elastic = tmp_path / "elastic"
    shutil.copytree(out, elastic)
    again = check(run(cmd))
    assert "resuming from" in again.stdout and "epoch 2, step 2" in again.stdout, again.stdout
    assert_same_weights_bit_for_bit(reference, out)

    # the same checkpoint continued by 1 process: same global batch, from the same step
    one = check(run(launcher("spawn", "distributed_mp.py", nprocs=1) + RUN + ["--output-dir", str(elastic)]))
    assert "epoch 2, step 2" in one.stdout
    checkpoint = load_checkpoint(elastic)
    assert checkpoint["world_size"] == 1 and checkpoint["batch_size"] == 16 and checkpoint["epoch"] == 2
    metrics = read_metrics(elastic)
    assert [r["world_size"] for r in metrics] == [2, 1]
    assert metrics[1]["train_loss"] == pytest.approx(read_metrics(reference)[1]["train_loss"], rel=1e-2)


@pytest.mark.slow
def test_a_warmed_up_run_continues_mid_epoch_to_the_same_weights(tmp_path):
    """--warmup-epochs: the schedule (linear warm-up, then the cosine) travels with the checkpoint. Resumed in
    its second epoch, the run must step on to the cosine's second rate; a schedule started afresh would give
    the third epoch the first (a rate the optimizer's saved state does not carry across an epoch's end)."""
    # batches of 8 (48 images): the same 6 steps per epoch, checkpoints and rates, at half the arithmetic
    cmd = launcher("python", "distributed.py") + RUN + ["--epochs", "3", "--warmup-epochs", "1", "--keep", "5",
                                                        "--train-samples", "48", "--batch-size", "8"]
    check(run(cmd + ["--output-dir", str(tmp_path / "whole")]))
    assert [r["lr"] for r in read_metrics(tmp_path / "whole")] == pytest.approx([0.0001, 0.01, 0.005])
    mid_epoch_2 = tmp_path / "whole" / "checkpoint.4.pt"  # 9 saves, 5 kept: the oldest is epoch 2, step 4
    state = torch.load(mid_epoch_2, weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 4)
    check(run(cmd + ["--resume", str(mid_epoch_2), "--output-dir", str(tmp_path / "continued")]))
    assert_same_weights_bit_for_bit(tmp_path / "whole", tmp_path / "continued", epochs=3)


@pytest.mark.slow
def test_restart_keeps_the_old_checkpoint(reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = (out / "checkpoint.pt").read_bytes()
    check(run(launcher("python", "distributed.py") + RUN + ["--epochs", "1", "--train-samples", "16", "--restart",
                                                            "--output-dir", str(out)]))
    kept = [p for p in out.iterdir() if p.name.startswith("checkpoint.pt.")]
    assert len(kept) == 1 and kept[0].read_bytes() == before
    assert load_checkpoint(out)["epoch"] == 1


@pytest.mark.slow
def test_resume_from_a_named_checkpoint(reference, tmp_path):
    result = check(run(launcher("python", "distributed.py") + RUN + [
        "--resume", str(reference / "checkpoint.pt"), "--output-dir", str(tmp_path)]))
    assert "nothing left to train" in result.stdout and "resuming from" not in result.stdout  # not "epoch 3 of 2"
    assert not (tmp_path / "checkpoint.pt").exists() or load_checkpoint(tmp_path)["epoch"] == 2


@pytest.mark.slow
def test_resume_with_other_flags_is_refused(reference, tmp_path, capsys):
    """Refused by the checks before the process group forms: main(argv) in this process, as `python distributed.py`
    runs it (no subprocess spending seconds on importing torch)."""
    import distributed
    shutil.copytree(reference, tmp_path / "out")
    result = run_main(distributed.main, RUN + ["--lr", "0.1", "--output-dir", str(tmp_path / "out")], capsys)
    assert result.returncode == 2 and "--lr 0.01" in result.stderr and "--restart" in result.stderr
    assert "--init-from" in result.stderr  # "train it longer" or fine-tune: a new run from these weights


def tiny_checkpoints(tmp_path, model):
    options = checkpoint.Options(output_dir=str(tmp_path), seed=0, batch_size=4, epochs=3, lr=0.1)
    env = SimpleNamespace(is_main=True, world_size=1, device=torch.device("cpu"))
    return checkpoint.Checkpoint(options, env, "distributed.py", model=model)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model = nn.Linear(3, 2)
    checkpoints = tiny_checkpoints(tmp_path, model)
    checkpoints.save(1)
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def dies_halfway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the process is stopped mid-write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2)
    monkeypatch.undo()
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert checkpoint.load(str(tmp_path / "checkpoint.pt"))["epoch"] == 1


@pytest.mark.slow
def test_truncated_and_foreign_checkpoints_are_refused_untouched(reference, tmp_path):
    data = (reference / "checkpoint.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        checkpoint.load(str(truncated))
    assert truncated.read_bytes() == data[: len(data) // 2]

    other_arch = tmp_path / "other.pt"
    torch.save({**load_checkpoint(reference), "model": nn.Linear(3, 2).state_dict()}, other_arch)
    from utils.models import resnet18_cifar
    with pytest.raises(UsageError, match="another architecture"):
        tiny_checkpoints(tmp_path, resnet18_cifar()).set_weights(checkpoint.load(str(other_arch))["model"],
                                                                 str(other_arch))

    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(UsageError, match="not a resnet18-cifar checkpoint"):
        checkpoint.load(str(foreign))


def wait_for_a_peer_that_never_comes(rank, world_size, port, event, results):
    """Rank 1 joins, then hangs; rank 0's next collective must fail after --dist-timeout seconds."""
    from utils import collectives
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # as distributed_mp.py's ranks (--dist-timeout 3)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        event.wait(60)  # alive but silent, like a frozen or partitioned machine
        os._exit(0)
    start = time.perf_counter()
    try:
        collectives.all_reduce_sum(torch.ones(1))
        results.put(("completed", 0.0))
    except RuntimeError as error:
        results.put((str(error).splitlines()[0][:200], time.perf_counter() - start))
    finally:
        event.set()


def test_a_silent_peer_fails_the_collective_within_the_timeout():
    from distributed_helpers import new_processes

    from utils.spawn import free_port
    ctx = new_processes()
    event, results = ctx.Event(), ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=wait_for_a_peer_that_never_comes, args=(r, 2, port, event, results))
             for r in range(2)]
    for p in procs:
        p.start()
    message, seconds = results.get()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert message != "completed" and 2.5 < seconds < 20, (message, seconds)


def test_a_resuming_process_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """The checks before the process group, the precision to train in and the resume itself all need the
    checkpoint; a process reads the file once for the three (a ResNet-18 checkpoint is 90 MB), and keeps it no
    longer than its resume."""
    import safety_net
    tiny_checkpoints(tmp_path, nn.Linear(3, 2)).save(1)
    reads, read = [], checkpoint._read
    monkeypatch.setattr(checkpoint, "_read", lambda path: reads.append(path) or read(path))
    options = checkpoint.Options(output_dir=str(tmp_path), seed=0, batch_size=4, epochs=3, lr=0.1)
    env = SimpleNamespace(is_main=True, world_size=1, device=torch.device("cpu"), rank=0)
    with stop_handlers_undone(), safety_net.SafetyNet("distributed.py", options) as safety:
        assert safety.recorded_precision() == ("float32", str(tmp_path / "checkpoint.pt"))
        safety.env = env
        assert safety.resume(steps_per_epoch=4, model=nn.Linear(3, 2)) == 1
        assert safety.newest is None
    assert len(reads) == 1, reads
