"""The speed techniques' flags and the two of them that are more than a keyword argument: gradient compression
(--comm-hook) and the optimizer's kernel (--optimizer-impl). The scripts pass the others to torch themselves:
DDP's settings as DistributedDataParallel's keyword arguments, --channels-last to model.to(), --compile to
model.compile(). Each is torch's own part; without a flag DDP runs as torch ships it (no communication hook).
The fast GPU path of distributed_apex.py (--loader device, --cuda-graphs) is speed/cuda_graphs.py's.
"""
import argparse

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from utils import flags

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")


def add_flags(parser) -> None:
    """The techniques of every script, in the parser's group "speed techniques": --channels-last, --compile,
    --optimizer-impl. DDP's are add_ddp_flags's."""
    add = flags.group(parser, "speed techniques").add_argument
    on_off = argparse.BooleanOptionalAction
    add("--channels-last", action=on_off, default=False,
        help="keep weights and activations in NHWC order (faster convolutions on tensor cores)")
    add("--compile", action=on_off, default=False,
        help="torch.compile the model (the first steps pay for compilation; needs a C++ compiler on the CPU)")
    add("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
        help="how SGD updates the weights: one tensor at a time (for-loop), batched (foreach), one fused "
             "kernel (fused); auto: torch's choice (foreach on GPU, for-loop on the CPU), fused with --cuda-graphs")


def add_ddp_flags(parser) -> None:
    """DDP's settings, among the speed techniques: --bucket-cap-mb, --gradient-as-bucket-view, --static-graph,
    --comm-hook (DataParallel and FSDP have none of them)."""
    add = flags.group(parser, "speed techniques").add_argument
    on_off = argparse.BooleanOptionalAction
    add("--bucket-cap-mb", type=positive_float, default=None, metavar="MB",
        help="DDP gradient bucket size: one all-reduce per bucket, started as soon as the bucket is full; "
             "default: torch's (25 MB, and 1 MB for the first bucket)")
    add("--gradient-as-bucket-view", action=on_off, default=True,
        help="gradients are views into DDP's buckets: no copy into the bucket, less memory")
    add("--static-graph", action=on_off, default=False,
        help="tell DDP the graph is the same every step, so it can skip per-step bookkeeping")
    add("--comm-hook", choices=COMM_HOOKS, default="none",
        help="gradient compression before the all-reduce: none (float32), fp16/bf16 (half the bytes), "
             "powersgd (low-rank, from the second epoch on; for slow links)")


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def register_comm_hook(model: nn.parallel.DistributedDataParallel, name: str, steps_per_epoch: int) -> None:
    """Install --comm-hook on the DDP model; `none` installs nothing (DDP's own float32 all-reduce)."""
    if name == "none":
        return
    if name == "powersgd":
        # rank-2 approximation with error feedback; the first epoch all-reduces in full, as torch
        # advises, so that the weights settle before the gradients are compressed
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=max(2, steps_per_epoch))
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        model.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                        "bf16": default_hooks.bf16_compress_hook}[name])


def sgd_kernel(impl: str, cuda_graphs: bool = False) -> dict:
    """torch.optim.SGD's foreach/fused keyword arguments for --optimizer-impl `impl` (auto with `cuda_graphs`:
    fused, the step that reads the learning rate from a tensor the graph sees: speed/cuda_graphs.py)."""
    if impl == "auto":
        return {"fused": True} if cuda_graphs else {}
    return {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
