"""Plumbing shared by the failure programs, and no lesson: the --fixed flag, and 2 ranks on the CPU over gloo.

A program calls launch(main, parse(__doc__)), and main(rank, world_size, args) runs in 2 processes that have
joined one process group on a free port. A collective that waits fails after TIMEOUT instead of torch's 30
minutes. A rank still busy after HANG_REPORT seconds prints the line of the program where it is, the torch
function it waits in, and the last collectives it called (from torch's flight recorder). A rank that fails
prints its traceback; the others are then stopped, and the program exits with status 1.
"""
import argparse
import json
import os
import socket
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
TIMEOUT = timedelta(seconds=5)  # torch's default: 30 minutes (gloo), 10 (NCCL); here a hang ends in 5 s
HANG_REPORT = 3  # seconds: every program's ranks finish their work in well under 1 s


def parse(doc: str, fixes: tuple[str, ...] = ("fix",)) -> argparse.Namespace:
    """--fixed runs the fixed form; where there are several fixes, --fixed NAME picks one (the first by default)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixed", nargs="?", const=fixes[0], choices=fixes, help="run the fixed form")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the operating system picks a free one
        return s.getsockname()[1]


def _report_where(rank: int, program: str) -> None:
    stack = traceback.extract_stack(sys._current_frames()[threading.main_thread().ident])
    line = ([frame for frame in stack if frame.filename == program] or stack)[-1]
    print(f"rank {rank} still waiting after {HANG_REPORT} s, at {os.path.basename(line.filename)} line {line.lineno}"
          f" ({line.line}), in {stack[-1].name}()", file=sys.stderr, flush=True)
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)  # torch's flight recorder (private API)
    entries = json.loads(dump()).get("entries", [])[-3:] if dump else []  # torch 2.15 records gloo's too
    if entries:
        called = ", ".join(f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']}" for e in entries)
        print(f"rank {rank} called last: {called}", file=sys.stderr, flush=True)

def _rank(rank, main, args, port):
    for stream in (sys.stdout, sys.stderr):  # a line in one write (PYTHONUNBUFFERED=1 makes two): lines stay whole
        stream.reconfigure(line_buffering=True, write_through=False)
    report = threading.Timer(HANG_REPORT, _report_where, (rank, main.__code__.co_filename))
    report.daemon = True
    report.start()
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
        dist.barrier()  # every rank has connected to every other: one that left sooner would fail another's start
        main(rank, WORLD_SIZE, args)
        dist.destroy_process_group()
    except Exception:
        print(f"rank {rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        report.cancel()


def launch(main, args: argparse.Namespace, port: int | None = None) -> None:
    if "DistributedDataParallel" in main.__globals__:  # building DDP imports torch._dynamo (2.5 s): once, here
        import torch._dynamo  # noqa: F401
    # fork starts a rank in 0.02 s with the torch its parent imported, where spawn imports torch again in each
    # (2.4 s on 2 cores). Safe here: the parent has run no torch operation (no thread pool) when it forks.
    # Elsewhere (macOS, Windows) spawn, the only safe method there.
    method = "fork" if sys.platform == "linux" else "spawn"
    try:
        mp.start_processes(_rank, args=(main, args, port or free_port()), nprocs=WORLD_SIZE, start_method=method)
    except mp.ProcessExitedException as error:  # the rank printed its error; the launcher stopped the others
        sys.exit(f"launcher: {error}, so the other ranks were stopped")
