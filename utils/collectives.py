"""The two reductions over all ranks that metrics, progress and data checks need (no-ops in a world of one)."""
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
