"""distributed_fsdp.py's test batches: a sharded model all-gathers its parameters in every forward, so every rank
must forward as many batches as the rank with the most (the unpadded shards differ by up to one batch)."""
import itertools

import torch
import torch.distributed as dist


class PaddedShard:
    """This rank's test batches (`loader`), then empty batches of the test set's image shape until it has forwarded
    as many as the rank with the most: give it to metrics.evaluate for a sharded model. Each pass over it starts
    with two collectives (the image shape, the most batches of any rank), so every rank iterates it together."""

    ranks_forward_together = True  # metrics.evaluate refuses a stop= that would let one rank leave early

    def __init__(self, loader, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        batches = iter(self.loader)
        first = next(batches, None)
        empty = _empty_batch(first, self.device)  # collective
        most = torch.tensor([len(self.loader)], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # every rank forwards as many batches as the rank with the most
        mine = itertools.chain([first] if first is not None else [], batches)
        for _ in range(int(most.item())):
            yield next(mine, empty)


def _empty_batch(first, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 0 images of the test set's image shape, which a rank with no images learns from the others."""
    shape = torch.tensor(first[0].shape[1:] if first is not None else [], dtype=torch.long)
    shape = torch.nn.functional.pad(shape, (0, 8 - len(shape))).to(device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    dims = [d for d in shape.tolist() if d]
    return torch.empty(0, *dims, device=device), torch.empty(0, dtype=torch.long, device=device)
