"""Parts of a script's train() run on their own: the statements that build its loaders, or its optimizer and schedule,
lifted from the script's source and executed with the values a test gives (no copy of them to keep in step: a change
to the script's line is what the tests run).

    loaders("distributed_mp.py", train_set, test_set, sampler, batch=4, rank=1, world_size=3)  # its DataLoaders
    optimizer_and_schedule("distributed_fsdp.py", model, args)  # its SGD and cosine (+ warm-up) schedule
"""
import ast
import functools
import importlib
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
LOADERS = ("loading", "train_loader", "test_loader")  # what the loaders' statements assign
# the scripts whose ranks each load a share of every batch and of the test set (dataparallel.py: one process, all)
SHARDING = ["distributed.py", "distributed_mp.py", "distributed_apex.py", "distributed_gradient_accumulation.py",
            "distributed_zero.py", "distributed_fsdp.py", "distributed_live_recovery.py", "distributed_diloco.py"]
OPTIMIZER = ("optimizer", "scheduler")


@functools.cache
def statements(script: str, names: tuple[str, ...]) -> tuple[str, object]:
    """The source of the statements of `script`'s train() that assign one of `names` (an `if` whose body assigns one
    is taken whole), in the script's order, compiled with the script's file name and line numbers (a failure points
    at the script's line)."""
    source = (ROOT / script).read_text()
    (train,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "train"]

    def assigned(node) -> set[str]:
        return {target.id for sub in ast.walk(node) if isinstance(sub, ast.Assign) for target in sub.targets
                if isinstance(target, ast.Name)}

    taken = [node for node in train.body if isinstance(node, (ast.Assign, ast.If)) and assigned(node) & set(names)]
    if not taken:
        raise LookupError(f"{script}'s train() assigns none of {names}")
    module = ast.Module(body=taken, type_ignores=[])
    return "\n".join(ast.unparse(node) for node in taken), compile(module, str(ROOT / script), "exec")


def run(script: str, names: tuple[str, ...], **values) -> dict:
    """Runs those statements among the script's own module globals (its imports) and `values`; returns the names
    they made."""
    namespace = {**vars(importlib.import_module(Path(script).stem)), **values}
    exec(statements(script, names)[1], namespace)
    return namespace


def loaders(script: str, train_set, test_set, sampler, batch: int, rank: int = 0, world_size: int = 1,
            workers: int = 0, device: torch.device = CPU, loader: str = "dataloader"):
    """(train batches, test batches) of one rank as `script` makes them: its DataLoaders over `sampler` (a
    data.ResumableDistributedSampler) and its shard of the test set (distributed_apex.py's --loader device: its
    DeviceLoaders)."""
    args = SimpleNamespace(workers=workers, loader=loader)
    env = SimpleNamespace(rank=rank, world_size=world_size, device=device)
    made = run(script, LOADERS, args=args, env=env, batch=batch, train_set=train_set, test_set=test_set,
               sampler=sampler)
    return made["train_loader"], made["test_loader"]


def optimizer_and_schedule(script: str, model, args, cuda_graphs: bool = False):
    """`script`'s optimizer over model's parameters and its learning-rate schedule, from `args` (--lr, --momentum,
    --weight-decay, --epochs, --warmup-epochs, --optimizer-impl; distributed_apex.py's --optimizer too)."""
    args = SimpleNamespace(**{"optimizer_impl": "auto", "optimizer": "torch", "cuda_graphs": cuda_graphs,
                              **vars(args)})
    made = run(script, OPTIMIZER, args=args, model=model)
    return made["optimizer"], made["scheduler"]


def train_loader(dataset, sampler, batch: int, workers: int = 0, device: torch.device = CPU,
                 loader: str = "dataloader", script: str = "distributed_apex.py"):
    """This rank's training batches in the order of `sampler`, as `script` makes them (distributed_apex.py: with
    loader="device", --loader device's)."""
    return loaders(script, dataset, dataset, sampler, batch, workers=workers, device=device, loader=loader)[0]


def evaluation_loader(dataset, batch: int, rank: int, world_size: int, workers: int = 0, device: torch.device = CPU,
                      loader: str = "dataloader", script: str = "distributed_apex.py"):
    """This rank's share of the test set, images rank, rank + W, ..., as `script` makes it."""
    from utils.data import ResumableDistributedSampler
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, drop_last=True)  # its training loader's
    return loaders(script, dataset, dataset, sampler, batch, rank, world_size, workers, device, loader)[1]
