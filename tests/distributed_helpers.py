"""Run a function on N ranks (gloo by default) in new processes and collect what each returns."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils.spawn import free_port


class LossesKept:
    """The scripts' SafetyNet as train_one_epoch sees it, for tests that call it directly: each step's loss
    is kept, and no stop ever comes."""

    def __init__(self):
        self.losses = []

    def step_done(self, loss: torch.Tensor) -> bool:
        self.losses.append(float(loss.detach()))
        return False


def new_processes():
    """The context for a test's own processes: forkserver. Each is forked from one server process that imported
    torch once per pytest worker and has run no test code; spawn would import torch again in each (3 s)."""
    mp.set_forkserver_preload(["torch", "torch.distributed", "torchvision", "distributed_helpers"])
    return mp.get_context("forkserver")


def _entry(rank, world_size, port, fn, args, results_dir, backend):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(results_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def on_ranks(world_size, fn, *args, results_dir, backend="gloo"):
    """fn(rank, world_size, *args) on each rank of a fresh process group; returns the list of results."""
    os.makedirs(results_dir, exist_ok=True)
    new_processes()
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, str(results_dir), backend), nprocs=world_size,
                       start_method="forkserver")
    return [_load_and_delete(os.path.join(results_dir, f"{r}.pt")) for r in range(world_size)]


def _load_and_delete(path):
    """A rank's result, its file deleted once read (float64 weights: up to 270 MB a rank)."""
    result = torch.load(path, weights_only=False)
    os.remove(path)
    return result
