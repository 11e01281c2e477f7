"""ZeRO-1's optimizer state saved by rank 0 alone: the checkpoint hangs (pytorch/pytorch#60284).

Symptom: the run stops at its first checkpoint, with no error, until the collective timeout (torch's default: 30
minutes; 5 s here), when the ranks fail with "Timed out waiting 5000ms for recv operation to complete" (gloo; NCCL's
watchdog: "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=BROADCAST ...").
Cause: ZeroRedundancyOptimizer keeps each parameter's state (SGD's momentum, Adam's moments) on one rank only, so
rank 0 cannot write the whole state by itself: consolidate_state_dict(to=0) makes every other rank send its part,
and it is a collective. Called inside `if rank == 0:`, as the save of a DDP script is, it waits for ranks that are
waiting elsewhere (here at the barrier after the save). Without it, state_dict() raises "Optimizer state has not
been consolidated on this rank" on rank 0.
Find it: a stack of each rank (printed here after 3 s; py-spy dump --pid PID on a real run) shows rank 0 in
consolidate_state_dict's broadcast and the others in barrier(); torch's flight recorder shows the same collective,
#10, called as a broadcast on rank 0 and as a barrier on rank 1.
Fix: every rank calls optimizer.consolidate_state_dict(to=0), then rank 0 alone saves optimizer.state_dict()
(distributed_zero.py's checkpoints do it in safety_net/checkpoint.py); loading, every rank reads the whole file and
keeps its part, at any world size.

    python failures/zero_state_dict_on_rank0.py          # the first checkpoint hangs: a timeout after 5 s
    python failures/zero_state_dict_on_rank0.py --fixed  # 3 checkpoints, each with every parameter's momentum
"""
import io

import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def main(rank, world_size, args):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    # each rank keeps the momentum of its share of the 4 parameters (tensors), and updates only those
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(3):
        loss = nn.functional.cross_entropy(model(x[rank::world_size]), y[rank::world_size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # each rank steps its share, then broadcasts it to the others
        print(f"rank {rank}: step {step}, holds the momentum of {len(optimizer.optim.state)} of 4 parameters")
        if args.fixed:  # the fix: every rank sends its part of the state to rank 0
            optimizer.consolidate_state_dict(to=0)
        if rank == 0:  # the checkpoint, written by rank 0 as in a DDP script
            if not args.fixed:
                optimizer.consolidate_state_dict(to=0)  # the bug: a collective on one rank's path
            saved = io.BytesIO()  # stands for a file
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, saved)
            saved.seek(0)
            state = torch.load(saved, weights_only=True)["optimizer"]["state"]
            print(f"checkpoint {step}: the momentum of {len(state)} of 4 parameters")
        dist.barrier()  # the other ranks wait until the checkpoint is written
    print(f"rank {rank}: done")


if __name__ == "__main__":
    launch(main, parse(__doc__))
