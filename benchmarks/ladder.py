"""What a rank holds and what it waits for on each rung of the sharding ladder, at several world sizes and model sizes.

    python -m benchmarks.ladder --quick     # ResNet-18 at 1, 2, 4 ranks, then ResNet-50 and ViT-B/4 at 2
    python -m benchmarks.ladder --models resnet18,resnet50,vit_b4 --ranks 1,2,4

For each model, strategy and world size it starts that many processes (gloo on the CPU, NCCL on GPUs),
trains a few steps of synthetic 32x32 images and counts, on rank 0 (the pipeline: on its largest stage):
- the bytes it holds for parameters, gradients and optimizer state (summed over its tensors; under FSDP
  only its shards, as DTensor.to_local() gives them);
- its peak memory as the device reports it (CUDA's max_memory_allocated; on the CPU the process's peak
  resident set, which includes torch itself, so compare its differences, not its values);
- the collectives of one training step and their bytes, counted by wrapping torch.distributed's calls;
- the median time per step of the timed steps, as seconds per 50,000-image epoch.

The rungs, each holding less per rank than the one before: DDP is distributed.py's (SyncBatchNorm, DDP); ZeRO-1 is
distributed_zero.py's (DDP, its SGD in a ZeroRedundancyOptimizer: the optimizer state sharded); FSDP is
distributed_fsdp.py's shard(), without reshard after forward (ZeRO-2-like) and with it (ZeRO-3-like); HSDP is
shard() on its 2-D mesh of 2 replicas (--replicas 2), at even world sizes of 4 and more. Pipeline is
distributed_pipeline.py's split() and 1F1B schedule, a stage a rank, the same global batch (per-rank batch x
ranks) in 2 micro-batches a stage; its figures are those of the rank holding the most (the last stage: layer4 and
fc), its messages the point-to-point sends of activations and their gradients (counted by wrapping the schedule's).
ViT-B/4 is torchvision's VisionTransformer with a patch of 4 for 32x32 images (64 tokens), sharded per encoder block.
Writes <output-dir>/sharding.md and .json.
"""
import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import harness
from utils import models, sharding
from utils.launch import Env
from utils.syncbn import CpuSyncBatchNorm

# the ladder, rung by rung; then the pipeline, which splits the layers instead (ResNet-18 only: its split())
STRATEGIES = ("DDP", "ZeRO-1", "FSDP, no reshard after forward", "FSDP", "HSDP", "Pipeline")
# torch.distributed's names (FSDP2 calls the *_single ones since torch 2.10 or so, *_tensor before)
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "broadcast")


def build(name: str) -> nn.Module:
    """The model, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    if name == "resnet18":
        return models.resnet18_cifar()
    if name == "resnet50":
        model = torchvision.models.resnet50(num_classes=100)
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)  # the CIFAR stem
        model.maxpool = nn.Identity()
        return model
    if name == "vit_b4":
        return torchvision.models.VisionTransformer(image_size=32, patch_size=4, num_layers=12, num_heads=12,
                                                    hidden_dim=768, mlp_dim=3072, num_classes=100)
    raise ValueError(name)


def wrap(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """As the scripts do: SyncBatchNorm, then DDP or FSDP. DDP gets torch's own all-reduce hook (the arithmetic of its
    built-in path), which calls dist.all_reduce, so that the count here sees its all-reduces."""
    sync_bn = nn.SyncBatchNorm if device.type == "cuda" else CpuSyncBatchNorm
    model = sync_bn.convert_sync_batchnorm(model).to(device)
    if strategy in ("DDP", "ZeRO-1"):  # ZeRO-1 differs in its optimizer only (make_optimizer)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        return model
    reshard = strategy != "FSDP, no reshard after forward"
    # HSDP: distributed_fsdp.py --replicas 2's mesh, 2 replicas each sharded over half the ranks
    env = Env(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    mesh = sharding.hsdp_mesh(env, 2) if strategy == "HSDP" else None
    if isinstance(model, torchvision.models.ResNet):
        import distributed_fsdp
        return distributed_fsdp.shard(model, None, reshard=reshard, mesh=mesh)
    for block in model.encoder.layers:  # a ViT: each encoder block one unit
        fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
    return fully_shard(model, reshard_after_forward=reshard, mesh=mesh)


def pipeline_stage(model: nn.Module, device: torch.device, microbatches: int):
    """distributed_pipeline.py's stage of this rank and its 1F1B schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import distributed_pipeline
    rank, ranks = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(distributed_pipeline.split(model, rank, ranks).to(device), rank, ranks, device)
    return stage, Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=nn.CrossEntropyLoss())


def make_optimizer(model: nn.Module, strategy: str) -> torch.optim.Optimizer:
    """The scripts' SGD; ZeRO-1's is distributed_zero.py's, each rank's SGD over its share of the parameters."""
    settings = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)
    if strategy == "ZeRO-1":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **settings)
    return torch.optim.SGD(model.parameters(), **settings)


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of optimizer state this rank holds: its shards under FSDP; under ZeRO-1 the state of its own SGD,
    over its share of the parameters."""
    return local_bytes(t for state in getattr(optimizer, "optim", optimizer).state.values() for t in state.values()
                       if isinstance(t, torch.Tensor))


class CountedCollectives:
    """Counts the calls of torch.distributed's collectives and their bytes while installed."""

    def __init__(self):
        self.calls, self.bytes, self.saved = {}, {}, {}

    def __enter__(self):
        from torch.distributed.pipelining import schedules
        original_p2p = self.saved["p2p"] = schedules._batch_p2p  # a stage's sends and receives, each batch of them

        @functools.wraps(original_p2p)
        def counted_p2p(ops, *args, **kwargs):
            sends = [op.tensor for op in ops if op.op is dist.isend]
            self.calls["send"] = self.calls.get("send", 0) + len(sends)
            self.bytes["send"] = self.bytes.get("send", 0) + sum(t.numel() * t.element_size() for t in sends)
            return original_p2p(ops, *args, **kwargs)
        schedules._batch_p2p = counted_p2p
        for name in (n for n in COLLECTIVES if hasattr(dist, n)):
            original = self.saved[name] = getattr(dist, name)

            @functools.wraps(original)
            def counted(*args, _name=name, _original=original, **kwargs):
                # the whole buffer: all-gather's output, reduce-scatter's input, all-reduce's tensor
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                whole = max((t.numel() * t.element_size() for t in tensors), default=0)
                self.calls[_name] = self.calls.get(_name, 0) + 1
                self.bytes[_name] = self.bytes.get(_name, 0) + whole
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        from torch.distributed.pipelining import schedules
        schedules._batch_p2p = self.saved.pop("p2p")
        for name, original in self.saved.items():
            setattr(dist, name, original)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # kilobytes on Linux


def measure(rank: int, world_size: int, port: int, config: dict) -> dict:
    device = torch.device(f"cuda:{rank}" if config["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    try:
        pipeline = config["strategy"] == "Pipeline"
        if pipeline:  # every stage the same global batch, in 2 micro-batches a stage
            stage, schedule = pipeline_stage(build(config["model"]), device, 2 * world_size)
            model = stage.submod
        else:
            model = wrap(build(config["model"]), config["strategy"], device)
        optimizer = make_optimizer(model, config["strategy"])
        g = torch.Generator().manual_seed(0 if pipeline else rank)
        batch = config["batch_size"] * (world_size if pipeline else 1)
        images = torch.randn(batch, 3, 32, 32, generator=g).to(device)
        targets = torch.randint(0, 100, (batch,), generator=g).to(device)
        times, counted = [], CountedCollectives()  # the collectives of the first timed step
        for step in range(config["warmup"] + config["steps"]):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with counted if step == config["warmup"] else contextlib.nullcontext():
                optimizer.zero_grad(set_to_none=False)  # gradients kept, to count them below
                if pipeline:  # the first stage takes the images, the last the targets
                    schedule.step(*[images][:stage.is_first], target=targets if stage.is_last else None)
                else:
                    nn.functional.cross_entropy(model(images), targets).backward()
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= config["warmup"]:
                times.append(time.perf_counter() - started)
        params = list(model.parameters())
        return {
            "rank": rank,
            "parameters": sum(p.numel() for p in params),
            "param_bytes": local_bytes(params),
            "grad_bytes": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_bytes": optimizer_state_bytes(optimizer),
            "peak_memory_mb": peak_memory_mb(device),
            "step_s": statistics.median(times),
            "collectives": counted.calls, "collective_bytes": counted.bytes,
        }
    finally:
        dist.destroy_process_group()


def run(config: dict) -> dict:
    """Rank 0's figures; the pipeline's, those of the rank holding the most (its largest stage)."""
    ranks = harness.spawn_ranks(measure, config["ranks"], config)
    if config["strategy"] == "Pipeline":
        largest = max(ranks, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
        return {**config, **largest, "parameters": sum(r["parameters"] for r in ranks)}
    return {**config, **ranks[0]}


def markdown(results: list[dict], meta: dict) -> str:
    mb = 2**20
    lines = [f"Hardware: {meta['hardware']}; torch {meta['torch']}. Command: `{meta['command']}`.",
             f"Per-rank batch {meta['batch_size']}, float32, SGD with momentum; median of {meta['steps']} steps "
             f"after {meta['warmup']}. Bytes are rank 0's (the pipeline's: its largest stage's, the rank named), "
             "counted from its tensors.", ""]
    rows = []
    for r in results:
        ddp = next((d for d in results if d["model"] == r["model"] and d["ranks"] == r["ranks"]
                    and d["strategy"] == "DDP"), None)
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        calls = ", ".join(f"{n} {k.replace('_into_tensor', '').replace('_single', '').replace('_tensor', '')}"
                          for k, n in sorted(r["collectives"].items())) or "none"
        epoch = harness.EPOCH_IMAGES / (r["batch_size"] * r["ranks"]) * r["step_s"]
        strategy = r["strategy"] + (f" (rank {r['rank']})" if r.get("rank") else "")
        rows.append([r["model"], f"{r['parameters'] / 1e6:.1f} M", strategy, r["ranks"], f"{r['param_bytes'] / mb:.0f}",
                     f"{r['grad_bytes'] / mb:.0f}", f"{r['optimizer_bytes'] / mb:.0f}", f"{state / mb:.0f}",
                     f"{r['peak_memory_mb']:.0f}", calls, f"{sum(r['collective_bytes'].values()) / mb:.0f}",
                     f"{epoch:.0f}", f"{r['step_s'] / ddp['step_s']:.2f}" if ddp else ""])
    lines += harness.table(["model", "parameters", "strategy", "ranks", "params MB", "grads MB", "optimizer MB",
                            "state MB / rank", "peak MB (device)", "collectives / step", "MB of their buffers / step",
                            "s per 50,000-image epoch", "time vs DDP"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ladder", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,vit_b4",
                        help="comma-separated: resnet18, resnet50, vit_b4 (default: all three)")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-18 at --ranks, the larger models at 2 ranks only, 3 timed steps")
    parser.add_argument("--batch-size", type=int, default=8, help="images per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (one is counted)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--output-dir", default="runs/benchmark", help="where sharding.md and sharding.json go")
    args = parser.parse_args(argv)
    known = {"resnet18", "resnet50", "vit_b4"}
    model_names = args.models.split(",")
    try:
        ranks = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks takes comma-separated integers, got {args.ranks}")
    if not set(model_names) <= known:
        parser.error(f"--models: unknown {sorted(set(model_names) - known)}; choose from {sorted(known)}")
    if min(ranks) < 1 or args.batch_size < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--ranks, --batch-size, --steps and --warmup must be positive")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    if device == "cuda" and max(ranks) > torch.cuda.device_count():
        parser.error(f"--ranks {max(ranks)} needs as many GPUs; {torch.cuda.device_count()} visible")
    steps = 3 if args.quick else args.steps
    plan = [(m, s, n) for m in model_names for n in (ranks if m == "resnet18" or not args.quick else [2])
            for s in STRATEGIES if (s != "HSDP" or n >= 4 and n % 2 == 0)
            and (s != "Pipeline" or m == "resnet18" and 2 <= n <= 8)]
    results = []
    for i, (model, strategy, n) in enumerate(plan, 1):
        started = time.perf_counter()
        results.append(run({"model": model, "strategy": strategy, "ranks": n, "batch_size": args.batch_size,
                            "steps": steps, "warmup": args.warmup, "device": device}))
        r = results[-1]
        print(f"[{i}/{len(plan)}] {model}, {strategy}, {n} rank(s): "
              f"{(r['param_bytes'] + r['grad_bytes'] + r['optimizer_bytes']) / 2**20:.0f} MB of state on rank "
              f"{r['rank']}, "
              f"{r['step_s']:.2f} s per step ({time.perf_counter() - started:.0f} s)", flush=True)
    typed = sys.argv[1:] if argv is None else argv
    meta = {"hardware": f"{os.cpu_count()} cores of {harness.processor()}" if device == "cpu" else
            torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(["python -m benchmarks.ladder", *typed]),
            "batch_size": args.batch_size, "steps": steps, "warmup": args.warmup}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharding.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    (out / "sharding.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
