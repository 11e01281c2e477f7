"""The same random augmentation draws on every rank (silent).

Symptom: none that shows. Training runs, with less augmentation than intended: at each step every rank crops (and
flips, ...) its images with the same random draws, so a global batch of W x B images holds only B distinct draws.
Cause: every rank seeds its generator with the same seed (torch.manual_seed(seed), copied from a one-process
script) and draws in the same order: torchvision's RandomCrop and RandomHorizontalFlip draw from that generator.
DataLoader workers repeat it: each worker's seed is a base drawn from its rank's generator, plus the worker's number.
Find it: print a few draws on each rank (here the crops' corners, gathered on rank 0).
Fix: seed each rank differently: torch.manual_seed(seed + rank). The model's initial weights may then differ, which
DDP makes harmless: it copies rank 0's weights to every rank when it is built. (Or draw each sample's augmentation
from (seed, epoch, sample index), the same whichever rank loads it: this collection's training scripts do.)

    python failures/same_augmentation.py          # "the same draws on every rank: True"
    python failures/same_augmentation.py --fixed  # other draws on each rank
"""
import torch
import torch.distributed as dist
from _launch import launch, parse

SEED = 0


def main(rank, world_size, args):
    if args.fixed:  # the fix: a stream of random numbers of its own on each rank
        torch.manual_seed(SEED + rank)
    else:
        torch.manual_seed(SEED)
    # a random crop of 32x32 out of each of this rank's 4 images padded to 40x40: the top-left corners
    corners = torch.randint(0, 40 - 32 + 1, (4, 2))
    gathered = [torch.empty_like(corners) for _ in range(world_size)]
    dist.all_gather(gathered, corners)
    if rank == 0:
        for r, drawn in enumerate(gathered):
            print(f"rank {r} crops its 4 images at corners {drawn.tolist()}")
        print(f"the same draws on every rank: {all(torch.equal(drawn, gathered[0]) for drawn in gathered)}")


if __name__ == "__main__":
    launch(main, parse(__doc__))
