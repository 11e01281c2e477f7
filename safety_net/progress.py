"""One epoch's progress: the loss summed on the device, printed only every --print-freq steps.

Printing a loss needs .item(), which waits for the device; doing it every step (as older tutorials
do, often with a barrier) stalls the pipeline. Here the only per-step work is a tensor addition."""
import math
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

from safety_net.stop_errors import Diverged
from utils import collectives


class EpochProgress:
    """One epoch's progress from `start_step` on, its clock started when made; on a mid-epoch resume it
    carries on the epoch's loss from the checkpoint (`epoch_loss`: the (sum, count) saved with it)."""

    def __init__(self, *, steps: int, epoch: int, epochs: int, env, global_batch: int, print_freq: int, lr: float,
                 start_step: int = 0, epoch_loss: tuple[float, float] = (0.0, 0.0), log=None, note=None):
        self.env, self.print_freq, self.lr = env, print_freq, lr  # lr: named when the run diverges
        self.total, self.step, self.epoch, self.epochs = steps, start_step, epoch, epochs
        self.global_batch, self.log = global_batch, log  # log: metrics.MetricsLog, for TensorBoard
        self.note = note  # note(): words at the end of each progress line
        loss_sum, count = epoch_loss if start_step else (0.0, 0.0)
        # each rank carries 1/W of the saved totals, so the epoch's all-reduce adds them once
        self.loss_sum = torch.tensor(loss_sum / env.world_size, device=env.device)
        self.loss_count = count / env.world_size
        self.recorded = 0  # steps taken by this process, for its throughput
        # --clip-grad-norm: the gradients' norm before clipping, summed on the device (the same on every rank)
        self.norm_sum, self.norm_count, self.norm = (torch.zeros((), device=env.device),
                                                     torch.zeros((), device=env.device), None)
        # a bar on a terminal; on one of no width (`script` run without a terminal makes one) tqdm draws nothing
        bar_wanted = env.is_main and sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
        self.bar = tqdm(total=steps, initial=start_step, desc=f"epoch {epoch + 1}/{epochs}",
                        leave=False, dynamic_ncols=True) if bar_wanted else None
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        self.start = time.perf_counter()
        self.end = None  # when the epoch's last step was done

    def record(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None = None) -> None:
        """Call once per optimizer step, on every rank, with that step's mean training loss (None on a rank that has
        none: a pipeline's stages but the last) and, with --clip-grad-norm, the gradients' norm before clipping.
        Every --print-freq steps, and at this process's first step of each epoch: one all-reduce of the loss,
        printed by rank 0 (with the norm); a non-finite loss raises Diverged."""
        if grad_norm is not None:
            # under FSDP a DTensor, replicated: clip_grad_norm_ reduced it over the shards
            self.norm = getattr(grad_norm, "full_tensor", grad_norm.detach)().detach().float()
            finite = torch.isfinite(self.norm)  # not a float16 step the scaler skips (its gradients overflowed)
            self.norm_sum += torch.where(finite, self.norm, 0.0)
            self.norm_count += finite
        held = loss is not None
        if held:
            loss = loss.detach().float()
            self.loss_sum += loss
            self.loss_count += 1
        self.recorded += 1
        self.step += 1
        if self.bar:
            self.bar.update(1)
        if self.step == self.total:  # the clock stops when the last step's work is done (evaluation comes next)
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
            self.end = time.perf_counter()
        if self.step % self.print_freq and self.recorded > 1:  # and each epoch's first step: a line within seconds
            return
        mine = loss if held else torch.zeros((), device=self.env.device)  # made only at the steps that print
        losses = torch.stack([mine, torch.tensor(float(held), device=mine.device), self.loss_sum])
        step_sum, holders, epoch_sum = collectives.all_reduce_sum(losses).tolist()
        step_loss = step_sum / holders  # the mean over the ranks that hold a loss
        self.check_finite(epoch_sum)
        if self.env.is_main:
            if self.log:
                self.log.train_loss(self.epoch, self.step, step_loss)
            rate = self.recorded * self.global_batch / (time.perf_counter() - self.start)
            note = f", {self.note()}" if self.note else ""
            norm = [("grad_norm", f"{float(self.norm):.4g}")] if self.norm is not None else []  # --clip-grad-norm
            if self.bar:
                shown = [("loss", f"{step_loss:.4f}"), *norm, ("img_s", f"{rate:.0f}")]
                self.bar.set_postfix_str(", ".join(f"{k}={v}" for k, v in shown) + note)
            else:
                print(f"epoch {self.epoch + 1}/{self.epochs} step {self.step}/{self.total} loss {step_loss:.4f}"
                      + "".join(f" {k} {v}" for k, v in norm) + f" {rate:.0f} img/s{note}", flush=True)

    def check_finite(self, loss: float) -> None:
        """Divergence ends the run: NaN or infinite weights would only be saved over a good checkpoint."""
        if not math.isfinite(loss):
            raise Diverged(f"the training loss is {loss} by epoch {self.epoch + 1}, step {self.step} (checked "
                           f"every --print-freq {self.print_freq} steps and before each checkpoint): the run "
                           f"diverged; try a lower --lr than {self.lr:g}; the last checkpoint, if any, is kept")

    def loss_so_far(self) -> tuple[float, float]:
        """(sum, count) of the epoch's losses over all ranks: an all-reduce every rank joins; a
        non-finite sum raises Diverged on every rank."""
        totals = collectives.all_reduce_sum(torch.stack([self.loss_sum.double(), torch.tensor(
            float(self.loss_count), dtype=torch.float64, device=self.env.device)]))
        loss_sum, count = totals.tolist()
        self.check_finite(loss_sum)
        return loss_sum, count

    def summary(self) -> dict:
        """Mean training loss over all ranks and steps, time and throughput (one all-reduce), and this
        rank's peak memory."""
        loss_sum, count = self.loss_so_far()
        seconds = (self.end or time.perf_counter()) - self.start
        if self.bar:
            self.bar.close()
        # --clip-grad-norm: the mean norm before clipping over the epoch's steps (those the scaler skipped left out)
        steps = float(self.norm_count)
        norm = {"grad_norm": float(self.norm_sum) / steps if steps else None} if self.norm is not None else {}
        return {"train_loss": loss_sum / max(count, 1), **norm, "epoch_time_s": seconds,
                "images_per_s": self.recorded * self.global_batch / seconds if self.recorded else None,
                "peak_memory_mb": peak_memory_mb(self.env.device)}


def peak_memory_mb(device: torch.device) -> float:
    """On a GPU, the most memory tensors held during the epoch; on the CPU, the process's peak
    resident memory so far (the model, optimizer, data and torch itself)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
