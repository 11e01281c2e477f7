"""Runs a training script as its launcher would, with things only a test needs (each optional, before the script):

    torchrun --nproc_per_node=2 tests/script_driver.py [--graph-path-on-cpu] [--host-reads FILE [--sync-waits]]
        [--fail-at-step N] [--teardown-log FILE] [--model NAME] [--step-seconds S] distributed_apex.py ...

--graph-path-on-cpu: the scripts refuse --cuda-graphs without a GPU; with this, the refusal is left out, so each
  step goes through speed.cuda_graphs.CapturedSteps and is called directly where a GPU would replay its graph.
--host-reads FILE: counts every read of a float or bool tensor back to Python (.item(), .tolist(), float(),
  bool(), .numpy()) from each epoch's start to its last step, except inside the safety net's step_done of a step
  that prints a progress line or writes a checkpoint (--print-freq, each epoch's first, --save-every-steps); rank 0
  writes "<count> <what was read, where>" lines to FILE, or "0 none".
--sync-waits: with --host-reads on a GPU, the same steps also run under torch.cuda.set_sync_debug_mode("warn"), and
  each operation that makes the host wait for the GPU (a copy from pageable memory, a synchronize) is counted as a
  "wait" line; the capture of --cuda-graphs (once a run: torch.cuda.graph synchronises before it) is not counted.
--fail-at-step N: rank 0's safety net raises RuntimeError("injected failure at step N") in step_done at global
  step N (counted from the first epoch's first step), before its bookkeeping: an error past --cuda-graphs' capture.
--model NAME: the model the script builds, changed as tests/distributed_helpers.py's MODELS[NAME] says ("float64":
  float64 on 8x8 averages of the images, so that runs at different world sizes compare to 1e-9, not chaotically).
--step-seconds S: each step lasts at least S seconds (a sleep before the safety net's step_done): a run slow enough
  for a test to act in the middle of an epoch (start or kill a machine) whatever the machine's speed.
--teardown-log FILE: each rank appends a line to FILE, in the order they run, for each CapturedSteps.close() (the
  graph it held, and what it holds after) and for dist.destroy_process_group().
"""
import collections
import os
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
# the driver's own options, each with whether it takes a value
OPTIONS = {"--graph-path-on-cpu": False, "--host-reads": True, "--sync-waits": False, "--fail-at-step": True,
           "--teardown-log": True, "--model": True, "--step-seconds": True}
sys.path.insert(0, str(ROOT))


class HostReads(TorchFunctionMode):
    """Counts the float and bool tensors read back to Python (item, tolist, float(), bool(), numpy), with the
    line of the repository that read them."""

    READS = {"item", "tolist", "__float__", "__bool__", "numpy"}

    def __init__(self):
        super().__init__()
        self.counting, self.reads = True, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and getattr(func, "__name__", "") in self.READS and isinstance(args[0], torch.Tensor) and (
                args[0].dtype.is_floating_point or args[0].dtype == torch.bool):
            ours = [f for f in traceback.extract_stack() if str(ROOT) in f.filename and __file__ != f.filename]
            where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "torch"
            self.reads[f"{func.__name__} of {args[0].dtype} at {where}"] += 1
        return func(*args, **(kwargs or {}))


class SyncWaits:
    """While on, every CUDA operation that makes the host wait (torch.cuda.set_sync_debug_mode's warnings) is
    counted into `reads` as a wait, with the line of the repository that made it; not inside the capture."""

    def __init__(self, reads: collections.Counter):
        self.reads, self.shown = reads, warnings.showwarning
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = self.seen

    def on(self, on: bool) -> None:
        torch.cuda.set_sync_debug_mode("warn" if on else "default")

    def seen(self, message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" not in str(message):  # not the mode's notice that it is new
            return self.shown(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()
        if any(frame.name == "_capture" for frame in stack):  # the capture, once a run
            return
        ours = [f for f in stack if str(ROOT) in f.filename and __file__ != f.filename]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else f"{Path(filename).name}:{lineno}"
        self.reads[f"wait ({str(message).split(':')[0][:60]}) at {where}"] += 1


def count_host_reads(out: str, sync_waits: bool = False):
    """Counts host reads (and with sync_waits, host waits) from each epoch's start (SafetyNet.begin_epoch) to its
    last step's step_done, as the docstring says; returns the function that writes them."""
    from safety_net import SafetyNet
    mode = HostReads()
    waits = SyncWaits(mode.reads) if sync_waits and torch.cuda.is_available() else None
    begin_epoch, step_done = SafetyNet.begin_epoch, SafetyNet.step_done

    def counted_begin_epoch(self, epoch):
        start_step = begin_epoch(self, epoch)
        mode.__enter__()  # left at the epoch's last step: the loop, the steps and the safety net's
        # bookkeeping in between
        if waits:
            waits.on(True)
        return start_step

    def counted_step_done(self, loss, grad_norm=None):
        step, progress = self.progress.step + 1, self.progress
        # the safety net's own rule: a progress line every --print-freq steps and at each epoch's first, a checkpoint
        # every --save-every-steps; those steps read the loss or the weights back, by design
        mode.counting = not (step % self.print_freq == 0 or progress.recorded == 0
                             or self.checkpoint.due(step, progress.total))
        if waits:
            waits.on(mode.counting)
        try:
            stop = step_done(self, loss, grad_norm)
        finally:
            mode.counting = True
        if stop or step == progress.total:
            mode.__exit__(None, None, None)
        if waits:
            waits.on(not (stop or step == progress.total))
        return stop

    def write():
        if os.environ.get("RANK", "0") == "0":
            Path(out).write_text("".join(f"{n} {what}\n" for what, n in mode.reads.items()) or "0 none\n")

    SafetyNet.begin_epoch, SafetyNet.step_done = counted_begin_epoch, counted_step_done
    return write


def fail_at_step(step: int) -> None:
    """Rank 0's SafetyNet.step_done raises at global step `step`, as the docstring says."""
    from safety_net import SafetyNet
    step_done = SafetyNet.step_done

    def failing_step_done(self, loss, grad_norm=None):
        progress = self.progress
        if os.environ.get("RANK", "0") == "0" and progress.epoch * progress.total + progress.step + 1 == step:
            raise RuntimeError(f"injected failure at step {step}")
        return step_done(self, loss, grad_norm)

    SafetyNet.step_done = failing_step_done


def change_model(name: str) -> None:
    """The scripts' model built, then changed as MODELS[name] says (the change test_scripts_equal's ranks make)."""
    from distributed_helpers import MODELS

    from utils import models
    for change in MODELS[name]:
        models.resnet18_cifar = change(models.resnet18_cifar)


def paced_steps(seconds: float) -> None:
    """Each step lasts at least `seconds`: SafetyNet.step_done sleeps out what the step left of them first."""
    import time

    from safety_net import SafetyNet
    step_done, last = SafetyNet.step_done, [time.monotonic()]

    def paced_step_done(self, loss, grad_norm=None):
        time.sleep(max(0.0, last[0] + seconds - time.monotonic()))
        last[0] = time.monotonic()
        return step_done(self, loss, grad_norm)

    SafetyNet.step_done = paced_step_done


def log_teardown(out: str) -> None:
    """CapturedSteps.close and dist.destroy_process_group each append a line to `out` naming this rank, in the
    order they run (destroy_process_group's before it runs: a hang there still shows)."""
    import torch.distributed as dist

    from speed import cuda_graphs
    close, destroy = cuda_graphs.CapturedSteps.close, dist.destroy_process_group

    def log(line: str) -> None:
        with open(out, "a") as f:
            f.write(f"rank {os.environ.get('RANK', '0')}: {line}\n")

    def named(graph) -> str:
        return type(graph).__name__ if graph is not None else "None"

    def logged_close(self):
        held = self.graph
        close(self)
        log(f"close: held {named(held)}, now {named(self.graph)}")

    def logged_destroy(*args, **kwargs):
        log("destroy_process_group")
        return destroy(*args, **kwargs)

    cuda_graphs.CapturedSteps.close, dist.destroy_process_group = logged_close, logged_destroy


def main():
    argv, options = sys.argv[1:], {}
    while argv[0] in OPTIONS:  # the driver's own options, then the script and its flags
        takes_value = OPTIONS[argv[0]]
        options[argv[0]], argv = argv[1] if takes_value else True, argv[1 + takes_value:]
    script, sys.argv = str(ROOT / argv[0]), [str(ROOT / argv[0])] + argv[1:]
    if options.get("--graph-path-on-cpu"):
        from speed import cuda_graphs
        cuda_graphs._no_gpu = lambda args: None
    if "--fail-at-step" in options:
        fail_at_step(int(options["--fail-at-step"]))
    if "--teardown-log" in options:
        log_teardown(options["--teardown-log"])
    if "--model" in options:
        change_model(options["--model"])
    if "--step-seconds" in options:
        paced_steps(float(options["--step-seconds"]))
    host_reads = options.get("--host-reads")
    write = count_host_reads(host_reads, bool(options.get("--sync-waits"))) if host_reads else None
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if write:
            write()


if __name__ == "__main__":
    main()
