"""--cuda-graphs (speed/cuda_graphs.py, distributed_apex.py's alone): what the CPU can prove of the graph path, and on
a GPU the rest (skipped without one). On the CPU the script refuses the flag; tests/script_driver.py leaves that
refusal out, so each step goes through the graph path's static buffers, rate tensors and stand-in safety net, called
directly where a GPU replays. On the CPU the runs are float32 (--opt-level O0), the arithmetic of distributed.py."""
import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from markers import gpu_test
from script_runs import ROOT, check, load_checkpoint, read_metrics, run, run_main, subprocess_env

from examples.local_processes import alive, process_tree
from speed import cuda_graphs

DRIVER = str(ROOT / "tests" / "script_driver.py")
SCRIPT = "distributed_apex.py"  # the fast GPU path (--loader device, --cuda-graphs) is its alone
# 2 epochs of 14 steps on 2 ranks (per-rank batch 4): the step is captured at step 12 of the first epoch and its
# replays cross into the second, where the schedule lowers the rate; a checkpoint every 4 steps, all kept
RUN = ["--dataset", "synthetic", "--train-samples", "112", "--test-samples", "16", "--batch-size", "8",
       "--epochs", "2", "--lr", "0.01", "--workers", "0", "--print-freq", "5", "--loader", "device",
       "--optimizer-impl", "fused", "--save-every-steps", "4", "--keep", "10", "--device", "cpu",
       "--opt-level", "O0"]
GPUS = torch.cuda.device_count()
needs_gpu = gpu_test(GPUS < 1, "needs a GPU")


def torchrun(*args: str, nprocs: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", DRIVER,
            *args]


def driven(out: Path, script: str, *flags: str, graph_path: bool = False, launcher=torchrun) -> Path:
    """A run of `script` through the driver, its host reads counted into out/host_reads.txt."""
    extra = ["--graph-path-on-cpu"] if graph_path else []
    check(run(launcher(*extra, "--host-reads", str(out / "host_reads.txt"), script, *flags, "--output-dir",
                       str(out / "run")), timeout=400))
    return out


@pytest.fixture(scope="module")
def eager(module_dir) -> Path:
    return driven(module_dir("eager"), SCRIPT, *RUN)


@pytest.fixture(scope="module")
def graphed(module_dir) -> Path:
    return driven(module_dir("graphed"), SCRIPT, *RUN, "--cuda-graphs", graph_path=True)


def checkpoint_at(run_dir: Path, epoch: int, step: int) -> Path:
    """The kept checkpoint written after `step` steps of epoch `epoch` (0-based)."""
    for path in sorted(run_dir.glob("checkpoint*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if (state["epoch"], state["step"]) == (epoch, step):
            return path
    raise AssertionError(f"no checkpoint of epoch {epoch}, step {step} in {run_dir}")


def assert_same_state_bit_for_bit(expected_dir: Path, got_dir: Path) -> None:
    expected, got = load_checkpoint(expected_dir), load_checkpoint(got_dir)
    assert (got["epoch"], got["step"]) == (expected["epoch"], expected["step"]) == (2, 0)
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    for want, have in zip(expected["optimizer"]["state"].values(), got["optimizer"]["state"].values(), strict=True):
        assert torch.equal(have["momentum_buffer"], want["momentum_buffer"])


def host_reads(out: Path) -> str:
    return (out / "host_reads.txt").read_text()


def run_watched(cmd: list[str], limit: float, logs: Path, **env) -> subprocess.CompletedProcess:
    """cmd run as `run` runs it, its stdout and stderr kept apart in logs/, and every process it starts watched:
    the test fails if it is still running after `limit` seconds (a hang: all of them are killed) or if any is left
    running 30 s after the launcher ended."""
    logs.mkdir()
    seen = set()
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(**env), stdout=stdout, stderr=stderr)
        deadline = time.monotonic() + limit
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(process_tree(proc.pid))  # the ranks start sessions of their own: a killpg misses them
            time.sleep(0.2)
        hung = proc.poll() is None
        settled = time.monotonic() + (0 if hung else 30)
        while alive(list(seen)) and time.monotonic() < settled:
            time.sleep(0.1)
        left = alive(list(seen))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    said = subprocess.CompletedProcess(cmd, proc.returncode, (logs / "stdout").read_text(),
                                       (logs / "stderr").read_text())
    assert not hung, f"still running after {limit} s (killed)\n{said.stdout[-3000:]}\n{said.stderr[-3000:]}"
    assert not left, f"processes left running: {left}\n{said.stdout[-3000:]}\n{said.stderr[-3000:]}"
    return said


@pytest.mark.slow
def test_the_graph_path_ends_on_the_weights_of_the_eager_loop_bit_for_bit(eager, graphed):
    assert_same_state_bit_for_bit(eager / "run", graphed / "run")
    for got, want in zip(read_metrics(graphed / "run"), read_metrics(eager / "run"), strict=True):
        assert (got["train_loss"], got["lr"]) == (want["train_loss"], want["lr"])
    assert read_metrics(graphed / "run")[1]["lr"] < read_metrics(graphed / "run")[0]["lr"]  # the schedule moved
    state = load_checkpoint(graphed / "run")
    # the checkpoint holds the rate as a number, as the eager loop's does, and the fused step it trained with
    assert isinstance(state["optimizer"]["param_groups"][0]["lr"], float)
    assert state["resolved"]["optimizer"]["fused"] is True
    # and neither reads a float or bool tensor back to Python in a step without a progress line or checkpoint
    # (tests/test_host_reads.py: every other script)
    assert host_reads(eager) == host_reads(graphed) == "0 none\n", (host_reads(eager), host_reads(graphed))


@pytest.mark.slow
def test_a_resume_into_and_out_of_the_graph_path_continues_to_the_same_weights(eager, graphed, tmp_path):
    # into: the eager run's checkpoint after 4 steps, continued by the graph path (which captures 11 steps later)
    into = tmp_path / "into"
    into.mkdir()
    shutil.copy(checkpoint_at(eager / "run", 0, 4), into / "checkpoint.pt")
    result = check(run(torchrun("--graph-path-on-cpu", SCRIPT, *RUN, "--cuda-graphs", "--output-dir",
                                str(into)), timeout=400))
    assert "epoch 1, step 4" in result.stdout
    assert_same_state_bit_for_bit(eager / "run", into)
    # out of: the graph path's checkpoint after 4 steps of the second epoch (replayed steps), continued eagerly
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(checkpoint_at(graphed / "run", 1, 4), out / "checkpoint.pt")
    result = check(run(torchrun(SCRIPT, *RUN, "--output-dir", str(out)), timeout=400))
    assert "epoch 2, step 4" in result.stdout
    assert_same_state_bit_for_bit(eager / "run", out)


def assert_failed_once_with_the_graph_released_first(said: subprocess.CompletedProcess, teardown_log: Path,
                                                     graph: str, ranks: int) -> None:
    """The run ended on rank 0's injected failure (the driver's --fail-at-step 14), told in one error line the way
    the scripts tell an unexpected error, and each rank closed its CapturedSteps, which held `graph`, before
    destroying the process group."""
    output = said.stdout + said.stderr
    assert said.returncode != 0 and output.count("injected failure") == 1, output[-6000:]
    (line,) = [line for line in said.stderr.splitlines() if "injected failure" in line]
    found = re.search(r"error: rank 0: RuntimeError: injected failure at step 14 \(\S*script_driver\.py:\d+ in "
                      r"failing_step_done; the traceback is in (\S+)\)$", line)
    assert found, line
    Path(found.group(1)).unlink()
    logged = teardown_log.read_text().splitlines()
    for rank in range(ranks):
        assert [entry for entry in logged if entry.startswith(f"rank {rank}: ")] == [
            f"rank {rank}: close: held {graph}, now None", f"rank {rank}: destroy_process_group"], logged


@pytest.mark.slow
def test_an_error_past_the_capture_releases_the_graph_before_the_process_group_is_destroyed(tmp_path):
    teardown_log = tmp_path / "teardown.log"
    said = run_watched(torchrun("--graph-path-on-cpu", "--fail-at-step", "14", "--teardown-log", str(teardown_log),
                                SCRIPT, *RUN, "--cuda-graphs", "--output-dir", str(tmp_path / "run")),
                       limit=300, logs=tmp_path / "logs")
    assert_failed_once_with_the_graph_released_first(said, teardown_log, "_CalledDirectly", ranks=2)


def test_each_step_runs_once_eagerly_then_from_the_capture():
    """The step function is called once per step: WARMUP_STEPS eagerly, then once to capture (off the GPU: run),
    then per replay; the capture is not run a second time. Each call sees the batch in the static buffers and its
    optimizer reads the current rate from a tensor."""
    calls = []
    weight = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([weight], lr=0.5, fused=True)

    def train_one_epoch(model, criterion, optimizer, loader, device, safety, extra):
        ((images, targets),) = loader
        calls.append((images.clone(), optimizer.param_groups[0]["lr"].clone(), extra))
        safety.step_done(images.sum())

    class Net:
        losses = []

        def step_done(self, loss, grad_norm=None):
            self.losses.append(float(loss))
            return False

    steps = cuda_graphs.CapturedSteps(train_one_epoch, torch.device("cpu"))
    total = cuda_graphs.WARMUP_STEPS + 4
    batches = [(torch.full((2, 3), float(k)), torch.tensor([k, k])) for k in range(total)]
    steps(None, None, optimizer, batches[:-2], torch.device("cpu"), Net(), "extra")
    optimizer.param_groups[0]["lr"] = 0.25  # the schedule's next epoch
    steps(None, None, optimizer, batches[-2:], torch.device("cpu"), Net(), "extra")
    assert len(calls) == total and isinstance(steps.graph, cuda_graphs._CalledDirectly)
    assert [float(images[0, 0]) for images, _, _ in calls] == list(range(total))
    assert [float(rate) for _, rate, _ in calls] == [0.5] * (total - 2) + [0.25] * 2
    assert Net.losses == [6.0 * k for k in range(total)] and {extra for *_, extra in calls} == {"extra"}
    assert optimizer.param_groups[0]["lr"] == 0.25  # a number again outside the step


def test_an_error_past_the_capture_leaves_the_graph_to_release_captured_graphs():
    """An error raised after the capture (the safety net's divergence guard, a checkpoint that cannot be written) leaves
    with a traceback that holds the CapturedSteps; release_captured_graphs, as the scripts' `finally` calls it
    before destroying the process group, still lets go of its graph and buffers. A second call does nothing, the
    closed object refuses to step, and the registry keeps none alive."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=0.5, fused=True)

    def train_one_epoch(model, criterion, optimizer, loader, device, safety):
        ((images, targets),) = loader
        safety.step_done(images.sum())

    class FailsAtTheFirstReplay:
        steps = 0

        def step_done(self, loss, grad_norm=None):
            self.steps += 1
            if self.steps == cuda_graphs.WARMUP_STEPS + 2:  # eager steps, the capture, then this replay
                raise RuntimeError("injected failure")
            return False

    steps = cuda_graphs.CapturedSteps(train_one_epoch, torch.device("cpu"))
    batches = [(torch.full((2, 3), float(k)), torch.tensor([k, k])) for k in range(cuda_graphs.WARMUP_STEPS + 4)]
    with pytest.raises(RuntimeError, match="injected failure") as raised:
        steps(None, None, optimizer, batches, torch.device("cpu"), FailsAtTheFirstReplay())
    graph = steps.graph
    assert isinstance(graph, cuda_graphs._CalledDirectly) and raised.tb is not None  # the traceback holds it
    cuda_graphs.release_captured_graphs()
    cuda_graphs.release_captured_graphs()  # harmless
    assert steps.closed and graph.replay is None  # reset, as a CUDA graph's
    assert (steps.graph, steps.images, steps.targets, steps.rates, steps.kept.loss) == (None,) * 5
    with pytest.raises(RuntimeError, match="after close"):
        steps(None, None, optimizer, batches, torch.device("cpu"), FailsAtTheFirstReplay())
    kept = weakref.ref(steps)
    del steps, raised
    gc.collect()  # the traceback's frames
    assert kept() is None


@pytest.mark.parametrize(("argv", "says"), [
    (["--cuda-graphs", "--device", "cpu"], "it needs a GPU (drop --device cpu)"),
    (["--cuda-graphs", "--loader", "device", "--optimizer-impl", "foreach"], "drop --optimizer-impl foreach"),
    (["--cuda-graphs", "--loader", "device", "--comm-hook", "fp16"], "--comm-hook fp16"),
    (["--cuda-graphs"], "add --loader device"),
])
def test_flags_it_cannot_run_with_are_one_line_errors(argv, says, monkeypatch, capsys):
    import distributed_apex
    if "--device" not in argv:  # the reasons after the GPU's: as on a machine with one
        monkeypatch.setattr(cuda_graphs, "_no_gpu", lambda args: None)
    # float32, so that float16's loss scaling (test_float16_loss_scaling_and_apex_sgd_are_refused_in_one_line) is
    # not the reason given
    result = run_main(distributed_apex.main, argv + ["--opt-level", "O0"], capsys)
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr


@pytest.mark.parametrize("argv", [["--cuda-graphs", "--loader", "device"],
                                  ["--cuda-graphs", "--loader", "device", "--amp-dtype", "float16"],
                                  ["--cuda-graphs", "--loader", "device", "--optimizer", "apex-fused-sgd"]])
def test_float16_loss_scaling_and_apex_sgd_are_refused_in_one_line(argv, monkeypatch, capsys):
    import distributed_apex
    monkeypatch.setattr(cuda_graphs, "_no_gpu", lambda args: None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if NVIDIA apex were installed
    result = run_main(distributed_apex.main, argv, capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--amp-dtype bfloat16" in result.stderr or "use --optimizer sgd" in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--cuda-graphs", "--loader"])
def test_only_distributed_apex_has_the_graph_path(flag, capsys):
    """The fast GPU path is distributed_apex.py's alone: every other script refuses its flags in one line."""
    import dataparallel
    import distributed
    import distributed_fsdp
    import distributed_gradient_accumulation
    import distributed_mp
    argv = [flag] + (["device"] if flag == "--loader" else [])
    for script in (distributed, distributed_mp, distributed_gradient_accumulation, dataparallel, distributed_fsdp):
        result = run_main(script.main, argv, capsys)
        assert result.returncode == 2 and f"unrecognized arguments: {' '.join(argv)}" in result.stderr, \
            (script.__name__, result.stderr)


# On a GPU (skipped without one): the capture itself


def gpu_losses(rank, world_size, graphed: bool, steps: int, sync_check: bool):
    """`steps` steps of distributed_apex.py's own step in bfloat16 on synthetic batches made on the GPU, eagerly or
    through CapturedSteps; the replays after the capture run under torch.cuda.set_sync_debug_mode("error")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distributed_apex as script
    from utils.models import resnet18_cifar
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(resnet18_cifar().to(device))
    run_epoch = cuda_graphs.CapturedSteps(script.train_one_epoch, device) if graphed else script.train_one_epoch
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randn(64, 3, 32, 32, device=device, generator=g),
                torch.randint(0, 100, (64,), device=device, generator=g)) for _ in range(steps)]

    class Losses:  # the safety net's bookkeeping on the device: no read until the end
        losses = []

        def step_done(self, loss, grad_norm=None):
            if sync_check and graphed and len(self.losses) == cuda_graphs.WARMUP_STEPS:
                torch.cuda.set_sync_debug_mode("error")
            self.losses.append(loss.detach().clone())
            return False

    safety = Losses()
    run_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, batches, device, safety, torch.bfloat16, scaler)
    torch.cuda.set_sync_debug_mode("default")
    return [float(loss) for loss in safety.losses]


@needs_gpu
def test_captured_steps_match_the_eager_steps_and_never_wait_for_the_gpu(tmp_path):
    from distributed_helpers import on_ranks
    (eager,) = on_ranks(1, gpu_losses, False, 20, False, results_dir=tmp_path / "eager", backend="nccl")
    (graphed,) = on_ranks(1, gpu_losses, True, 20, True, results_dir=tmp_path / "graphed", backend="nccl")
    assert len(graphed) == len(eager) == 20
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-2, atol=2e-2)  # bfloat16


@needs_gpu
def test_graph_path_checkpoint_and_resume_on_a_gpu(tmp_path):
    flags = ["--dataset", "synthetic", "--train-samples", "1024", "--test-samples", "64", "--batch-size", "64",
             "--epochs", "2", "--workers", "0", "--print-freq", "4", "--loader", "device", "--amp-dtype",
             "bfloat16", "--cuda-graphs", "--save-every-steps", "4", "--keep", "10", "--device", "cuda"]
    start = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
             str(ROOT / "distributed_apex.py")]
    whole = tmp_path / "whole"
    check(run(start + flags + ["--output-dir", str(whole)], CUDA_VISIBLE_DEVICES="0"))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(checkpoint_at(whole, 0, 4), resumed / "checkpoint.pt")
    result = check(run(start + flags + ["--output-dir", str(resumed)], CUDA_VISIBLE_DEVICES="0"))
    assert "epoch 1, step 4" in result.stdout
    expected, got = load_checkpoint(whole), load_checkpoint(resumed)
    for key, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][key], tensor, rtol=2e-2, atol=2e-3, msg=key)
    assert [r["epoch"] for r in read_metrics(resumed)] == [1, 2]


@needs_gpu
def test_an_error_past_the_capture_on_a_gpu_ends_the_run_without_a_hang(tmp_path):
    """A captured CUDA graph still alive would keep NCCL's communicator and hang destroy_process_group
    (pytorch/pytorch#115388); the script's `finally` releases it first."""
    flags = ["--dataset", "synthetic", "--train-samples", "1024", "--test-samples", "64", "--batch-size", "64",
             "--epochs", "1", "--workers", "0", "--print-freq", "4", "--loader", "device", "--amp-dtype",
             "bfloat16", "--cuda-graphs", "--device", "cuda"]
    teardown_log = tmp_path / "teardown.log"
    said = run_watched(torchrun("--fail-at-step", "14", "--teardown-log", str(teardown_log), "distributed_apex.py",
                                *flags, "--output-dir", str(tmp_path / "run"), nprocs=1),
                       limit=240, logs=tmp_path / "logs", CUDA_VISIBLE_DEVICES="0")
    assert_failed_once_with_the_graph_released_first(said, teardown_log, "CUDAGraph", ranks=1)
