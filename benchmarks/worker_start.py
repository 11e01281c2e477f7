"""Seconds from asking for an epoch's batches to the first batch, in a rank started by mp.spawn, as the
scripts' loader does it (workers forked once, kept across epochs) and as a plain DataLoader would (the
start method of the rank: spawn, new workers every epoch), in one run.

    python -m benchmarks.worker_start                       # 50,000 images, 4 workers, 3 epochs
    python -m benchmarks.worker_start --workers 8 --epochs 5

Each worker that spawn starts imports torch again and receives the pickled dataset; fork copies the rank.
"""
import json
import statistics
import sys
import time

import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from utils import data, flags


def worker_options(way: str, workers: int) -> dict:
    """The scripts' DataLoader options for `workers` workers (their `loading`: forked, kept for the whole run), or
    what DataLoader does when nothing is chosen: the rank's start method, workers started every epoch."""
    if way == "plain DataLoader":
        return {"num_workers": workers}
    return {"num_workers": workers, "persistent_workers": workers > 0,
            "multiprocessing_context": "fork" if workers and sys.platform == "linux" else None}


def _rank(_index: int, args, way: str, results: list) -> None:
    dataset = data.Images(*data.synthetic(args.images, train=True), augment=True, seed=0)
    sampler = data.ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        **worker_options(way, args.workers))
    seconds = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # the order's epoch and the augmentation's, as the scripts set them
        started = time.perf_counter()
        batches = iter(loader)
        next(batches)
        seconds.append(time.perf_counter() - started)
        del batches
    results.append(seconds)


def main(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.worker_start", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--images", type=flags.positive_int, default=50_000, help="training images (synthetic)")
    parser.add_argument("--workers", type=flags.positive_int, default=4, help="DataLoader workers")
    parser.add_argument("--batch-size", type=flags.positive_int, default=128, help="images per batch")
    parser.add_argument("--epochs", type=flags.positive_int, default=3, help="epochs timed, each way")
    args = parser.parse_args(argv)
    report = {}
    for way in ("scripts' loader", "plain DataLoader"):
        with mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_rank, args=(args, way, results), nprocs=1)
            seconds = list(results[0])
        report[way] = [round(s, 3) for s in seconds]
        later = f"; epochs 2-{args.epochs}: median {statistics.median(seconds[1:]):.3f} s" if args.epochs > 1 else ""
        print(f"{way}: first batch of epoch 1 after {seconds[0]:.3f} s{later}", flush=True)
    print(json.dumps({"workers": args.workers, "images": args.images, "seconds": report}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
