"""The speed techniques the scripts can switch on, each behind a flag: DDP's settings, gradient
compression hooks, channels-last memory, torch.compile, the data set held on the device (--loader device,
utils/device_loader.py), the optimizer's step implementation, and (in a module of its own, utils/cuda_graphs.py)
the whole step replayed from a CUDA graph.

Each is torch's own part; this module only maps the flags onto it. Without a flag DDP runs as torch ships
it (no communication hook).
"""
import argparse

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from utils.errors import UsageError

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")


def add_flags(parser) -> None:
    """The techniques of every script, in the parser's group "speed techniques": --channels-last, --compile,
    --loader, --optimizer-impl. DDP's are add_ddp_flags's; --cuda-graphs is utils/cuda_graphs.py's add_flag."""
    group = parser.group("speed techniques")
    add = group.add_argument
    on_off = argparse.BooleanOptionalAction
    add("--channels-last", action=on_off, default=False,
        help="keep weights and activations in NHWC order (faster convolutions on tensor cores)")
    add("--compile", action=on_off, default=False,
        help="torch.compile the model (the first steps pay for compilation; needs a C++ compiler on the CPU)")
    add("--loader", choices=["dataloader", "device"], default="dataloader",
        help="dataloader: --workers processes per rank load, crop and flip each image on the CPU; device: the whole "
             "set held on the training device, augmented there in batches, no worker processes (fastest on GPU; "
             "CIFAR-shaped data.Images sets only). Both give the same batches")
    add("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
        help="how SGD updates the weights: one tensor at a time (for-loop), batched (foreach), one fused "
             "kernel (fused); auto: torch's choice (foreach on GPU, for-loop on the CPU), fused with --cuda-graphs")


def add_ddp_flags(parser) -> None:
    """DDP's settings, among the speed techniques: --bucket-cap-mb, --gradient-as-bucket-view, --static-graph,
    --comm-hook (DataParallel and FSDP have none of them)."""
    add = parser.group("speed techniques").add_argument
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


def ddp_options(args) -> dict:
    """Keyword arguments of DistributedDataParallel for the flags above."""
    return {"bucket_cap_mb": args.bucket_cap_mb, "gradient_as_bucket_view": args.gradient_as_bucket_view,
            "static_graph": args.static_graph}


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


def memory_format(args) -> torch.memory_format:
    return torch.channels_last if args.channels_last else torch.contiguous_format


def compile_if_asked(model: nn.Module, asked: bool, cuda_graphs: bool = False) -> None:
    """--compile: compile the model in place (nn.Module.compile keeps its state_dict keys and .module), in
    torch.compile's default mode: fused kernels, no CUDA graphs. With `cuda_graphs` (--cuda-graphs), inductor's own
    CUDA graphs stay off even if TORCHINDUCTOR_CUDAGRAPHS=1 asks: utils/cuda_graphs.py captures the whole step around
    the compiled kernels, and inductor's graphs (cudagraph trees) manage their memory in Python at each call, which a
    replay of the outer graph skips."""
    if asked:
        model.compile(options={"triton.cudagraphs": False} if cuda_graphs else None)


def optimizer_options(impl: str, optimizer_class, cuda_graphs: bool = False) -> dict:
    """foreach/fused keyword arguments of torch.optim.SGD for --optimizer-impl `impl` (auto with `cuda_graphs`:
    fused, the step that reads the learning rate from a tensor the graph sees: utils/cuda_graphs.py)."""
    if impl == "auto" and cuda_graphs:
        return {"fused": True}
    if impl == "auto":
        return {}
    if optimizer_class is not torch.optim.SGD:
        raise UsageError(f"--optimizer-impl {impl} applies to torch.optim.SGD; drop it with {optimizer_class.__name__}")
    return {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
