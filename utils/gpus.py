"""The GPUs of one process: which ones nn.DataParallel drives (its --gpu flag)."""
import sys

import torch

from utils import launch
from utils.errors import UsageError


def gpus_for_dataparallel(gpu_flag: str | None, device_flag: str, compile: bool) -> list[int]:
    """The GPU indices named by --gpu (all visible ones by default); [] to run on the CPU. A UsageError for
    GPUs named on the CPU, an index that is not visible or repeated, and --compile on several GPUs."""
    visible = torch.cuda.device_count()
    if launch.resolve_device(device_flag) == "cpu":
        if gpu_flag:
            why = "--device cpu was asked for" if visible else "no GPU is visible (check CUDA_VISIBLE_DEVICES)"
            raise UsageError(f"--gpu {gpu_flag} names GPUs, but {why}; drop --gpu to train on the CPU")
        print("no GPU in use: DataParallel trains on the CPU as a single replica", file=sys.stderr)
        return []
    if gpu_flag is None:
        gpus = list(range(visible))
    else:
        gpus = parse_gpus(gpu_flag, visible)
    if compile and len(gpus) > 1:  # a compiled module runs its own weights, not a replica's
        raise UsageError(f"--compile with DataParallel on {len(gpus)} GPUs: torch.compile does not follow "
                         "DataParallel's replicas; use DDP (distributed.py) or one GPU")
    return gpus


def parse_gpus(text: str, visible: int) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu {text}: expected GPU indices like 0,1,2,3") from None
    missing = [g for g in gpus if not 0 <= g < visible]
    if missing or len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpu {text}: GPU {missing[0] if missing else 'index repeated'} is not usable; "
                         f"visible GPUs are 0..{visible - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return gpus
