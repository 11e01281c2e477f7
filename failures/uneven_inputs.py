"""Uneven inputs: one rank has a batch more than the others, and the epoch never ends.

Symptom: the run hangs at the end of an epoch until the collective timeout (torch's default: 30 minutes; 5 s
here). At the barrier of the end of the epoch, dist.monitored_barrier names the late rank: "[Rank 0]: Rank 1
failed to pass monitoredBarrier in 4000 ms".
Cause: every backward() under DDP all-reduces the gradients, so every rank must run the same number of steps.
Data split by hand (here 33 samples: 16 per rank, and the last rank takes the remainder) gives rank 1 a fifth
batch whose all-reduce no other rank joins. Without a collective at the end of the epoch it is worse: the extra
all-reduce pairs silently with the next epoch's first one on the other ranks, and the hang comes only at the end.
Find it: count the steps of each rank; monitored_barrier (gloo only, its timeout given explicitly: by default it
waits torch's 30 minutes, not the group's timeout) names the rank that did not arrive.
Fix: torch.distributed.algorithms.Join([model]) around the loop: a rank that runs out of data joins the others'
all-reduces with zeros until every rank is done (the average is still divided by the world size, so the extra
steps' gradients are scaled down). Or the same number of batches on every rank: DistributedSampler pads the
shards to equal length with repeated samples, or with drop_last=True drops the remainder.

    python failures/uneven_inputs.py                  # rank 1's fifth step waits: rank 1 named after 4 s
    python failures/uneven_inputs.py --fixed          # Join: 4 and 5 steps, exit 0
    python failures/uneven_inputs.py --fixed sampler  # DistributedSampler(drop_last=True): 4 steps each, exit 0
"""
import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler


def main(rank, world_size, args):
    torch.manual_seed(0)
    data = torch.randn(33, 8)
    if args.fixed == "sampler":  # the fix: equal shards (drop_last: 16 samples each, 4 batches)
        shard = list(DistributedSampler(data, world_size, rank, shuffle=False, drop_last=True))
    else:  # by hand: 16 samples each, and the last rank takes the remainder
        size = len(data) // world_size
        shard = list(range(rank * size, len(data) if rank == world_size - 1 else (rank + 1) * size))
    model = DistributedDataParallel(nn.Linear(8, 1))
    steps = 0
    joined = contextlib.nullcontext()
    if args.fixed == "join":  # the fix: a rank out of data joins the others' all-reduces until all are done
        joined = Join([model])
    with joined:
        for batch in torch.tensor(shard).split(4):
            model(data[batch]).pow(2).mean().backward()  # all-reduces the gradients (the optimizer left out)
            steps += 1
    print(f"rank {rank}: {len(shard)} samples, {steps} steps")
    # the end of the epoch: unlike barrier(), it names a rank that is late; 4 s, before the collectives' 5 s run out
    dist.monitored_barrier(timeout=timedelta(seconds=4))


if __name__ == "__main__":
    launch(main, parse(__doc__, fixes=("join", "sampler")))
