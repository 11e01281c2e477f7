"""The run's record: <output-dir>/metrics.jsonl (one JSON object per epoch), TensorBoard's events with
--tensorboard, and eval.json after --evaluate, all written by rank 0."""
import json
import os
import sys

from safety_net.stop_errors import StorageError


class MetricsLog:
    """<output-dir>/metrics.jsonl, one JSON object per epoch, written by rank 0; with --tensorboard also
    TensorBoard events in <output-dir>/tensorboard: every per-epoch metric, and the training loss every
    --print-freq steps, against the optimizer step (epoch * steps_per_epoch + step)."""

    def __init__(self, output_dir: str, *, is_main: bool, done_epochs: int, done_steps: int = 0,
                 steps_per_epoch: int = 1, tensorboard: bool = False):
        self.path, self.is_main = os.path.join(output_dir, "metrics.jsonl"), is_main
        self.steps_per_epoch = steps_per_epoch
        self.events = None
        if is_main and tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: checked when the flags are parsed
            # purge_step hides the events at and past it: those a stopped or crashed run wrote after its checkpoint's
            # step, from the first step this run takes again (the checkpoint's own, and its epoch's metrics, stay)
            self.events = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                        purge_step=done_epochs * steps_per_epoch + done_steps + 1)
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
        norm = f"  grad_norm {record['grad_norm']:.4g}" if record.get("grad_norm") else ""  # --clip-grad-norm
        print(f"epoch {record['epoch']}: train_loss {record['train_loss']:.4f}{norm}"
              f"  test_loss {record['test_loss']:.4f}  top1 {record['top1']:.2f}%  top5 {record['top5']:.2f}%  {speed}"
              f"  lr {record['lr']:.4g}", flush=True)

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
