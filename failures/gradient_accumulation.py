"""Gradient accumulation done wrong twice: an all-reduce for every micro-batch, and a loss K times too large (silent).

Symptom: none that shows. Training is slower than it should be, and behaves as if the learning rate were K times
higher (here K = 4 micro-batches per optimizer step).
Cause: DDP all-reduces the gradients in every backward(), unless it runs inside model.no_sync(); the result is the
same, at K times the communication. And backward() adds up the micro-batches' gradients, so K losses that are
each a mean over a micro-batch give K times the gradient of the mean over the whole batch.
Find it: count the all-reduces with a communication hook (model.register_comm_hook; here one bucket each time), and
compare the accumulated gradient with the gradient of the whole batch computed at once.
Fix: every micro-batch but the last under model.no_sync(); each micro-batch's loss divided by K.

    python failures/gradient_accumulation.py          # 4 all-reduces per step; gradient 4x the whole batch's
    python failures/gradient_accumulation.py --fixed  # 1 all-reduce per step; the whole batch's gradient
"""
import contextlib
import copy

import torch
from _launch import launch, parse
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

K = 4  # micro-batches per optimizer step


def counting_allreduce(counter, bucket):  # DDP calls it for each bucket of gradients to all-reduce
    counter["all-reduces"] += 1
    return allreduce_hook(None, bucket)  # None: the default process group


def main(rank, world_size, args):
    torch.manual_seed(0)  # the same data and weights on every rank
    x, y = torch.randn(world_size * 16, 8), torch.randn(world_size * 16, 1)  # 16 samples per rank
    whole_batch = nn.Linear(8, 1)
    model = DistributedDataParallel(copy.deepcopy(whole_batch))
    counter = {"all-reduces": 0}
    model.register_comm_hook(counter, counting_allreduce)
    mine = slice(rank * 16, (rank + 1) * 16)
    for i, (xs, ys) in enumerate(zip(x[mine].split(16 // K), y[mine].split(16 // K), strict=True)):
        sync = contextlib.nullcontext()
        if args.fixed and i < K - 1:  # the fix: accumulate locally, all-reduce in the last backward() only
            sync = model.no_sync()
        with sync:
            loss = nn.functional.mse_loss(model(xs), ys)
            if args.fixed:  # the fix: K means of micro-batches, each divided by K, sum to the mean of the batch
                loss = loss / K
            loss.backward()
    nn.functional.mse_loss(whole_batch(x), y).backward()  # every rank's samples at once, in one process
    accumulated, expected = model.module.weight.grad, whole_batch.weight.grad
    if rank == 0:
        print(f"{counter['all-reduces']} gradient all-reduce(s) for one optimizer step of {K} micro-batches")
        print(f"accumulated gradient / the whole batch's gradient: {accumulated.norm() / expected.norm():.4f} "
              f"(largest difference {(accumulated - expected).abs().max():.1e})")


if __name__ == "__main__":
    launch(main, parse(__doc__))
