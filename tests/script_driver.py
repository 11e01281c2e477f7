"""Runs a training script as its launcher would, with two things only a test needs (each optional):

    torchrun --nproc_per_node=2 tests/script_driver.py [--graph-path-on-cpu] [--host-reads FILE] distributed.py ...

--graph-path-on-cpu: the scripts refuse --cuda-graphs without a GPU; with this, the refusal is left out, so each
  step goes through utils.cuda_graphs.CapturedSteps and is called directly where a GPU would replay its graph.
--host-reads FILE: counts every read of a float or bool tensor back to Python (.item(), .tolist(), float(),
  bool(), .numpy()) from each epoch's start to its last step, except inside the safety net's step_done of a step
  that prints a progress line or writes a checkpoint (--print-freq, each epoch's first, --save-every-steps); rank 0
  writes "<count> <what was read, where>" lines to FILE, or "0 none".
"""
import collections
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
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


def count_host_reads(out: str):
    """Counts host reads from each epoch's start (SafetyNet.start_epoch) to its last step's step_done, as the
    docstring says; returns the function that writes them."""
    from safety_net import SafetyNet
    mode = HostReads()
    start_epoch, step_done = SafetyNet.start_epoch, SafetyNet.step_done

    def counted_start_epoch(self, epoch):
        start_step = start_epoch(self, epoch)
        mode.__enter__()  # left at the epoch's last step: the loop, the steps and the net's bookkeeping in between
        return start_step

    def counted_step_done(self, loss):
        step, progress = self.progress.step + 1, self.progress
        # the net's own rule: a progress line every --print-freq steps and at each epoch's first, a checkpoint
        # every --save-every-steps; those steps read the loss or the weights back, by design
        mode.counting = not (step % self.print_freq == 0 or progress.recorded == 0
                             or self.checkpoint.due(step, progress.total))
        try:
            stop = step_done(self, loss)
        finally:
            mode.counting = True
        if stop or step == progress.total:
            mode.__exit__(None, None, None)
        return stop

    def write():
        if os.environ.get("RANK", "0") == "0":
            Path(out).write_text("".join(f"{n} {what}\n" for what, n in mode.reads.items()) or "0 none\n")

    SafetyNet.start_epoch, SafetyNet.step_done = counted_start_epoch, counted_step_done
    return write


def main():
    argv = sys.argv[1:]
    graph_path = "--graph-path-on-cpu" in argv
    argv = [a for a in argv if a != "--graph-path-on-cpu"]
    host_reads = None
    if argv[0] == "--host-reads":
        host_reads, argv = argv[1], argv[2:]
    script, sys.argv = str(ROOT / argv[0]), [str(ROOT / argv[0])] + argv[1:]
    if graph_path:
        from utils import cuda_graphs
        cuda_graphs._no_gpu = lambda args: None
    write = count_host_reads(host_reads) if host_reads else None
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if write:
            write()


if __name__ == "__main__":
    main()
