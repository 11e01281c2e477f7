"""Evaluation through the DDP wrapper on rank 0 only: the run hangs after the first epoch.

Symptom: training stops after epoch 0, with no error, until the collective timeout (torch's default: 30 minutes;
5 s here), when the ranks fail with "Timed out waiting 5000ms for send (or recv) operation to complete" (gloo;
NCCL's watchdog says "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=BROADCAST ...").
Cause: DDP's forward is itself a collective. Before computing, it broadcasts rank 0's buffers (here BatchNorm's
running statistics) to every rank (broadcast_buffers=True, the default; torch 2.15 renames it forward_sync_buffers).
Called on rank 0 alone, it waits for ranks that are waiting elsewhere: at the barrier that lets rank 0 evaluate.
Without buffers DDP's forward runs no collective, so the same code seems fine until a BatchNorm comes in.
Saving on rank 0 alone is safe under DDP (state_dict() runs no collective), but not under FSDP, where gathering
the full state dict is a collective.
Find it: a stack of each rank (printed here after 3 s; py-spy dump --pid PID on a real run) shows rank 0 in DDP's
_distributed_broadcast_coalesced and the others in barrier(); torch's flight recorder (on by default, for gloo
too, in torch 2.15) shows the same collective, #20, called as a broadcast on rank 0 and as a barrier on rank 1.
Fix: on rank 0 alone, run the unwrapped model, model.module; or evaluate on every rank and reduce the counts.

    python failures/eval_on_rank0.py          # epoch 0's evaluation hangs: a timeout after 5 s
    python failures/eval_on_rank0.py --fixed  # 3 epochs, exit 0
"""
import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(rank, world_size, args):
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        model.train()
        for start in range(rank * 8, len(x), world_size * 8):  # this rank's batches of 8
            loss = nn.functional.cross_entropy(model(x[start:start + 8]), y[start:start + 8])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            evaluated = model
            if args.fixed:  # the fix: the module inside the wrapper computes and runs no collective
                evaluated = model.module
            evaluated.eval()
            with torch.no_grad():
                accuracy = (evaluated(x).argmax(1) == y).float().mean()
            print(f"epoch {epoch}: accuracy {accuracy:.2f}")
        dist.barrier()  # the other ranks wait for rank 0's evaluation
    print(f"rank {rank}: done")


if __name__ == "__main__":
    launch(main, parse(__doc__))
