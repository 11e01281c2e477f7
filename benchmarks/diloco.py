"""What distributed_diloco.py sends, counted: its all-reduces and their bytes per optimizer step at several
--sync-every H, against distributed.py's DDP.

    python -m benchmarks.diloco                                  # 2 ranks; DDP, then H = 1, 4, 16, 64; 64 steps each
    python -m benchmarks.diloco --ranks 4 --sync-every 1,8 --steps 32

Each rank runs the scripts' own train_one_epoch (distributed_diloco.py's with its end_round) over random images
while torch.distributed's collectives are counted (benchmarks.sharding's CountedCollectives); DDP is given torch's
all-reduce hook, which calls dist.all_reduce, as there. The images are 8x8: what is sent does not depend on their size.
DDP is distributed.py's without SyncBatchNorm (--no-sync-bn), whose 40 small all-reduces a step DiLoCo has no use for.
"""
import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import distributed_diloco
from benchmarks.sharding import CountedCollectives
from utils import flags, models
from utils.spawn import free_port

CPU = torch.device("cpu")


class NoStop:
    """The safety net as train_one_epoch sees it: no stop ever comes."""

    def step_done(self, loss, grad_norm=None) -> bool:
        return False


def count(rank: int, world_size: int, sync_every: int | None, steps: int, batch: int = 2) -> dict:
    """On a process group already made: `steps` steps of DDP (sync_every None) or of DiLoCo with that H, each rank
    on random images of its own; the all-reduces and their bytes (rank 0's, the same on every rank)."""
    torch.manual_seed(0)
    model = models.resnet18_cifar()
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 100, (batch,), generator=g))
              for _ in range(steps)]
    counted = CountedCollectives()
    if sync_every is None:
        model = DDP(model)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with counted:
            distributed.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, loader, CPU, NoStop())
    else:
        outer_model = copy.deepcopy(model)
        outer_optimizer = torch.optim.SGD(outer_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with counted:
            distributed_diloco.train_one_epoch(
                model, nn.CrossEntropyLoss(), optimizer, loader, CPU, NoStop(), sync_every=sync_every, steps=steps,
                end_round=lambda: distributed_diloco.end_round(model, outer_model, outer_optimizer, optimizer,
                                                               world_size))
    return {"all_reduces": counted.calls.get("all_reduce", 0), "bytes": counted.bytes.get("all_reduce", 0),
            "other": {k: v for k, v in counted.calls.items() if k != "all_reduce"}, "steps": steps}


def _rank(rank, world_size, port, plan, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = [{"sync_every": h, **count(rank, world_size, h, steps)} for h in plan]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def markdown(results: list[dict], ranks: int, command: str) -> str:
    ddp = next(r for r in results if r["sync_every"] is None)
    lines = [f"Command: `{command}` ({ranks} ranks, gloo, float32, {results[0]['steps']} steps each).", "",
             "| script | all-reduces / step | MB sent in them / step | bytes vs DDP |", "|---|---|---|---|"]
    for r in results:
        name = "`distributed.py --no-sync-bn` (DDP)" if r["sync_every"] is None else \
            f"`distributed_diloco.py --sync-every {r['sync_every']}`"
        lines.append(f"| {name} | {r['all_reduces'] / r['steps']:.4g} | {r['bytes'] / r['steps'] / 2**20:.3f} "
                     f"| {r['bytes'] / ddp['bytes']:.4f} |")
    return "\n".join(lines) + "\n"


def sync_every_list(text: str) -> list[int]:
    return [flags.positive_int(word) for word in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=flags.positive_int, default=2, help="processes (gloo, on the CPU)")
    parser.add_argument("--sync-every", type=sync_every_list, default="1,4,16,64", metavar="H,H,...",
                        help="comma-separated values of H, each a positive integer")
    parser.add_argument("--steps", type=flags.positive_int, default=64, help="optimizer steps counted for each")
    args = parser.parse_args(argv)  # a bad value: argparse's one line, exit status 2
    plan = [None] + args.sync_every
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch, "counts.json"))
        mp.spawn(_rank, args=(args.ranks, free_port(), plan, args.steps, out), nprocs=args.ranks)
        results = json.loads(Path(out).read_text())
    command = " ".join(["python -m benchmarks.diloco", *(sys.argv[1:] if argv is None else argv)])
    print(markdown(results, args.ranks, command))


if __name__ == "__main__":
    main()
