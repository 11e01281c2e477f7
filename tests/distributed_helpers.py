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

    def step_done(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> bool:
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


# The model the scripts build, for runs that compare world sizes: in float32 two summation orders drift apart
# chaotically after a few steps (0.003 in conv1 after 4 steps between 1 and 2 threads), in float64 they agree to
# 1e-9; float64 convolutions are slow, so the images are averaged down to 8x8 first (the question is the same), as
# conv1's input (the first layer, whatever runs it: the model, or a pipeline's first stage).
def _float64_on_8x8(build):
    def model(*args, **kwargs):
        net = build(*args, **kwargs).double()
        net.conv1.register_forward_pre_hook(lambda _, inputs: (torch.nn.functional.avg_pool2d(inputs[0].double(), 4),))
        return net
    return model


def _groupnorm(build):  # no batch statistics: micro-batches then add up to the whole batch exactly
    def model(*args, **kwargs):
        net = build(*args, **kwargs)
        for module in list(net.modules()):
            for name, child in module.named_children():
                if isinstance(child, torch.nn.BatchNorm2d):
                    setattr(module, name, torch.nn.GroupNorm(8, child.num_features))
        return net
    return model


SEEN = set()  # the dtypes the first convolution computed in, training and evaluating: "train float16", ...


def _float32_on_8x8_seen(build):  # as the script's precision flags make it: autocast's dtype recorded in SEEN
    def model(*args, **kwargs):
        net = build(*args, **kwargs)
        net.conv1.register_forward_pre_hook(lambda _, inputs: (torch.nn.functional.avg_pool2d(inputs[0], 4),))
        net.conv1.register_forward_hook(lambda conv, _, out: SEEN.add(f"{'train' if conv.training else 'eval'} "
                                                                      f"{str(out.dtype).split('.')[1]}"))
        return net
    return model


MODELS = {"float64": [_float64_on_8x8], "float64-groupnorm": [_groupnorm, _float64_on_8x8],
          "float32-8x8": [_float32_on_8x8_seen]}


def _script_entry(index, world_size, ports, script, argv, model, results_dir):
    import runpy
    import sys

    from utils import models
    group, rank = divmod(index, world_size)  # replica group (live recovery's; one group for the other scripts), rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[group]))
    if len(ports) > 1:  # as torchft's examples start each group's torchrun
        os.environ.update(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(len(ports)))
    torch.set_num_threads(1)
    for change in MODELS[model]:
        models.resnet18_cifar = change(models.resnet18_cifar)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exited:
        status = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
    with open(os.path.join(results_dir, f"status-{index}"), "w") as f:
        f.write(str(status))
    with open(os.path.join(results_dir, f"seen-{index}"), "w") as f:
        f.write(" ".join(sorted(SEEN)))


def script_on_ranks(world_size: int, script: str, argv: list[str], results_dir, model: str = "float64",
                    replica_groups: int = 1) -> list[int]:
    """The script itself, as torchrun would start it on world_size ranks (RANK, WORLD_SIZE, MASTER_ADDR, ... set; the
    spawn scripts then start no processes of their own), each rank forked from a server that imported torch once;
    its model built as the script builds it, then changed as MODELS[model] says. replica_groups > 1: that many such
    torchruns at once, each a process group of its own (its own MASTER_PORT) with REPLICA_GROUP_ID and
    NUM_REPLICA_GROUPS set, as distributed_live_recovery.py's groups are started. Returns each rank's exit status,
    group by group."""
    from pathlib import Path
    os.makedirs(results_dir, exist_ok=True)
    path = str(Path(__file__).resolve().parent.parent / script)
    new_processes()
    ports = []
    while len(ports) < replica_groups:  # one port a group, none twice
        if (port := free_port()) not in ports:
            ports.append(port)
    mp.start_processes(_script_entry, args=(world_size, ports, path, argv, model, str(results_dir)),
                       nprocs=world_size * replica_groups, start_method="forkserver")
    return [int(Path(results_dir, f"status-{r}").read_text()) for r in range(world_size * replica_groups)]
