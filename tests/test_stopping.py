"""Stop signals, a launcher killed outright, and divergence: every rank stops at the same step with a
checkpoint, no process is left, and the same command continues to the weights of a run never stopped."""
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed_helpers import on_ranks
from processes import Run, rank_process
from script_runs import ROOT, check, launcher, load_checkpoint, run, subprocess_env

from examples.local_processes import alive, process_tree
from safety_net import stopping
from safety_net.stopping import StopSignals
from utils import metrics
from utils.spawn import STOP_SIGNALS, free_port

# One epoch of 6 steps: a stop lands mid-epoch, and the continued run has steps left to prove it right.
RUN = ["--dataset", "synthetic", "--train-samples", "96", "--test-samples", "16", "--batch-size", "16",
       "--epochs", "1", "--lr", "0.01", "--print-freq", "1"]


@pytest.fixture(scope="module")
def reference(module_dir):
    """The run never stopped (2 ranks; every launcher gives the same weights to the bit)."""
    out = module_dir("never-stopped")
    check(run(launcher("torchrun", "distributed.py") + RUN + ["--workers", "0", "--output-dir", str(out)]))
    return out


def assert_continues_to_the_reference(cmd: list[str], out: Path, reference: Path, step_said: str, env=None):
    """The checkpoint holds the step the stop line named; the same command finishes the run bit for bit."""
    checkpoint = load_checkpoint(out)
    assert checkpoint["epoch"] == 0 and f"step {checkpoint['step']}/6" in step_said, step_said
    again = subprocess.run(cmd, cwd=ROOT, env=env or subprocess_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"epoch 1, step {checkpoint['step']}" in again.stdout, again.stdout
    expected, got = load_checkpoint(reference), load_checkpoint(out)
    assert (got["epoch"], got["step"]) == (1, 0)
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def stop_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1, output  # rank 0 speaks, once
    return lines[0]


# one continuation by a launcher here; the SLURM test continues an srun-like start (the torchrun code
# path), and test_resume continues torchrun restarts: each costs the suite a run
CONTINUED = ("spawn parent, SIGTERM",)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["spawn parent, SIGTERM", "torchrun agent, SIGINT", "one worker, SIGTERM",
                                 "process group, SIGTERM"])
def test_a_stop_signal_saves_the_step_and_the_same_command_continues(how, reference, tmp_path):
    kind, signum = {"spawn parent, SIGTERM": ("spawn", signal.SIGTERM),
                    "torchrun agent, SIGINT": ("torchrun", signal.SIGINT),
                    "one worker, SIGTERM": ("torchrun", signal.SIGTERM),
                    "process group, SIGTERM": ("spawn", signal.SIGTERM)}[how]
    script = "distributed.py" if kind == "torchrun" else "distributed_mp.py"
    # DataLoader workers, which a signal to the process group reaches too (scancel), in one case: they inherit
    # the rank's handlers of SIGINT and SIGUSR1, but torch's own SIGTERM handler in a worker dies of a signal
    # not from its rank, and the rank's next batch would fail
    cmd = launcher(kind, script) + RUN + ["--workers", "1" if how.startswith("process group") else "0",
                                          "--output-dir", str(tmp_path)]
    started = Run(cmd)
    started.wait_for("epoch 1/1 step 2/6")
    if how.startswith("one worker"):
        os.kill(rank_process(started.proc.pid, rank=1), signum)
    elif how.startswith("process group"):
        os.killpg(started.proc.pid, signum)
    else:
        os.kill(started.proc.pid, signum)
    status, seconds = started.finish()
    print(f"\n{how}: {seconds:.1f} s from the signal to the last process gone")
    line = stop_line(started.text)
    assert f"stopped by {signal.Signals(signum).name} at epoch 1, step" in line and "run the same command" in line
    if kind == "spawn":
        assert status == 128 + signum, started.output
    else:  # torchrun reports its workers' exit status 128 + N as a failure, or dies of the signal itself
        assert status != 0, started.output
    assert seconds < 30  # torchrun and SLURM send SIGKILL 30 s after SIGTERM
    if not how.startswith("one worker"):  # rank 0 got the signal too: it said at once where the run would stop
        assert f"{signal.Signals(signum).name}: stopping after step" in started.text, started.output
        again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"  # kill -TERM: no terminal to press
        assert f"; {again} leaves at once" in started.text, started.output
    assert "warning: a step takes" not in started.text  # these steps fit torchrun's 30 s before SIGKILL
    if how in CONTINUED:
        assert_continues_to_the_reference(cmd, tmp_path, reference, line)
    else:
        assert f"step {load_checkpoint(tmp_path)['step']}/6:" in line


def fake_scontrol(folder: Path, requeueable: bool, refuses: str = "") -> Path:
    """A stand-in for SLURM's scontrol that records its arguments; `refuses`: what its requeue says as it fails."""
    log = folder / "scontrol.log"
    script = folder / "scontrol"
    refused = f'if [ "$1" = requeue ]; then echo "{refuses}" >&2; exit 1; fi' if refuses else ""
    script.write_text(f"""#!/bin/sh
echo "$@" >> {log}
if [ "$1" = show ]; then echo "JobId=$4 JobName=cifar Requeue={int(requeueable)} Restarts=0"; fi
{refused}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


@pytest.mark.slow
def test_slurm_usr1_saves_then_requeues_the_job_and_the_requeued_job_continues(reference, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = fake_scontrol(bin_dir, requeueable=True)
    out = tmp_path / "out"
    port = str(free_port())
    cmd = launcher("python", "distributed.py") + RUN + ["--workers", "0", "--output-dir", str(out)]

    def task_env(rank: int) -> dict:
        return subprocess_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                              SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", MASTER_PORT=port,
                              PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    tasks = [Run(cmd, task_env(rank)) for rank in (0, 1)]
    tasks[0].wait_for("epoch 1/1 step 2/6")
    for task in tasks:  # #SBATCH --signal=USR1@90 signals every task of the job step
        os.kill(task.proc.pid, signal.SIGUSR1)
    results = [task.finish() for task in tasks]
    assert [status for status, _ in results] == [128 + signal.SIGUSR1] * 2, tasks[0].output + tasks[1].output
    line = stop_line(tasks[0].text)
    assert "SLURM job 4242 requeued" in tasks[0].text
    assert log.read_text().splitlines() == ["show job -o 4242", "requeue 4242"]  # rank 0 alone requeues
    rank0_env = task_env(0)
    continued = Run(cmd, task_env(1))  # the requeued job: the same tasks run the same command
    assert_continues_to_the_reference(cmd, out, reference, line, env=rank0_env)
    assert continued.finish(timeout=120)[0] == 0, continued.output


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["spawn", "torchrun"])
def test_a_launcher_killed_outright_leaves_no_rank_running(kind, tmp_path):
    script = "distributed.py" if kind == "torchrun" else "distributed_mp.py"
    started = Run(launcher(kind, script) + RUN + ["--workers", "0", "--output-dir", str(tmp_path)])
    started.wait_for("epoch 1/1 step 1/6")
    ranks = [p for p in process_tree(started.proc.pid) if p != started.proc.pid]
    os.kill(started.proc.pid, signal.SIGKILL)
    status, seconds = started.finish(started=ranks)  # fails, naming them, if a rank outlives 60 s
    print(f"\n{kind} killed: its ranks gone {seconds:.1f} s later")
    assert status == -signal.SIGKILL and not alive(ranks)
    # whichever rank's watcher saw it first (test_a_launcher_gone_on_one_rank_is_named_by_every_rank)
    assert "stopped by the launcher's exit" in started.text, started.output
    assert "checkpoint written" in started.text, started.output


def copy_with_slow_steps(folder: Path, step_s: float | str, floor_s: float | None = None) -> Path:
    """The scripts and their packages copied into `folder`, each training step `step_s` seconds slower (the script's
    loop sleeps after the optimizer's step: a busy machine, a bigger batch; an expression of the loop's names, for a
    rank that hangs). floor_s: the copy's safety_net.stopping.FLOOR_S, the least a stop waits before it calls the
    run stuck."""
    copy = folder / "slow"
    copy.mkdir()
    for script in ("distributed.py", "distributed_mp.py"):
        text = (ROOT / script).read_text().replace("import sys\n", "import sys\nimport time\n", 1)
        (copy / script).write_text(text.replace("        optimizer.step()\n", "        optimizer.step()\n"
                                                f"        time.sleep({step_s})  # a slow step\n", 1))
    for package in ("utils", "speed", "safety_net"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    if floor_s is not None:
        path = copy / "safety_net" / "stopping.py"
        path.write_text(re.sub(r"^FLOOR_S = \d+", f"FLOOR_S = {floor_s}", path.read_text(), count=1, flags=re.M))
    return copy


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_waits_for_a_step_slower_than_the_floor_and_the_same_command_continues(reference, tmp_path):
    # steps of 3 s against a floor of 1 s: a fixed wait as long as the floor (the old 25 s, in this test's seconds)
    # would leave without a checkpoint; the wait follows the steps instead
    slow = copy_with_slow_steps(tmp_path, step_s=3, floor_s=1)
    out = tmp_path / "out"
    flags = RUN + ["--workers", "0", "--output-dir", str(out)]
    started = Run([sys.executable, str(slow / "distributed_mp.py"), "--nprocs", "2", *flags])
    started.wait_for("epoch 1/1 step 1/6")
    time.sleep(0.5)  # step 2 under way
    os.killpg(started.proc.pid, signal.SIGINT)  # Ctrl-C: every process gets it, and the ranks also the parent's copy
    started.wait_for("SIGINT: stopping after step 2/6 of epoch 1")
    status, seconds = started.finish()
    print(f"\nCtrl-C during 3 s steps: {seconds:.1f} s from the announcement to the last process gone")
    line = stop_line(started.text)
    assert status == 130 and "stopped by SIGINT at epoch 1, step 2/6" in line, started.output
    assert "second SIGINT" not in started.text  # the parent's copy of the one Ctrl-C is no second one
    assert_continues_to_the_reference(launcher("spawn", "distributed_mp.py") + flags, out, reference, line)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_leaves_at_once_with_the_last_checkpoint_and_no_process(tmp_path):
    slow = copy_with_slow_steps(tmp_path, step_s=6)
    out = tmp_path / "out"
    # a checkpoint after every step, and a DataLoader worker per rank: none may be left behind
    started = Run([sys.executable, str(slow / "distributed_mp.py"), "--nprocs", "2", *RUN, "--workers", "1",
                   "--save-every-steps", "1", "--output-dir", str(out)])
    started.wait_for("epoch 1/1 step 1/6")
    time.sleep(1)  # step 1's checkpoint written, step 2 under way
    os.killpg(started.proc.pid, signal.SIGINT)
    started.wait_for("SIGINT: stopping after step 2/6 of epoch 1")
    time.sleep(stopping.REPEAT_S + 0.5)  # a second Ctrl-C, not a copy of the first
    os.killpg(started.proc.pid, signal.SIGINT)
    status, seconds = started.finish(timeout=30)  # every process gone, or the test fails naming them
    print(f"\na second Ctrl-C: {seconds:.1f} s to the last process gone")
    lines = [line for line in started.text.splitlines() if "second SIGINT" in line]
    # at once: no new checkpoint (step 1's kept) and no stop line, where finishing step 2 would have saved it; no
    # bound in seconds: leaving at once and finishing the 6 s step both take a few seconds on a busy machine
    assert status == 130 and len(lines) == 1, started.output
    assert lines[0].endswith(f"left at once without a new checkpoint; the last one, {out / 'checkpoint.pt'}, is kept")
    assert "stopped by SIGINT at" not in started.text and "Traceback" not in started.text, started.output
    assert load_checkpoint(out)["step"] == 1 and not list(out.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_steps_too_slow_for_torchruns_sigkill_are_told_at_the_start_and_a_sigterm_ends_before_it(tmp_path):
    slow = copy_with_slow_steps(tmp_path, step_s=3)
    out = tmp_path / "out"
    # torchrun sends SIGKILL 4 s after passing a signal on: no 3 s step and its checkpoint fit in that
    started = Run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "--shutdown-timeout", "4", str(slow / "distributed.py"), *RUN, "--workers", "0",
                   "--output-dir", str(out)])
    started.wait_for("warning: a step takes about")  # at the second step: the first is the warm-up
    os.kill(started.proc.pid, signal.SIGTERM)  # to the agent, as a scheduler does
    status, seconds = started.finish()
    print(f"\nSIGTERM under torchrun --shutdown-timeout 4: {seconds:.1f} s to the last process gone")
    text = started.text
    warnings = [line for line in text.splitlines() if "warning: a step takes" in line]
    assert len(warnings) == 1 and "torchrun sends SIGKILL 4 s after a signal (its --shutdown-timeout)" in warnings[0]
    assert "--shutdown-timeout" in warnings[0] and "--save-every-steps" in warnings[0], warnings[0]
    errors = [line for line in text.splitlines() if line.startswith("distributed.py: error:")]
    assert len(errors) == 1 and "did not save its step within 2 s, and torchrun sends SIGKILL 4 s after the " \
        "signal" in errors[0], started.output
    # no SIGKILL came: torchrun logs "forcefully exiting" when its --shutdown-timeout passes with a worker alive (no
    # bound in seconds: torchrun's own exit, after its workers', is not what the 4 s limit counts)
    assert status != 0 and "forcefully exiting" not in text, started.output
    assert not (out / "checkpoint.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stop_ends_a_run_whose_rank_hangs_and_says_so(tmp_path):
    # rank 1 hangs in step 3 (rank 0 waits for it in the next collective); a floor of 2 s, not 60
    slow = copy_with_slow_steps(tmp_path, "600 if dist.get_rank() == 1 and safety.progress.step == 2 else 0", 2)
    out = tmp_path / "out"
    started = Run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   str(slow / "distributed.py"), *RUN, "--workers", "0", "--save-every-steps", "1",
                   "--output-dir", str(out)])
    started.wait_for("epoch 1/1 step 2/6")
    time.sleep(2)  # step 2's checkpoint written, rank 1 hanging
    os.kill(started.proc.pid, signal.SIGINT)
    status, seconds = started.finish()
    print(f"\na rank hangs: {seconds:.1f} s from SIGINT to the last process gone")
    errors = [line for line in started.text.splitlines() if line.startswith("distributed.py: error:")]
    assert len(errors) == 1 and re.search(r"the run is stuck: nothing finished within \d+ s after SIGINT \(a step "
                                          r"takes about [\d.]+ s; a rank hangs\)", errors[0]), started.output
    assert errors[0].endswith(f"exiting without a new checkpoint, the last one, {out / 'checkpoint.pt'}, is kept")
    # from the signal: the copy's floor (2 s) and the exits, below the floor it replaces (FLOOR_S, 25 s), which a
    # stuck check that ignored the floor, or no stuck check (a hang until finish's 60 s), would pass
    assert status != 0 and seconds < stopping.FLOOR_S and "stopped by SIGINT at" not in started.text, started.output
    assert load_checkpoint(out)["step"] == 2


def test_the_spawn_parent_passes_on_every_signal_the_ranks_stop_on():
    """utils/spawn.py cannot import the safety net (utils comes first), so it names the stop signals again."""
    assert set(STOP_SIGNALS) == set(stopping.SIGNALS)


def test_torchruns_wait_before_sigkill_is_read_as_torchrun_reads_it():
    agent = ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "--shutdown-timeout", "90", "train.py"]
    assert stopping.torchrun_shutdown_timeout(agent, {}) == 90
    assert stopping.torchrun_shutdown_timeout(["torchrun", "--shutdown_timeout=45", "train.py"], {}) == 45
    assert stopping.torchrun_shutdown_timeout(["torchrun", "train.py"], {"PET_SHUTDOWN_TIMEOUT": "60"}) == 60
    assert stopping.torchrun_shutdown_timeout(["torchrun", "train.py"], {}) == 30  # torchrun's default


@pytest.mark.parametrize("scontrol, says, asked", [
    (None, "SLURM job 4242: scontrol not found, not requeued; submit the job again to continue", []),
    ({"requeueable": False}, "SLURM job 4242 is not requeueable (sbatch --requeue); submit it again to continue",
     ["show job -o 4242"]),
    ({"requeueable": True, "refuses": "Requested operation is presently disabled"},
     "SLURM job 4242: scontrol requeue failed (Requested operation is presently disabled)",
     ["show job -o 4242", "requeue 4242"]),
    ({"requeueable": True}, "SLURM job 4242 requeued: it continues from the checkpoint when it starts again",
     ["show job -o 4242", "requeue 4242"])])
def test_a_slurm_stop_says_whether_the_job_was_requeued_and_if_not_why(scontrol, says, asked, tmp_path,
                                                                        monkeypatch):
    """After a SIGUSR1's checkpoint: a job that cannot come back by itself says so and what to do (submit it again),
    rather than leaving the user to wait for a requeue that never comes; a job not requeueable is not asked to be."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path))  # this folder's scontrol, or none
    if scontrol is not None:
        log = fake_scontrol(tmp_path, **scontrol)
    assert stopping.requeue_slurm_job() == says
    assert (log.read_text().splitlines() if scontrol is not None else []) == asked
    monkeypatch.delenv("SLURM_JOB_ID")
    assert stopping.requeue_slurm_job() == ""  # not under SLURM: nothing to requeue, nothing said


def test_under_slurm_a_sigterm_leaves_killwait_to_save_and_a_slow_step_is_warned_of_with_slurms_own_advice(
        monkeypatch, capsys):
    """SLURM sends SIGKILL KillWait (30 s) after its SIGTERM, not after SIGUSR1 (its --signal warning) or Ctrl-C:
    a SIGTERM's stop gives up 25 s after it, and where a step is slower than a stop can save in within that, rank 0
    says so at the first timed step, advising SLURM's earlier signal (not torchrun's flag)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert stopping.kill_budget(signal.SIGTERM) == (30, "SLURM", "its KillWait, 30 s by default")
    assert stopping.kill_budget(signal.SIGUSR1) is None and stopping.kill_budget(signal.SIGINT) is None
    assert stopping.usable_s(30) == 25
    said = []
    for step_s in (11.0, 10.0):  # a stop saves within 2 steps and 5 s: 25 s fits steps of 10 s, not more
        stop = object.__new__(StopSignals)  # its state only: no signal handlers in pytest's own process
        stop._recent, stop._one_step, stop.is_main, stop._warned = [step_s], False, True, False
        stop._warn_if_a_stop_cannot_beat_sigkill()
        said.append(capsys.readouterr().err.strip().partition(": ")[2])  # after the program's name
        assert stop._warned
    assert said[1] == "", said
    assert said[0].startswith("warning: a step takes about 11 s, so a stop signal needs up to 27 s to save one; "
                              "SLURM sends SIGKILL 30 s after a signal (its KillWait, 30 s by default), and a stop "
                              "not saved 25 s after it exits without a new checkpoint; ask SLURM for the signal "
                              "earlier (#SBATCH --signal=USR1@SECONDS"), said[0]
    monkeypatch.delenv("SLURM_JOB_ID")
    assert stopping.kill_budget(signal.SIGTERM) is None  # a shell waits as long as the stop takes


@pytest.mark.slow
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # at --lr 1e8 the loss is finite for two steps, then NaN; a checkpoint after every step
    result = run(launcher("python", "distributed.py") + RUN + [
        "--workers", "0", "--lr", "1e8", "--save-every-steps", "1", "--print-freq", "100",
        "--output-dir", str(tmp_path)])
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "diverged" in errors[0] and "--lr than 1e+08" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    # the epoch's first step is printed whatever --print-freq, so a slow run says something within seconds
    assert "epoch 1/1 step 1/6 loss" in result.stdout and "step 2/6" not in result.stdout, result.stdout
    kept = load_checkpoint(tmp_path)
    assert 1 <= kept["step"] < 6
    assert all(torch.isfinite(t).all() for t in kept["model"].values() if t.is_floating_point())


def test_a_non_finite_model_never_overwrites_a_checkpoint(tmp_path):
    from test_resume import tiny_checkpoints

    from safety_net.stop_errors import Diverged
    model = torch.nn.Linear(3, 2)
    checkpoints = tiny_checkpoints(tmp_path, model)
    checkpoints.save(1)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(Diverged, match="not finite"):
        checkpoints.save(2)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


def agree_after_a_signal_to_rank_1(rank, world_size, one_step):
    """Rank 1 receives SIGUSR1 between two polls; returns the poll at which each rank saw the agreement."""
    stop = StopSignals()
    stop.arm(world_size, one_step=one_step, is_main=False)
    for poll in range(20):
        if poll == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.5)  # the watching thread records it
        if stop.agreed():
            stop.finish()
            return poll, stop.name
    return None, ""


def agree_after_rank_1_loses_its_launcher(rank, world_size):
    """Rank 1's watcher sees another parent than the one it started with, as when its launcher dies; rank 0's sees
    nothing. Returns what each rank agreed on."""
    stop = StopSignals(watch_launcher=rank == 1)
    stop.arm(world_size, one_step=True, is_main=False)
    if rank == 1:
        stop._launcher = -1  # no process has this pid: the watcher's next check (within 1 s) finds the parent gone
        time.sleep(2)
    agreed = stop.agreed()
    stop.finish()
    return agreed, stop.signum, stop.launcher_gone


def test_a_launcher_gone_on_one_rank_is_named_by_every_rank(tmp_path):
    """A launcher killed outright is seen by each rank's own watcher, one at a time; the agreement carries the reason,
    so rank 0 names the launcher's exit even when another rank saw it first (it once said SIGTERM, in CI)."""
    results = on_ranks(2, agree_after_rank_1_loses_its_launcher, results_dir=tmp_path)
    assert results == [(True, signal.SIGTERM, True)] * 2


@pytest.mark.parametrize("one_step", [False, True])
def test_the_ranks_agree_on_the_same_step(one_step, tmp_path):
    results = on_ranks(3, agree_after_a_signal_to_rank_1, one_step, results_dir=tmp_path)
    # one_step (the CPU): at the poll that carried it; else read at the poll after it
    assert results == [(3 if one_step else 4, "SIGUSR1")] * 3


def evaluate_with_a_signal_to_rank_1(rank, world_size, signalled: bool):
    """Between epochs: an agreement in flight from the last step, then the evaluation, in which rank 1 alone
    knows of a signal and leaves, then the agreement every rank calls. Returns what each rank saw."""
    stop = StopSignals()
    stop.arm(world_size, is_main=False)
    stop.agreed()  # the last training step's all-reduce, still in flight
    if signalled and rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)  # the watching thread records it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    loader = [(torch.randn(4, 3, 2, 2), torch.randint(0, 5, (4,))) for _ in range(3)]
    results = metrics.evaluate(model, loader, torch.device("cpu"), stop=lambda: bool(stop.received))
    agreed = stop.agree_now()
    stop.finish()
    return results["samples"], agreed, stop.name


@pytest.mark.parametrize("signalled", [True, False])
def test_evaluation_gives_way_to_a_signal_on_one_rank_and_all_ranks_agree(signalled, tmp_path):
    results = on_ranks(2, evaluate_with_a_signal_to_rank_1, signalled, results_dir=tmp_path)
    # rank 1 evaluated nothing (12 of 24 images counted), and both ranks stop; without a signal, all 24
    assert results == ([(12, True, "SIGUSR1")] * 2 if signalled else [(24, False, "")] * 2)


def test_a_sharding_cannot_be_cut_short_on_one_rank():
    from utils.sharding import PaddedShard
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    with pytest.raises(ValueError, match="sharded"):
        metrics.evaluate(model, PaddedShard([], torch.device("cpu")), torch.device("cpu"), stop=lambda: False)


def handles_sigterm(launcher_pid: int) -> bool:
    """A child of launcher_pid has a handler for SIGTERM (SigCgt in /proc/PID/status)."""
    for pid in process_tree(launcher_pid)[1:]:
        try:
            caught = [line for line in (Path("/proc") / str(pid) / "status").read_text().splitlines()
                      if line.startswith("SigCgt:")]
        except OSError:
            continue
        if caught and int(caught[0].split()[1], 16) & (1 << (signal.SIGTERM - 1)):
            return True
    return False


@pytest.mark.slow
def test_a_signal_while_starting_exits_at_once(tmp_path):
    # a rank waiting at the rendezvous for a peer that never comes (spawn --nnodes 2, one machine started)
    cmd = [sys.executable, str(ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank", "0", "--nprocs", "1",
           "--ip", "127.0.0.1", "--port", str(free_port()), *RUN, "--output-dir", str(tmp_path)]
    started = Run(cmd)
    deadline = time.monotonic() + 120
    while not handles_sigterm(started.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # in the rendezvous by now (its timeout is 300 s)
    os.kill(started.proc.pid, signal.SIGTERM)
    status, seconds = started.finish(timeout=40)
    # from the signal; the rendezvous it stops would wait 300 s for the other machine (its timeout): a tenth of it
    assert status == 128 + signal.SIGTERM and seconds < 30, started.output
    assert "stopped by SIGTERM while starting" in started.text
