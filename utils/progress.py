"""One epoch's progress: the loss summed on the device, printed only every --print-freq steps.

Printing a loss needs .item(), which waits for the device; doing it every step (as older tutorials
do, often with a barrier) stalls the pipeline. Here the only per-step work is a tensor addition."""
import sys
import time

import torch
from tqdm import tqdm

from utils import dist


class EpochProgress:
    def __init__(self, batches, steps: int, env, args, epoch: int, start_step: int = 0):
        self.batches, self.env, self.print_freq = batches, env, args.print_freq
        self.total, self.step, self.epoch, self.epochs = steps, start_step, epoch, args.epochs
        self.global_batch = args.batch_size
        self.loss_sum = torch.zeros((), device=env.device)
        self.recorded = 0
        bar_wanted = env.is_main and sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=start_step, desc=f"epoch {epoch + 1}/{args.epochs}",
                        leave=False, dynamic_ncols=True) if bar_wanted else None

    def __iter__(self):
        self.start = time.perf_counter()
        yield from self.batches

    def record(self, loss: torch.Tensor) -> None:
        """Call once per optimizer step with that step's mean training loss."""
        self.loss_sum += loss.detach().float()
        self.recorded += 1
        self.step += 1
        if self.bar:
            self.bar.update(1)
        if self.step % self.print_freq == 0 and self.env.is_main:
            rate = self.recorded * self.global_batch / (time.perf_counter() - self.start)
            if self.bar:
                self.bar.set_postfix(loss=f"{loss.item():.4f}", img_s=f"{rate:.0f}")
            else:
                print(f"epoch {self.epoch + 1}/{self.epochs} step {self.step}/{self.total} "
                      f"loss {loss.item():.4f} {rate:.0f} img/s", flush=True)

    def summary(self) -> dict:
        """Mean training loss over all ranks and steps, time and throughput (one all-reduce)."""
        totals = dist.all_reduce_sum(torch.stack([self.loss_sum, torch.tensor(
            float(self.recorded), device=self.env.device)]).double())
        loss_sum, count = totals.tolist()  # waits for the device, so the time below is honest
        seconds = time.perf_counter() - self.start
        if self.bar:
            self.bar.close()
        return {"train_loss": loss_sum / max(count, 1), "epoch_time_s": seconds,
                "images_per_s": self.recorded * self.global_batch / seconds}
