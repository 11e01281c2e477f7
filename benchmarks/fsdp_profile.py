"""FSDP on one process, where it has nothing to shard: distributed_fsdp.py's shard() against distributed.py's DDP,
step by step in one process, and what the difference is made of (torch.profiler).

    python -m benchmarks.fsdp_profile                                   # the CPU: per-rank batch 2, float32
    python -m benchmarks.fsdp_profile --precision bfloat16              # the scripts' bfloat16 (autocast / policy)
    python -m benchmarks.fsdp_profile --device cuda --batch-size 256 --precision bfloat16   # one GPU

Builds, in a world of one process (gloo on the CPU, NCCL on a GPU), the scripts' ResNet-18 three ways: wrapped
in DDP as distributed.py does (under autocast for bfloat16, as distributed_apex.py), sharded by
distributed_fsdp.py's shard() (its MixedPrecisionPolicy for bfloat16), and, for bfloat16, sharded the way
shard() did before 2026-11-24, each BatchNorm layer a unit of its own. Their training steps run interleaved,
so that the machine's noise hits all alike; the median of --steps is reported, with each one's ratio to DDP.
Then --profile-steps steps of each run under torch.profiler, and the operators whose time per step grows the
most from DDP to FSDP are listed: host time (on a GPU the host launches every kernel, and ResNet-18's kernels
at 256 images are short, so the host bounds the step), and on a GPU the device's time too.
On the CPU a small batch stands in for a GPU step: most of the step is then per-operator and per-unit
overhead, not arithmetic, as on a GPU.
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

DDP_KIND, FSDP_KIND, BEFORE_KIND = "DDP", "FSDP (shard())", "FSDP, a unit per BatchNorm (before)"


def shard_with_a_unit_per_norm(model: nn.Module, amp_dtype: torch.dtype) -> nn.Module:
    """shard() as it was before 2026-11-24: 20 BatchNorm units of their own (float32), then the stages and root."""
    for norm in [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
        fully_shard(norm, reshard_after_forward=False)
    policy = dict(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mp_policy=MixedPrecisionPolicy(**policy))
    return fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))


def build(kind: str, device: torch.device, amp_dtype: torch.dtype | None, reshard: bool) -> nn.Module:
    torch.manual_seed(0)
    model = models.resnet18_cifar().to(device)
    if kind == DDP_KIND:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if kind == BEFORE_KIND:
        return shard_with_a_unit_per_norm(model, amp_dtype)
    return distributed_fsdp.shard(model, amp_dtype, reshard)


def step(kind, model, optimizer, images, targets, amp_dtype) -> None:
    # DDP computes under autocast (distributed_apex.py); FSDP's policy casts the weights itself (no autocast)
    autocast = kind == DDP_KIND and amp_dtype is not None
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=autocast):
        loss = nn.functional.cross_entropy(model(images), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


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
                        help="images per step; default: 256 on a GPU, 2 on the CPU (a GPU step's share of overhead)")
    parser.add_argument("--steps", type=flags.positive_int, default=12, help="timed steps of each, interleaved")
    parser.add_argument("--profile-steps", type=flags.positive_int, default=3, help="profiled steps of each")
    parser.add_argument("--top", type=flags.positive_int, default=12, help="operators listed")
    parser.add_argument("--no-reshard-after-forward", action="store_true", help="shard() without resharding")
    args = parser.parse_args(argv)
    with exit_on_error():  # --device cuda without a GPU: one line, exit status 2
        cuda = launch.resolve_device(args.device) == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    batch = args.batch_size or (256 if cuda else 2)
    amp_dtype = torch.bfloat16 if args.precision == "bfloat16" else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # a world of one meets only itself
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        kinds = [DDP_KIND, FSDP_KIND] + ([BEFORE_KIND] if amp_dtype else [])
        built = {k: build(k, device, amp_dtype, not args.no_reshard_after_forward) for k in kinds}
        optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
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
        what = f"{device.type}, {args.precision}, batch {batch}, median of {args.steps} interleaved steps"
        print(f"{what}, torch {torch.__version__}")
        ddp_ms = statistics.median(times[DDP_KIND]) * 1000
        for kind in kinds:
            ms = statistics.median(times[kind]) * 1000
            print(f"  {kind:38s} {ms:8.2f} ms per step   {ms / ddp_ms:.2f}x DDP")
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
