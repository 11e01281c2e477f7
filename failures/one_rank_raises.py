"""One rank raises while the others wait: the job hangs until the timeout, and the error that ends it is a timeout.

Symptom: one rank hits an error (here a sample it cannot decode) and the job neither goes on nor ends. After the
collective timeout (torch's default: 30 minutes; 5 s here) the ranks fail with "Timed out waiting 5000ms for
recv operation to complete"; the real error shows only in the failed rank's log, if at all, as "During handling
of the above exception, another exception occurred".
Cause: the failed rank did not exit: on its way out it ran a collective (here a barrier in a finally: clause, "wait
for every rank before leaving"), and waits there for ranks that wait in backward()'s all-reduce. With NCCL,
a rank that simply exits has the same effect when the others run on another machine, where no launcher sees it die
(on one machine torchrun and mp.spawn stop the others; gloo fails the others' collectives at once with
"Connection reset by peer" when a peer's process ends).
Find it: the failed rank's log; the stacks of the waiting ranks show them in different collectives.
Fix: no collective on an error path: let the error end the rank. Its exit ends the job within seconds, with its
error: the launcher stops the other ranks (torchrun, mp.spawn), or their collectives fail (gloo). With NCCL across
machines, keep the timeout short (init_process_group(timeout=...)) so the watchdog ends the others.

    python failures/one_rank_raises.py          # rank 1's error, then a 5 s wait and a timeout
    python failures/one_rank_raises.py --fixed  # rank 1's error ends the job at once (exit status 1)
"""
import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def train(rank, model):
    for step in range(4):
        if rank == 1 and step == 2:
            raise ValueError("cannot decode sample 1234")  # a corrupt file, read by one rank only
        model(torch.randn(4, 8)).sum().backward()  # all-reduces the gradients


def main(rank, world_size, args):
    model = DistributedDataParallel(nn.Linear(8, 1))
    try:
        train(rank, model)
    finally:
        if not args.fixed:  # the bug: on error this rank waits here for ranks that wait in backward()
            dist.barrier()  # "every rank finishes before any leaves"
    if args.fixed:  # the fix: wait for the others on success only; an error leaves at once, and its exit ends the job
        dist.barrier()
    print(f"rank {rank}: done")


if __name__ == "__main__":
    launch(main, parse(__doc__))
