"""DistributedSampler on the test set, and batch accuracies averaged: a wrong test accuracy (silent).

Symptom: the test accuracy differs from the one measured on one process, and changes with the number of ranks and
the batch size.
Cause: two. DistributedSampler pads the shards to equal length by repeating samples from the start (21 test samples
on 2 ranks: 22, sample 0 counted twice; with drop_last=True it drops samples instead). And averaging the batches'
accuracies, then the ranks', weights batches, not samples: a last batch of 3 counts as much as one of 8.
Find it: evaluate the same weights on one process, over the whole test set (here: printed alongside).
Fix: each rank takes every W-th sample, with no padding (shards differ by one sample at most); count correct
predictions and samples, and all_reduce the counts: correct / samples is exact at any world size and batch size.

    python failures/padded_test_sampler.py          # the accuracy reported, and the exact one: they differ
    python failures/padded_test_sampler.py --fixed  # they are equal
"""
import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn
from torch.utils.data import DistributedSampler


def main(rank, world_size, args):
    torch.manual_seed(0)  # the same test set and model on every rank
    images, labels = torch.randn(21, 4), torch.randint(0, 2, (21,))
    model = nn.Linear(4, 2)
    if args.fixed:  # the fix: every W-th sample, no padding
        shard = list(range(rank, len(labels), world_size))
    else:  # 11 samples on each rank: rank 1's last is sample 0 again
        shard = list(DistributedSampler(labels, world_size, rank, shuffle=False))
    correct, seen, batch_accuracies = 0, 0, []
    with torch.no_grad():
        for batch in torch.tensor(shard).split(8):
            hits = model(images[batch]).argmax(1) == labels[batch]
            correct, seen = correct + hits.sum().item(), seen + len(batch)
            batch_accuracies.append(hits.float().mean())
    if args.fixed:  # the fix: sum the counts over ranks; the accuracy is their ratio
        counts = torch.tensor([correct, seen])
        dist.all_reduce(counts)
        accuracy = counts[0] / counts[1]
    else:  # the mean of the batches' accuracies, averaged over ranks
        accuracy = torch.stack(batch_accuracies).mean()
        dist.all_reduce(accuracy)
        accuracy /= world_size
    with torch.no_grad():
        exact = (model(images).argmax(1) == labels).float().mean()  # on one process, for comparison
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}; exact, on one process: {exact:.4f}")


if __name__ == "__main__":
    launch(main, parse(__doc__))
