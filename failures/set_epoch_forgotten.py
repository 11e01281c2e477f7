"""sampler.set_epoch forgotten: every epoch visits the data in the same order (silent).

Symptom: none that shows. Training runs, a little worse than it should: every epoch brings the same batches in the
same order, as if shuffle were off after the first permutation.
Cause: DistributedSampler draws its permutation from a generator seeded with seed + epoch, and the epoch is what
set_epoch() sets; without the call it stays 0. (A DataLoader with shuffle=True and no sampler draws a new
permutation every epoch by itself; a DistributedSampler does not.)
Find it: print the first samples of each epoch on one rank; here, the whole order of rank 0's shard.
Fix: sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader.

    python failures/set_epoch_forgotten.py          # "same order every epoch: True"
    python failures/set_epoch_forgotten.py --fixed  # a new order every epoch
"""
import torch
from _launch import launch, parse
from torch.utils.data import DataLoader, DistributedSampler


def main(rank, world_size, args):
    dataset = torch.arange(16)  # samples that are their own index
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    orders = []
    for epoch in range(3):
        if args.fixed:  # the fix: the sampler's permutation is seeded with seed + epoch
            sampler.set_epoch(epoch)
        orders.append(torch.cat(list(loader)).tolist())
        if rank == 0:
            print(f"rank 0, epoch {epoch}: samples {orders[-1]}")
    if rank == 0:
        print(f"rank 0: same order every epoch: {all(order == orders[0] for order in orders)}")


if __name__ == "__main__":
    launch(main, parse(__doc__))
