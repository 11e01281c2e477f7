"""FSDP on one process, where it has nothing to shard: distributed_fsdp.py's shard() and the candidate layouts of
issue 49 against distributed.py's DDP, step by step in one process, and what the difference is made of.

    python -m benchmarks.fsdp_profile --proxy --precision bfloat16      # the CPU stand-in for one GPU's host
    python -m benchmarks.fsdp_profile                                   # the CPU: per-rank batch 2, float32
    python -m benchmarks.fsdp_profile --device cuda --batch-size 256 --precision bfloat16   # one GPU

Builds, in a world of one process (gloo on the CPU, NCCL on a GPU), the scripts' ResNet-18 in several layouts:
wrapped in DDP as distributed.py does (under autocast for bfloat16, as distributed_apex.py), sharded by
distributed_fsdp.py's shard() (its MixedPrecisionPolicy for bfloat16) with and without reshard after forward,
and the candidates measured against it: the whole model one FSDP unit (with shard()'s policy, or under autocast
as DDP), and the four stages and the root under autocast. Their training steps run interleaved, so that the
machine's noise hits all alike; the median of --steps is reported, with each one's ratio to DDP, its extra time
over DDP and the aten operators it dispatches per step. Then --profile-steps steps of DDP and shard() under
torch.profiler, and the operators whose time per step grows the most from DDP to FSDP are listed: host time, and
on a GPU the device's time too.

On a GPU, ResNet-18's step at 256 images is bound by the host, which launches every kernel: there FSDP's extra
time is host work (hooks, casts and copies per parameter, DTensor's dispatch), not arithmetic. --proxy measures
that host work on the CPU: the same modules and parameters (62 tensors, 21 units' worth of hooks), every
layer's channels divided by --thin (16: 64 -> 4), one image per step and one thread, so that the arithmetic
vanishes and what is left is the per-operator and per-parameter work a GPU's host does; SGD runs its foreach
kernels, as on a GPU (on the CPU torch's default is the for-loop). docs/sharding.md compares its figures with
an H200's.
"""
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import distributed_fsdp
from benchmarks.bare_step import synchronize
from utils import flags, launch, models
from utils.data import NUM_CLASSES
from utils.errors import exit_on_error

DDP_KIND, FSDP_KIND = "DDP", "FSDP: shard()"
LAYOUTS = {  # name: (how the model is wrapped, whether its step runs under autocast in bfloat16)
    DDP_KIND: ("ddp", True),
    FSDP_KIND: ("shard", False),
    "FSDP: shard(), no reshard after forward": ("shard-no-reshard", False),
    "FSDP: the model one unit, shard()'s policy": ("one-unit", False),
    "FSDP: the model one unit, autocast": ("model", True),  # distributed_fsdp.py --units model
    "FSDP: stages and root, autocast": ("stages", True),
}


def thin(model: nn.Module, divisor: int) -> nn.Module:
    """The same modules and parameters with every layer's channels divided by `divisor` (the input's 3 kept): the
    proxy's model, whose arithmetic is negligible beside the per-operator work of its step."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Conv2d):
                inputs = child.in_channels if child.in_channels == 3 else child.in_channels // divisor
                setattr(module, name, nn.Conv2d(inputs, child.out_channels // divisor, child.kernel_size, child.stride,
                                                child.padding, bias=child.bias is not None))
            elif isinstance(child, nn.BatchNorm2d):
                setattr(module, name, nn.BatchNorm2d(child.num_features // divisor))
            elif isinstance(child, nn.Linear):
                setattr(module, name, nn.Linear(child.in_features // divisor, child.out_features))
    return model


def build(kind: str, device: torch.device, amp_dtype: torch.dtype | None, divisor: int = 1) -> nn.Module:
    torch.manual_seed(0)
    model = models.resnet18_cifar()
    model = (thin(model, divisor) if divisor > 1 else model).to(device)
    wrap = LAYOUTS[kind][0]
    if wrap == "ddp":
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if wrap in ("shard", "shard-no-reshard", "model"):  # the script's own layouts
        return distributed_fsdp.shard(model, amp_dtype, reshard=wrap != "shard-no-reshard",
                                      units="model" if wrap == "model" else "stages")
    if wrap == "stages":  # no policy: float32 weights gathered, the step under autocast as DDP's
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            fully_shard(stage)
        return fully_shard(model)
    # one unit with shard()'s policy: gathered once before forward, kept until backward is done (the root is never
    # resharded early); in float32 the policy is no policy, and the layout is --units model's
    if amp_dtype is None:
        return fully_shard(model)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    fully_shard(norms, reshard_after_forward=False)  # shard()'s float32 BatchNorm unit
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    return fully_shard(model, mp_policy=policy)


def step(kind, model, optimizer, images, targets, amp_dtype) -> None:
    # DDP computes under autocast (distributed_apex.py); FSDP's policy casts the weights itself (no autocast)
    autocast = LAYOUTS[kind][1] and amp_dtype is not None
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=autocast):
        loss = nn.functional.cross_entropy(model(images), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def aten_ops_per_step(kind, model, optimizer, images, targets, amp_dtype, steps: int) -> float:
    """The aten operators a step dispatches, nested ones included (torch.profiler's events), per step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(kind, model, optimizer, images, targets, amp_dtype)
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::")) / steps


def per_step_times(prof, steps: int) -> dict[str, tuple[float, float]]:
    """{operator: (host ms per step, device ms per step)}, by self time."""
    out = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        out[event.key] = (event.self_cpu_time_total / 1000 / steps, device_us / 1000 / steps)
    return out


def main(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.fsdp_profile", formatter_class=flags.HelpFormatter,
                          description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when visible")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="float32, or bfloat16: DDP under autocast, FSDP with the scripts' bfloat16 policy")
    parser.add_argument("--batch-size", type=flags.positive_int, default=None,
                        help="images per step; default: 256 on a GPU, 2 on the CPU (a GPU step's share of overhead), "
                             "1 with --proxy")
    parser.add_argument("--proxy", action="store_true",
                        help="the CPU stand-in for a GPU's host: channels divided by --thin, one thread, foreach SGD")
    parser.add_argument("--thin", type=flags.positive_int, default=16, metavar="N",
                        help="with --proxy: every layer's channels divided by N (a divisor of 64)")
    parser.add_argument("--steps", type=flags.positive_int, default=12, help="timed steps of each, interleaved")
    parser.add_argument("--profile-steps", type=flags.positive_int, default=3, help="profiled steps of each")
    parser.add_argument("--top", type=flags.positive_int, default=12, help="operators listed")
    args = parser.parse_args(argv)
    if args.proxy and (64 % args.thin or args.device == "cuda"):
        parser.error("--proxy runs on the CPU (not --device cuda), with a --thin that divides 64")
    with exit_on_error():  # --device cuda without a GPU: one line, exit status 2
        cuda = launch.resolve_device(args.device) == "cuda" and not args.proxy
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    batch = args.batch_size or (256 if cuda else 1 if args.proxy else 2)
    if args.proxy:
        torch.set_num_threads(1)
    amp_dtype = torch.bfloat16 if args.precision == "bfloat16" else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # a world of one meets only itself
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        kinds = list(LAYOUTS)
        built = {k: build(k, device, amp_dtype, args.thin if args.proxy else 1) for k in kinds}
        kernel = {"foreach": True} if args.proxy else {}  # the proxy: a GPU's default kernel
        optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, **kernel)
                      for k, m in built.items()}
        g = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, 32, 32, generator=g).to(device)
        targets = torch.randint(0, NUM_CLASSES, (batch,), generator=g).to(device)
        times = {k: [] for k in kinds}
        for round_ in range(2 + args.steps):  # two untimed rounds: lazy initialisation, allocator, autotuning
            for kind in kinds:
                synchronize(device)
                started = time.perf_counter()
                step(kind, built[kind], optimizers[kind], images, targets, amp_dtype)
                synchronize(device)
                if round_ >= 2:
                    times[kind].append(time.perf_counter() - started)
        proxy = f", the proxy (channels / {args.thin}, 1 thread, foreach SGD)" if args.proxy else ""
        what = f"{device.type}{proxy}, {args.precision}, batch {batch}, median of {args.steps} interleaved steps"
        print(f"{what}, torch {torch.__version__}")
        ddp_ms = statistics.median(times[DDP_KIND]) * 1000
        for kind in kinds:
            ms = statistics.median(times[kind]) * 1000
            ops = aten_ops_per_step(kind, built[kind], optimizers[kind], images, targets, amp_dtype,
                                    args.profile_steps)
            print(f"  {kind:44s} {ms:8.2f} ms per step  {ms - ddp_ms:+7.2f} ms  {ops:6.0f} aten ops  "
                  f"{ms / ddp_ms:.2f}x DDP")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiled = {}
        for kind in (DDP_KIND, FSDP_KIND):
            with profile(activities=activities) as prof:
                for _ in range(args.profile_steps):
                    step(kind, built[kind], optimizers[kind], images, targets, amp_dtype)
                synchronize(device)
            profiled[kind] = per_step_times(prof, args.profile_steps)
        ddp, fsdp = profiled[DDP_KIND], profiled[FSDP_KIND]
        grown = sorted(set(ddp) | set(fsdp), key=lambda op: fsdp.get(op, (0, 0))[0] - ddp.get(op, (0, 0))[0],
                       reverse=True)
        print(f"\noperators whose self time per step grows most from DDP to FSDP (host ms{', device ms' * cuda}):")
        for op in grown[:args.top]:
            (dh, dd), (fh, fd) = ddp.get(op, (0, 0)), fsdp.get(op, (0, 0))
            device_part = f"   device {dd:7.2f} -> {fd:7.2f}" if cuda else ""
            print(f"  {op[:60]:60s} host {dh:7.2f} -> {fh:7.2f}{device_part}")
        for name, table in (("DDP", ddp), ("FSDP", fsdp)):
            host = sum(h for op, (h, _) in table.items() if not op.startswith(("ProfilerStep", "## ")))
            print(f"  {name}: self host time {host:.1f} ms per step (all operators, nested ones counted once)")
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
