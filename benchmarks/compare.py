"""Every script on the same synthetic workload: a Markdown table of throughput, measured in one run.

    python -m benchmarks.compare                 # CPU: 2 processes per DDP method, DataParallel 1
    python -m benchmarks.compare --device cuda   # one process per visible GPU

Each method trains --steps steps of the global batch per epoch for --epochs epochs; the median of
the epochs after the first (which pays for start-up) is reported, as images/s over all processes and
the time a 50,000-image CIFAR epoch would take at that rate. On the CPU each method gets all cores:
OMP_NUM_THREADS = cores / processes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
METHODS = [  # name, script, how it is started, extra flags
    ("DataParallel", "dataparallel.py", "python", []),
    ("DDP (torchrun)", "distributed.py", "torchrun", []),
    ("DDP (spawn)", "distributed_mp.py", "spawn", []),
    ("DDP + mixed precision (O1: float16 on GPU, bfloat16 on CPU)", "distributed_apex.py", "spawn", []),
    ("DDP + apex script at O0 (float32)", "distributed_apex.py", "spawn", ["--opt-level", "O0"]),
    ("DDP + gradient accumulation (k=2)", "distributed_gradient_accumulation.py", "spawn",
     ["--grad-accu-steps", "2"]),
]


def command(script: str, start: str, nprocs: int) -> list[str]:
    path = str(ROOT / script)
    if start == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", path]
    return [sys.executable, path] + (["--nprocs", str(nprocs)] if start == "spawn" else [])


def measure(script, start, extra, args, nprocs) -> dict:
    procs = 1 if start == "python" else nprocs
    with tempfile.TemporaryDirectory() as out:
        cmd = command(script, start, nprocs) + [
            "--dataset", "synthetic", "--train-samples", str(args.steps * args.batch_size), "--test-samples", "64",
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--workers", str(args.workers),
            "--device", args.device, "--print-freq", "1000", "--output-dir", out] + extra
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs))}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    rate = statistics.median(r["images_per_s"] for r in records[1:])
    return {"processes": procs, "images_per_s": rate, "epoch_s": 50_000 / rate}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every method runs")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per method; the first is not counted")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
    parser.add_argument("--only", default=None, help="run only the methods whose name contains this text")
    args = parser.parse_args()
    nprocs = torch.cuda.device_count() if args.device == "cuda" else 2
    print("| method | script | processes | images/s | s per 50,000-image epoch |\n|---|---|---|---|---|")
    for name, script, start, extra in METHODS:
        if args.only and args.only not in name:
            continue
        result = measure(script, start, extra, args, nprocs)
        print(f"| {name} | `{script}` | {result['processes']} | {result['images_per_s']:.1f} "
              f"| {result['epoch_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
