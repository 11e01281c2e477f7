"""distributed_pipeline.py as a user runs it, under torchrun on 2 CPU ranks (2 stages): Ctrl-C mid-epoch stops both
stages at one step with a checkpoint (each stage writing its layers' part) and leaves no process, the same command
continues from there to the weights of a run never stopped, bit for bit, and one process evaluates the checkpoint,
every test image once. The run never stopped is profiled (--profile-steps): its stages send each micro-batch's
activations and their gradients point to point, and idle while the pipeline fills and drains (the timeline's bubble).

Its equality with one process accumulating the same micro-batches, at 2 and 3 stages and clipped, and its resume at
another number of stages, are proven in float64 in tests/test_scripts_equal.py.
"""
import json
import os
import signal

import pytest
import torch
from processes import Run
from script_runs import TINY, check, launcher, read_metrics, run

from safety_net.sharded_checkpoint import to_single_file
from tools import timeline

STEPS = ["--train-samples", "96", "--microbatches", "4"]  # 6 steps of the global batch of 16 in TINY


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_mid_epoch_then_the_same_command_ends_on_the_weights_of_a_run_never_stopped(tmp_path):
    command = launcher("torchrun", "distributed_pipeline.py") + TINY + STEPS
    never_stopped = tmp_path / "never-stopped"  # its steps 3 and 4 profiled: the same arithmetic, the bubble drawn
    check(run(command + ["--profile-steps", "2", "--output-dir", str(never_stopped)]))
    lanes = timeline.read_run(never_stopped)
    assert len(lanes) == 2
    for lane in lanes:
        kinds = {c.asked for c in lane.collectives}
        assert {"send", "recv"} <= kinds, kinds  # activations forward, their gradients back: point to point
        assert {c.size for c in lane.collectives if c.asked in ("send", "recv")} == {4 * 128 * 16 * 16 * 4}  # layer2
    for step in timeline.pipeline_idle(lanes):  # each stage waits while the pipeline fills and drains
        assert all(0.05 < share < 0.95 for share in step), step
    timeline.main([str(never_stopped)])
    assert (never_stopped / "timeline.png").stat().st_size > 1000
    stopped = tmp_path / "stopped"
    started = Run(command + ["--output-dir", str(stopped)])
    started.wait_for("epoch 1/1 step 2/6")
    os.kill(started.proc.pid, signal.SIGINT)  # Ctrl-C to torchrun, which passes it on to both stages
    status, seconds = started.finish()
    # from the signal to the last process gone: within torchrun's 30 s before its SIGKILL
    assert status != 0 and seconds < 30 and "stopped by SIGINT at epoch 1, step" in started.text, started.output
    header = torch.load(stopped / "checkpoint.dcp" / "run.pt", weights_only=True)
    assert header["script"] == "distributed_pipeline.py" and 2 <= header["step"] < 6, header
    again = check(run(command + ["--output-dir", str(stopped)]))
    assert f"resuming from {stopped / 'checkpoint.dcp'}: epoch 1, step {header['step']}" in again.stdout, again.stdout
    expected = to_single_file(str(never_stopped / "checkpoint.dcp"), str(tmp_path / "never-stopped.pt"))
    got = to_single_file(str(stopped / "checkpoint.dcp"), str(tmp_path / "stopped.pt"))
    for key, value in expected["model"].items():  # the same stages, micro-batches and order: the same arithmetic
        assert torch.equal(got["model"][key], value), key
    for key, value in expected["optimizer"].items():
        assert torch.equal(got["optimizer"][key], value) if isinstance(value, torch.Tensor) else True, key
    (epoch,) = read_metrics(stopped)
    check(run(launcher("python", "distributed_pipeline.py") + TINY + STEPS + ["--evaluate", "--output-dir",
                                                                              str(stopped)]))
    evaluated = json.loads((stopped / "eval.json").read_text())
    assert evaluated["samples"] == epoch["samples"] == 21 and evaluated["top1"] == pytest.approx(epoch["top1"])
