"""The two reductions over all ranks that metrics, progress and data checks need (no-ops in a world of one), and the
process groups of the collection's own (the stop agreement's, CpuSyncBatchNorm's), which wait as long as the scripts'
process group does."""
import datetime

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks in place (a no-op in a world of one), and return it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_ok(ok: bool, device: torch.device) -> bool:
    """True on every rank iff it is true on every rank: one collective, so no rank is left waiting."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    return all_reduce_sum(flag).item() == 0


def new_group_like_world(backend: str | None = None) -> dist.ProcessGroup:
    """dist.new_group() over all ranks that waits as long as the default group (init_process_group's timeout=, the
    scripts' --dist-timeout): torch gives a new group its own default instead, 30 minutes, and a collective on it
    that a lost machine never answers would hold its rank that long (gloo's sockets wait the group's timeout)."""
    return dist.new_group(backend=backend, timeout=world_timeout())


def world_timeout() -> datetime.timedelta:
    """The default process group's timeout. torch 2.14-2.15 have no public getter: it is read from the group's
    backend, and where a torch lacks it torch's default for new groups is kept (tests/test_link_faults.py fails)."""
    world = dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(world) == "nccl" else "cpu")
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout
