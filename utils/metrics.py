"""Exact evaluation over all ranks: top-1, top-5 and the loss over exactly the test set."""
import contextlib

import torch
import torch.nn.functional as F

from utils import collectives


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, autocast_dtype=None, stop=None) -> dict:
    """Top-1/top-5 accuracy and mean loss over exactly the test set, whatever the world size (collective:
    one all-reduce of the counts).

    stop: a function of no arguments asked before each batch, on this rank only (SafetyNet.stop_received_here):
    once it says yes this rank stops evaluating, and the results are partial; the caller then agrees with
    the other ranks whether to stop (SafetyNet.end_epoch). Not with a loader whose ranks must
    forward together (a sharded model's: utils/sharding.py), where a rank that left early would leave
    the others waiting in their all-gathers.

    Pass the unwrapped module under DDP: each rank's shard may be one sample shorter than another's,
    and DDP's forward would wait on the others at a step they never take. Each rank counts hits and
    the loss sum on its shard; one all-reduce of the counts gives the exact totals (averaging per-batch
    accuracies across ranks would weight batches, not samples)."""
    if stop is not None and getattr(loader, "ranks_forward_together", False):
        raise ValueError("evaluate: a sharded model's ranks must forward together; stop cannot end one early")
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    amp = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext())
    for images, targets in loader:
        if stop is not None and stop():  # a stop signal: this rank leaves, the caller agrees with the others
            break
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with amp:
            logits = model(images)
        totals += counts(logits, targets)
    return results(totals)


def counts(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[loss sum, top-1 hits, top-5 hits, images] of one batch, in float64 on the logits' device."""
    logits = logits.float()
    hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == targets[:, None]  # top-5 of 5+ classes
    return torch.stack([F.cross_entropy(logits, targets, reduction="sum").double(), hits[:, 0].sum().double(),
                        hits.any(dim=1).sum().double(),
                        torch.tensor(len(targets), dtype=torch.float64, device=logits.device)])


def results(totals: torch.Tensor) -> dict:
    """Every rank (collective: one all-reduce): the test loss, top-1 and top-5 accuracy over all ranks' counts."""
    loss_sum, top1, top5, count = collectives.all_reduce_sum(totals).tolist()
    count = max(count, 1)
    return {"test_loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count,
            "samples": int(count)}
