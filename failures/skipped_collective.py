"""A collective skipped on one rank: the others wait for it, and the flight recorder names which one.

Symptom: the run stops at the end of an epoch with no error until the timeout (torch's default: 30 minutes;
5 s here): rank 0 waits in its 5th all_reduce, rank 1 at the barrier of the end of the epoch.
Cause: rank 1 skipped a step (its batch gave a loss that is not finite), and with it the all_reduce that every
rank calls in every step (DDP's backward() is one). Every rank must call the same collectives in the same order,
so a decision that skips one must be the same on every rank. Skipped in an earlier step, the all_reduce would pair
silently with rank 1's next one (wrong averages), and the hang comes only at the end of the epoch.
Find it: torch's flight recorder keeps the last collectives of each rank, numbered the same on every rank
(gloo's too). Here a timer thread writes it to a file per rank (TORCH_FR_DUMP_TEMP_FILE + rank, the name torch
uses) when the epoch has not ended after 1 s, and read_flight_recorder.py runs torch's analyser on the files:
"Not all ranks joining collective, sequence number: 6 ... missing ranks: {1}", and the stack of rank 0's call
(collective 1 is the launcher's barrier, 6 the 5th all_reduce). On NCCL the watchdog writes these files
itself when a collective times out (TORCH_NCCL_DUMP_ON_TIMEOUT=1, says torch's documentation).
Fix: decide together: all_reduce the "bad batch" flag, and every rank skips the step if any rank has one.

    python failures/skipped_collective.py                                 # rank 0 waits, the dumps are written
    python failures/read_flight_recorder.py /tmp/skipped_collective       # rank 1 missing from collective 6
    python failures/skipped_collective.py --fixed                         # both ranks skip step 4, exit 0
"""
import os
import tempfile
import threading
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401  # the first dump imports it (2 s): here, before the ranks fork, not in the wait
import torch.distributed as dist
from _launch import launch, parse

STEPS = 5
DUMP_AFTER = 1  # seconds: the epoch takes a few milliseconds
PREFIX = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.gettempdir(), "skipped_collective", "rank_"))


def dump_flight_recorder(rank):
    """This rank's flight recorder to PREFIX + rank, the file torch's analyser reads (a pickle; private API)."""
    trace = torch._C._distributed_c10d._dump_fr_trace()  # every entry, with the Python stack of its call
    os.makedirs(os.path.dirname(PREFIX) or ".", exist_ok=True)
    with open(f"{PREFIX}{rank}.partial", "wb") as file:
        file.write(trace)
    os.replace(f"{PREFIX}{rank}.partial", f"{PREFIX}{rank}")  # whole or absent, if the rank is stopped meanwhile
    print(f"rank {rank}: epoch not done after {DUMP_AFTER} s, flight recorder written to {PREFIX}{rank}")


def main(rank, world_size, args):
    dump = threading.Timer(DUMP_AFTER, dump_flight_recorder, (rank,))
    dump.start()
    try:
        for step in range(STEPS):
            loss = torch.tensor([float("nan") if (rank, step) == (1, 4) else float(step)])  # rank 1's 5th: bad
            bad = (~loss.isfinite()).float()
            if args.fixed:  # the fix: the same decision on every rank: skip the step if any rank's batch is bad
                dist.all_reduce(bad)
            if bad.item():
                print(f"rank {rank}, step {step}: loss {loss.item()}, step skipped")
                continue  # the bug, without the fix: this rank alone skips the all_reduce below
            dist.all_reduce(loss)  # the gradients' all-reduce, as in DDP's backward()
        print(f"rank {rank}: epoch done, waiting for the others")
        dist.monitored_barrier(timeout=timedelta(seconds=4))  # the end of the epoch (not in the flight recorder)
    finally:
        dump.cancel()
        dump.join()  # a dump under way is finished before the rank exits
    print(f"rank {rank}: every rank finished the epoch")


if __name__ == "__main__":
    launch(main, parse(__doc__))
