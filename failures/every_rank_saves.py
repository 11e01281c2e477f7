"""Every rank writes the checkpoint: W writes of the same file, racing each other.

Symptom: W writes of checkpoint.pt for every checkpoint, and now and then a rank fails with
"FileNotFoundError: [Errno 2] No such file or directory: '.../checkpoint.pt.tmp' -> '.../checkpoint.pt'", or
fails to load a checkpoint that another rank is still writing: "EOFError", or even "Cannot use ``weights_only=True``
with files saved in the legacy .tar format".
Cause: the saving code runs on every rank, and every rank holds the same weights (DDP keeps them equal), so W ranks
write the same bytes to the same path: W times the I/O (on a shared file system, from every machine), and with
write-then-rename, one rank renames the temporary file that another is still writing or has already renamed.
Find it: count the writes (a log line per save, or strace -f -e trace=rename python ...): W per checkpoint.
Fix: rank 0 writes; a barrier keeps the other ranks from reading the checkpoint before it is complete.

    python failures/every_rank_saves.py          # 20 writes for 10 checkpoints, some failing
    python failures/every_rank_saves.py --fixed  # 10 writes, and every load succeeds
"""
import os
import tempfile

import torch
import torch.distributed as dist
from _launch import launch, parse
from torch import nn


def main(rank, world_size, args):
    torch.manual_seed(0)
    model = nn.Linear(2048, 1024)  # 8 MB of weights
    path = os.path.join(args.directory, "checkpoint.pt")
    counts, errors = torch.zeros(3, dtype=torch.int64), []  # writes, failed renames, failed loads
    for step in range(10):
        dist.barrier()  # stands for a training step, whose all-reduce keeps the ranks in step
        if not args.fixed or rank == 0:  # the fix: one rank writes (rank 0)
            counts[0] += 1
            try:
                torch.save(model.state_dict(), path + ".tmp")  # write, then rename: no half-written checkpoint.pt
                os.replace(path + ".tmp", path)
            except OSError as error:  # uncaught, as in most code, it ends the run now and then
                counts[1] += 1
                errors.append(f"rank {rank}, checkpoint {step}: {type(error).__name__}: {error}")
        if args.fixed:  # the fix: the others wait until rank 0's checkpoint is complete
            dist.barrier()
        try:
            model.load_state_dict(torch.load(path, weights_only=True))  # resume, evaluate, hand over ...
        except Exception as error:  # a file that another rank is still writing
            counts[2] += 1
            errors.append(f"rank {rank}, checkpoint {step}: {type(error).__name__}: {error}")
    for line in errors[:2]:
        print(line)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"10 checkpoints: {counts[0]} writes of checkpoint.pt, {counts[1]} failed renames, "
              f"{counts[2]} failed loads")


if __name__ == "__main__":
    args = parse(__doc__)
    with tempfile.TemporaryDirectory() as args.directory:
        launch(main, args)
