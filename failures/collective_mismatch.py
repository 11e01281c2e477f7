"""A collective called with another shape on one rank: all_gather of a test set that does not split evenly.

Symptom: with gloo, one rank dies with "terminate called after throwing an instance of 'gloo::EnforceNotMet' ...
op.preamble.length <= op.nbytes. 44 vs 40. Received data size doesn't match expected size. Is there a distributed
collective mismatch in your code?" (SIGABRT), and another may first print garbage it gathered (numbers like
47244640256). NCCL checks no shapes either: a hang until the watchdog's timeout, or wrong numbers. Collectives
called in another order on one rank, or one collective more (a metric logged on rank 0 only), end the same way.
Cause: every rank must call the same collectives in the same order, with the same shapes and dtypes. 21 test
samples on 2 ranks make shards of 11 and 10 samples, and all_gather needs the same shape on every rank.
Find it: TORCH_DISTRIBUTED_DEBUG=DETAIL checks each collective's operation, shapes and dtypes on all ranks before
running it (with collectives of its own each time, so for debugging only) and names the difference: "Detected mismatch
between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=1,
OpType=ALLGATHER, TensorShape=[11], ...), but Rank 1 is running collective: ... TensorShape=[10] ...".
Fix: one shape on every rank: pad each shard to the longest and drop the padding after gathering (or
all_gather_object for small Python values; for a metric, all_reduce counts instead of gathering predictions).

    python failures/collective_mismatch.py                                 # SIGABRT (and garbage)
    TORCH_DISTRIBUTED_DEBUG=DETAIL python failures/collective_mismatch.py  # the mismatch, named
    python failures/collective_mismatch.py --fixed                         # 21 predictions gathered, exit 0
"""
import torch
import torch.distributed as dist
from _launch import launch, parse

TEST_SAMPLES = 21


def main(rank, world_size, args):
    # this rank's predictions for its samples r, r + W, r + 2W, ...: here the sample numbers themselves, so that
    # the gathered tensor shows which samples came back
    predictions = torch.arange(rank, TEST_SAMPLES, world_size)
    if args.fixed:  # the fix: the same shape on every rank: pad to the longest shard with -1
        longest = -(-TEST_SAMPLES // world_size)
        predictions = torch.cat([predictions, predictions.new_full((longest - len(predictions),), -1)])
    gathered = [torch.empty_like(predictions) for _ in range(world_size)]
    dist.all_gather(gathered, predictions)
    gathered = torch.cat(gathered)
    print(f"rank {rank} gathered {gathered.tolist()}")
    if args.fixed:  # the fix: drop the padding
        gathered = gathered[gathered >= 0]
    every_sample_once = sorted(gathered.tolist()) == list(range(TEST_SAMPLES))
    print(f"rank {rank}: {len(gathered)} predictions, every test sample once: {every_sample_once}")


if __name__ == "__main__":
    launch(main, parse(__doc__))
