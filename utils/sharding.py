"""What distributed_fsdp.py needs beside torch's FSDP: the flags of its layout (read by its shard()), and its test
batches: a sharded model all-gathers its parameters in every forward, so every rank must forward as many batches as
the rank with the most (the unpadded shards differ by up to one batch)."""
import argparse
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from utils import flags
from utils.errors import UsageError


def add_flags(parser) -> None:
    """--units, --reshard-after-forward and --replicas, in the group "sharding": how shard() lays the model out in
    FSDP units, and over which ranks (hsdp_mesh)."""
    sharding = parser.add_argument_group("sharding")
    sharding.add_argument("--units", choices=["stages", "model"], default="stages",
                          help="stages: each residual stage and the root a unit, gathered in turn (least memory: "
                               "FSDP's recipe for big models); model: the whole model one unit, mixed precision by "
                               "autocast (a fraction of the host time per step: the fastest for a model this small; "
                               "docs/sharding.md)")
    sharding.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                          help="with --units stages: free each stage's gathered weights after its forward and gather "
                               "them again for backward (least memory, like ZeRO-3); --no-reshard-after-forward keeps "
                               "them until backward (one all-gather fewer per stage and step, like ZeRO-2)")
    sharding.add_argument("--replicas", type=flags.positive_int, default=1, metavar="R",
                          help="HSDP: the ranks in R groups, each sharding the model over its own ranks, the groups "
                               "replicas of one another (a 2-D DeviceMesh, R x world/R); R = the number of machines "
                               "shards inside each machine and all-reduces across them; 1: every rank shards (FSDP)")
    parser.checks.append(_reshard_needs_stages)


def broadcast_buffers_from_rank_0(model: torch.nn.Module) -> None:
    """Every rank (collective: a broadcast per buffer): rank 0's BatchNorm statistics on all ranks, as DDP keeps them;
    FSDP shards parameters, not buffers."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def hsdp_mesh(env, replicas: int) -> DeviceMesh | None:
    """None for --replicas 1 (fully_shard shards over every rank); else HSDP's 2-D mesh (collective: it makes a
    process group per row and per column): R groups of world/R consecutive ranks, each group one replica that
    shards the model over its ranks ("shard"), rank k of every group holding the same shard ("replicate")."""
    if replicas == 1:
        return None
    if env.world_size % replicas:
        raise UsageError(f"--replicas {replicas} cannot split {env.world_size} ranks into equal groups; give a "
                         "divisor of the world size (the number of machines, say)")
    return init_device_mesh(env.device.type, (replicas, env.world_size // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _reshard_needs_stages(args) -> str | None:
    if args.units == "model" and not args.reshard_after_forward:
        return "--no-reshard-after-forward is for --units stages: the one unit of --units model is kept until backward"
    return None


class PaddedShard:
    """This rank's test batches (`loader`), then empty batches of the test set's image shape until it has forwarded
    as many as the rank with the most: give it to metrics.evaluate for a sharded model. Each pass over it starts
    with two collectives (the image shape, the most batches of any rank), so every rank iterates it together."""

    ranks_forward_together = True  # metrics.evaluate refuses a stop= that would let one rank leave early

    def __init__(self, loader, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        batches = iter(self.loader)
        first = next(batches, None)
        empty = _empty_batch(first, self.device)  # collective
        most = torch.tensor([len(self.loader)], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # every rank forwards as many batches as the rank with the most
        mine = itertools.chain([first] if first is not None else [], batches)
        for _ in range(int(most.item())):
            yield next(mine, empty)


def _empty_batch(first, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 0 images of the test set's image shape, which a rank with no images learns from the others."""
    shape = torch.tensor(first[0].shape[1:] if first is not None else [], dtype=torch.long)
    shape = torch.nn.functional.pad(shape, (0, 8 - len(shape))).to(device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    dims = [d for d in shape.tolist() if d]
    return torch.empty(0, *dims, device=device), torch.empty(0, dtype=torch.long, device=device)
