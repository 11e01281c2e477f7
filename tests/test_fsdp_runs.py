"""distributed_fsdp.py through torchrun: a stop signal, a rank killed in the middle of a save, a diverging
run, bad input, and its sharded checkpoint made one file and evaluated exactly by the other scripts."""
import json
import os
import signal
import time

import pytest
import torch
from processes import Run, rank_process
from script_runs import check, launcher, read_metrics, run

from safety_net import checkpoint, sharded_checkpoint
from safety_net.sharded_checkpoint import to_single_file

# One epoch of 6 steps of a global batch of 16 in float32 (reproducible to the bit at one world size), a
# test set that 3 ranks split 6/5/5.
RUN = ["--dataset", "synthetic", "--train-samples", "96", "--test-samples", "16", "--batch-size", "16",
       "--epochs", "1", "--lr", "0.01", "--print-freq", "1", "--workers", "0", "--opt-level", "O0"]


def weights(sharded_dir) -> dict:
    """The full weights of a sharded checkpoint, read in this process (no process group)."""
    plain = sharded_dir.parent / f"{sharded_dir.name}.pt"
    if not plain.exists():
        to_single_file(str(sharded_dir), str(plain))
    return torch.load(plain, weights_only=True)["model"]


@pytest.fixture(scope="module")
def reference(module_dir):
    """The run never stopped, on 2 ranks."""
    out = module_dir("fsdp-never-stopped")
    check(run(launcher("torchrun", "distributed_fsdp.py") + RUN + ["--output-dir", str(out)]))
    return out


def assert_continues_to_the_reference(cmd, out, reference, step):
    again = check(run(cmd))
    assert f"resuming from {out / 'checkpoint.dcp'}: epoch 1, step {step}" in again.stdout, again.stdout
    assert not (out / "checkpoint.dcp.tmp").exists()  # the unfinished save is gone
    expected, got = weights(reference / "checkpoint.dcp"), weights(out / "checkpoint.dcp")
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_a_stop_signal_then_a_rank_killed_mid_save_and_the_same_command_continues_to_the_bit(reference, tmp_path):
    """A stop signal: every rank saves its shard at one step. The same command continues from there; rank 1,
    frozen and then killed in the middle of its next save, leaves that checkpoint as it was. The same
    command again ends with the weights of the run never stopped."""
    cmd = launcher("torchrun", "distributed_fsdp.py") + RUN + ["--save-every-steps", "1", "--output-dir", str(tmp_path)]
    newest, unfinished = tmp_path / "checkpoint.dcp", tmp_path / "checkpoint.dcp.tmp"
    started = Run(cmd)
    started.wait_for("epoch 1/1 step 2/6")
    os.kill(started.proc.pid, signal.SIGTERM)
    status, seconds = started.finish()
    # from the signal to the last process gone: within torchrun's 30 s before its SIGKILL
    assert status != 0 and seconds < 30, started.output
    (line,) = [x for x in started.text.splitlines() if x.startswith("stopped by SIGTERM at epoch 1, step")]
    stopped = checkpoint.load(str(newest))["step"]
    assert f"step {stopped}/6:" in line and 2 <= stopped < 5 and not unfinished.exists()

    continued = Run(cmd)
    deadline = time.monotonic() + 240
    while not unfinished.exists():  # its first save has begun
        assert time.monotonic() < deadline and continued.proc.poll() is None, continued.output
        time.sleep(0.001)
    rank1 = rank_process(continued.proc.pid, rank=1)
    os.kill(rank1, signal.SIGSTOP)  # frozen wherever it is in the save: rank 0 cannot finish it without it
    time.sleep(1)
    assert checkpoint.load(str(newest))["step"] == stopped  # no rank renamed a half-written checkpoint
    os.kill(rank1, signal.SIGKILL)
    assert continued.finish()[0] != 0
    assert unfinished.exists() and checkpoint.load(str(newest))["step"] == stopped
    assert_continues_to_the_reference(cmd, tmp_path, reference, stopped)


@pytest.mark.slow
def test_a_sharded_checkpoint_made_one_file_evaluates_exactly_in_other_scripts_and_world_sizes(reference, tmp_path,
                                                                                               capsys):
    trained = read_metrics(reference)[-1]
    # the arguments of python -m safety_net.sharded_checkpoint
    command = [str(reference / "checkpoint.dcp"), str(tmp_path / "checkpoint.pt")]
    (tmp_path / "checkpoint.1.pt").write_bytes(b"another run's")  # a file of its own: the rotation leaves this be
    with pytest.raises(SystemExit) as exited:
        sharded_checkpoint.main(command)
    assert exited.value.code == 0 and "epoch 1, step 0 of a 2-process run" in capsys.readouterr().out
    assert (tmp_path / "checkpoint.1.pt").read_bytes() == b"another run's"
    with pytest.raises(SystemExit) as exited:  # a name --evaluate does not read: the line says what does read it
        sharded_checkpoint.main([command[0], str(tmp_path / "model.pt")])
    assert exited.value.code == 0 and f"(--init-from {tmp_path / 'model.pt'} starts a run" in capsys.readouterr().out
    one_file = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert one_file["model"]["conv1.weight"].shape == (64, 3, 3, 3)  # whole, not a shard
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(SystemExit) as exited:
        sharded_checkpoint.main(command)
    assert exited.value.code == 2 and "exists" in capsys.readouterr().err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before  # not overwritten
    evaluations = {
        "distributed.py, 1 process, the one file": (launcher("python", "distributed.py"), tmp_path),
        "distributed_fsdp.py, 3 ranks, the 2 shards": (launcher("torchrun", "distributed_fsdp.py", 3), reference),
    }
    results = {}
    for name, (cmd, directory) in evaluations.items():
        flags = RUN if "fsdp" in name else [f for f in RUN if f not in ("--opt-level", "O0")]  # float32 both
        check(run(cmd + flags + ["--batch-size", "12", "--evaluate", "--output-dir", str(directory)]))  # 3 divide it
        results[name] = result = json.loads((directory / "eval.json").read_text())
        assert result["samples"] == 16, name  # every test image once
        for key in ("top1", "top5"):
            assert result[key] == trained[key], (name, key)
        # the training run summed batches of 8 on 2 ranks; these, batches of 12 on one and of 4 on 3
        assert result["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-6), name


@pytest.mark.slow
def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_finite_shards(tmp_path):
    result = run(launcher("python", "distributed_fsdp.py") + RUN + [
        "--lr", "1e8", "--save-every-steps", "1", "--print-freq", "100", "--output-dir", str(tmp_path)])
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error:" in line and "diverged" in line]
    assert len(errors) == 1 and "--lr than 1e+08" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert 1 <= checkpoint.load(str(tmp_path / "checkpoint.dcp"))["step"] < 6
    assert all(torch.isfinite(t).all() for t in weights(tmp_path / "checkpoint.dcp").values() if t.is_floating_point())


@pytest.mark.parametrize(("argv", "says"), [
    (["--amp-dtype", "float16"], "invalid choice: 'float16'"),
    (["--comm-hook", "fp16"], "unrecognized arguments: --comm-hook"),
    (["--opt-level", "O0", "--amp-dtype", "bfloat16"], "needs mixed precision"),
    (["--units", "model", "--no-reshard-after-forward"], "--no-reshard-after-forward is for --units stages"),
    (["--units", "layers"], "invalid choice: 'layers'"),
])
def test_bad_flags_are_one_line(argv, says, capsys):
    import distributed_fsdp
    with pytest.raises(SystemExit) as exited:
        distributed_fsdp.parse_args(argv)
    said = capsys.readouterr().err
    assert exited.value.code == 2 and said.count("\n") == 1 and says in said, said


@pytest.mark.slow
def test_a_single_file_checkpoint_to_resume_is_one_line(reference, tmp_path):
    weights(reference / "checkpoint.dcp")  # made one file: checkpoint.dcp.pt
    result = run(launcher("python", "distributed_fsdp.py") + RUN + [
        "--resume", str(reference / "checkpoint.dcp.pt"), "--output-dir", str(tmp_path)])
    assert result.returncode == 2 and "distributed_fsdp.py continues from a sharded one" in result.stderr, result.stderr
    assert result.stderr.count("error:") == 1


@pytest.mark.slow
def test_init_from_a_sharded_checkpoint_starts_a_new_run_from_its_weights(reference, tmp_path):
    result = check(run(launcher("python", "distributed_fsdp.py") + RUN + [
        "--init-from", str(reference / "checkpoint.dcp"), "--lr", "0", "--train-samples", "16",
        "--output-dir", str(tmp_path)]))
    assert f"starting a new run from the weights in {reference / 'checkpoint.dcp'}" in result.stdout
    expected, got = weights(reference / "checkpoint.dcp"), weights(tmp_path / "checkpoint.dcp")
    for key, tensor in expected.items():  # at --lr 0 only BatchNorm's running statistics move
        if "running" not in key and "num_batches" not in key:
            assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_the_one_unit_layout_trains_in_bfloat16_and_its_shards_evaluate_in_the_stage_layout(tmp_path):
    """--units model: the whole model one FSDP unit, the step under bfloat16 autocast, trains under torchrun; its
    sharded checkpoint holds the same keys as the stage layout's, whose --evaluate on one process reads it and counts
    every test image, near the loss the training run measured (the two layouts cast in different places)."""
    # 2 steps: a CPU without bfloat16 instructions emulates them (6 steps took 90 CPU seconds, 2 take 49)
    check(run(launcher("torchrun", "distributed_fsdp.py") + RUN[:-2] + [
        "--train-samples", "32", "--units", "model", "--amp-dtype", "bfloat16", "--output-dir", str(tmp_path)]))
    (trained,) = read_metrics(tmp_path)
    assert checkpoint.load(str(tmp_path / "checkpoint.dcp"))["resolved"]["precision"] == "bfloat16"
    check(run(launcher("python", "distributed_fsdp.py") + RUN[:-2] + [
        "--amp-dtype", "bfloat16", "--evaluate", "--output-dir", str(tmp_path)]))
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["samples"] == 16 and trained["samples"] == 16
    assert evaluated["test_loss"] == pytest.approx(trained["test_loss"], rel=0.05), (evaluated, trained)
