"""An all-reduce left running (async_op=True) whose mean is used later, held as a part a checkpoint saves:
distributed_diloco.py's --overlap-round keeps its round's in one while the next round's steps are taken."""
import torch
import torch.distributed as dist


class InFlight:
    """At most one all-reduce (a sum) left running. A checkpoint's part: state_dict() (rank 0's, which writes the
    checkpoint) waits for it and keeps its mean, which a run at any world size continues from, bit for bit the mean
    that take() would have given."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group  # the group its all-reduces run on (None: the default group)
        self.work, self.value, self.ranks = None, None, 1

    def put(self, work: dist.Work, summed: torch.Tensor, ranks: int) -> None:
        """Hold this all-reduce: `summed` is the sum over `ranks` ranks once `work` is done."""
        self.work, self.value, self.ranks = work, summed, ranks

    def take(self) -> torch.Tensor | None:
        """The mean held, waited for, and held no longer; None when none is held."""
        mean, self.value = self._mean(), None
        return mean

    def _mean(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
            self.work, self.value, self.ranks = None, self.value / self.ranks, 1
        return self.value

    def state_dict(self) -> dict:
        return {} if self._mean() is None else {"mean": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.work, self.value, self.ranks = None, state.get("mean"), 1
