"""Exact evaluation over all ranks, and the per-epoch metrics file."""
import contextlib
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

from utils import collectives
from utils.errors import StorageError


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, autocast_dtype=None, stop=None,
             sharded: bool = False) -> dict:
    """Top-1/top-5 accuracy and mean loss over exactly the test set, whatever the world size (collective:
    one all-reduce of the counts; sharded, also an all-gather in every forward).

    stop: a function of no arguments asked before each batch, on this rank only (SafetyNet.stop_received):
    once it says yes this rank stops evaluating, and the results are partial; the caller then agrees with
    the other ranks whether to stop (SafetyNet.all_ranks_agree_to_stop). Not with sharded=True, where a
    rank that left early would leave the others waiting in their all-gathers.

    Pass the unwrapped module under DDP: each rank's shard may be one sample shorter than another's,
    and DDP's forward would wait on the others at a step they never take. Each rank counts hits and
    the loss sum on its shard; one all-reduce of the counts gives the exact totals (averaging per-batch
    accuracies across ranks would weight batches, not samples).

    sharded=True: a sharded model (FSDP) all-gathers its parameters in every forward, so every rank takes
    part in as many forwards as the rank with the most batches; a rank whose shard is shorter forwards
    an empty batch."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    amp = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext())
    batches = iter(loader)
    empty = None
    if sharded:
        first = next(batches, None)
        empty = _empty_batch(first, device)
        batches = itertools.chain([first] if first is not None else [], batches)
    if stop is not None and sharded:
        raise ValueError("evaluate: a sharded model's ranks must forward together; stop cannot end one early")
    for _ in range(_most_batches_of_any_rank(loader, device) if sharded else len(loader)):
        if stop is not None and stop():  # a stop signal: this rank leaves, the caller agrees with the others
            break
        images, targets = next(batches, (None, None))
        if images is None:  # this rank's shard is shorter: it still takes part in the all-gathers
            images, targets = empty
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with amp:
            logits = model(images)
        logits = logits.float()
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == targets[:, None]  # top-5 of 5+ classes
        totals += torch.stack([F.cross_entropy(logits, targets, reduction="sum").double(),
                               hits[:, 0].sum().double(), hits.any(dim=1).sum().double(),
                               torch.tensor(len(targets), dtype=torch.float64, device=device)])
    loss_sum, top1, top5, count = collectives.all_reduce_sum(totals).tolist()
    count = max(count, 1)
    return {"test_loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count,
            "samples": int(count)}


def _empty_batch(first, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 0 images of the test set's image shape, which a rank with no images learns from the others."""
    shape = torch.tensor(first[0].shape[1:] if first is not None else [], dtype=torch.long)
    shape = collectives.all_reduce_max(torch.nn.functional.pad(shape, (0, 8 - len(shape))).to(device))
    dims = [d for d in shape.tolist() if d]
    return torch.empty(0, *dims, device=device), torch.empty(0, dtype=torch.long, device=device)


def _most_batches_of_any_rank(loader, device: torch.device) -> int:
    """Shards differ by one sample, so their batch counts by up to one; a sharded model forwards as many on each."""
    return int(collectives.all_reduce_max(torch.tensor([len(loader)], device=device)).item())


class MetricsLog:
    """<output-dir>/metrics.jsonl, one JSON object per epoch, written by rank 0; with --tensorboard also
    TensorBoard events in <output-dir>/tensorboard: every per-epoch metric, and the training loss every
    --print-freq steps, against the optimizer step (epoch * steps_per_epoch + step)."""

    def __init__(self, args, *, is_main: bool, done_epochs: int, done_steps: int = 0, steps_per_epoch: int = 1):
        output_dir = args.output_dir
        self.path, self.is_main = os.path.join(output_dir, "metrics.jsonl"), is_main
        self.steps_per_epoch = steps_per_epoch
        self.events = None
        if is_main and getattr(args, "tensorboard", False):
            from torch.utils.tensorboard import SummaryWriter  # optional: checked when the flags are parsed
            # purge_step hides the events a stopped or crashed run wrote after the step it continues from
            self.events = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                        purge_step=done_epochs * steps_per_epoch + done_steps)
        if is_main:  # keep the epochs the checkpoint has; drop any written after it (a crash in between)
            os.makedirs(output_dir, exist_ok=True)
            kept = []
            if done_epochs and os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["epoch"] <= done_epochs]
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:  # then renamed: a stop signal here loses no line
                    f.writelines(kept)
                os.replace(tmp, self.path)
            except OSError as error:
                if os.path.exists(tmp):
                    os.remove(tmp)
                self._not_written(error)

    def train_loss(self, epoch: int, step: int, loss: float) -> None:
        """The training loss at `step` of `epoch`, for TensorBoard (rank 0, every --print-freq steps)."""
        if self.events:
            self.events.add_scalar("train/loss", loss, epoch * self.steps_per_epoch + step)
            self.events.flush()  # a spawned process exits without atexit handlers: nothing waits in a buffer

    def write(self, record: dict) -> None:
        if not self.is_main:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as error:
            self._not_written(error)
        if self.events:
            for name, value in record.items():
                if name != "epoch" and isinstance(value, (int, float)):
                    self.events.add_scalar(f"epoch/{name}", value, record["epoch"] * self.steps_per_epoch)
            self.events.flush()
        speed = (f"{record['epoch_time_s']:.1f}s  {record['images_per_s']:.0f} img/s" if record["images_per_s"]
                 else "resumed at its last step")  # None: a checkpoint of the epoch's last step, nothing to time
        print(f"epoch {record['epoch']}: train_loss {record['train_loss']:.4f}  test_loss {record['test_loss']:.4f}"
              f"  top1 {record['top1']:.2f}%  top5 {record['top5']:.2f}%  {speed}  lr {record['lr']:.4g}", flush=True)


    def _not_written(self, error: OSError) -> None:
        """metrics.jsonl is a record, not the run's state: the run goes on (a full disk stops it at the next
        checkpoint, with its own line), and says what was lost."""
        print(f"warning: could not write {self.path} ({error.strerror or error}); this epoch's line is missing "
              "from it, and training goes on", file=sys.stderr, flush=True)


def write_eval(output_dir: str, results: dict, is_main: bool) -> None:
    """<output-dir>/eval.json after --evaluate."""
    if not is_main:
        return
    path = os.path.join(output_dir, "eval.json")
    try:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    except OSError as error:
        raise StorageError(f"could not write {path} ({error.strerror or error}); the results were: "
                           f"top1 {results['top1']:.2f}% top5 {results['top5']:.2f}% "
                           f"test_loss {results['test_loss']:.4f} over {results['samples']} images") from None
    print(f"evaluated {results['samples']} test images: top1 {results['top1']:.2f}%  top5 {results['top5']:.2f}%"
          f"  test_loss {results['test_loss']:.4f}", flush=True)
