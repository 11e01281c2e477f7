"""A checkpoint: all a run needs to continue, written atomically by rank 0, read with weights_only=True.

A checkpoint holds the weights (without DDP's "module." prefix), optimizer, scheduler and, where there
is one, the GradScaler, with the epoch and step reached. It holds no RNG state because none is
needed: the data order and the augmentation are functions of (--seed, epoch, index) (utils/data.py).
"""
import os
import pickle
import time
import zipfile

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from utils.errors import Diverged, UsageError
from utils.models import ARCH

FILENAME = "checkpoint.pt"
# The flags that define a run: a checkpoint continues only a run with the same values.
RUN_FLAGS = ("seed", "batch_size", "epochs", "lr", "momentum", "weight_decay", "dataset", "train_samples",
             "no_augment", "no_sync_bn", "opt_level", "amp_dtype", "grad_accu_steps")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (DDP, DataParallel, dataparallel.py's AutocastInForward: each keeps it
    as .module), whose state_dict has no "module." prefix."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)) or getattr(model, "wraps_module", False):
        model = model.module
    return model


def save_atomic(state: dict, path: str) -> None:
    """Write to a temporary file, flush it to disk, then rename: a crash leaves the old file whole."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def load(path: str) -> dict:
    """A checkpoint as saved; anything unreadable is a UsageError and the file stays as it is."""
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path} is not a readable checkpoint ({reason[:160]}); it was left untouched") from None
    if not isinstance(state, dict) or state.get("arch") != ARCH or "model" not in state:
        raise UsageError(f"{path} is not a {ARCH} checkpoint of these scripts; it was left untouched")
    return state


def load_weights(model: nn.Module, state: dict, path: str) -> None:
    try:
        unwrap(model).load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise UsageError(f"{path} holds weights of another architecture ({first[:160]})") from None


def run_flags(args) -> dict:
    return {name: getattr(args, name) for name in RUN_FLAGS if hasattr(args, name)}


def check_same_run(state: dict, args, script: str, path: str) -> None:
    """A checkpoint continues only the run that wrote it: the same script with the same RUN_FLAGS."""
    if state.get("script") != os.path.basename(script):
        raise UsageError(f"{path} was written by {state.get('script')}, not {os.path.basename(script)}; "
                         "use another --output-dir (or --evaluate to test its weights)")
    for name, value in run_flags(args).items():
        saved = state.get("run", {}).get(name, value)
        if saved != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{path} is a run with {flag} {saved}, not {value}; resume with the same flags, "
                             "or start afresh with --restart")


def to_resume(args) -> str | None:
    """The checkpoint this run continues: --resume, else <output-dir>/checkpoint.pt unless --restart.
    A restart by torchrun (--max-restarts) always resumes: --restart was meant for the first start."""
    if args.resume:
        return args.resume
    path = os.path.join(args.output_dir, FILENAME)
    restarted_by_torchrun = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if os.path.exists(path) and (restarted_by_torchrun or not args.restart):
        return path
    return None


def check_before_start(args, script: str) -> None:
    """Fail before any process starts if the checkpoint that --evaluate or a resume would read is unusable."""
    if args.evaluate:
        load(os.path.join(args.output_dir, FILENAME))
    elif path := to_resume(args):
        check_same_run(load(path), args, script, path)


class Checkpoint:
    """The checkpoint of one run in <output-dir>/checkpoint.pt: save on rank 0, load on every rank."""

    def __init__(self, args, env, script: str, **parts):
        self.args, self.env, self.script, self.parts = args, env, os.path.basename(script), parts
        self.path = os.path.join(args.output_dir, FILENAME)
        self.epoch_loss = (0.0, 0.0)  # (sum, count) over all ranks of the losses of the epoch so far

    def due(self, step: int, steps: int) -> bool:
        """A mid-epoch checkpoint is due after `step` of `steps` (--save-every-steps; the epoch's end saves anyway)."""
        every = getattr(self.args, "save_every_steps", 0)
        return bool(every) and step % every == 0 and step < steps

    def load_weights(self) -> None:
        """For --evaluate: only the model's weights, from a checkpoint of any of the scripts."""
        load_weights(self.parts["model"], load(self.path), self.path)

    def resume(self) -> tuple[int, int]:
        """Restore every part from the checkpoint to continue, if any; return the (epoch, step) to start at."""
        path = to_resume(self.args)
        if path is None:
            self._keep_old_checkpoint()
            return 0, 0
        state = load(path)
        check_same_run(state, self.args, self.script, path)
        load_weights(self.parts["model"], state, path)
        for name, part in self.parts.items():
            if name != "model" and part is not None:
                part.load_state_dict(state[name])
        self.epoch_loss = tuple(state.get("epoch_loss", (0.0, 0.0)))
        if self.env.is_main:
            print(f"resuming from {path}: epoch {state['epoch'] + 1}, step {state['step']} "
                  f"(checkpoint of {state['world_size']} process(es), global batch {state['batch_size']})", flush=True)
        return state["epoch"], state["step"]

    def _keep_old_checkpoint(self) -> None:
        """--restart: the old checkpoint is renamed, never silently overwritten."""
        if self.env.is_main and os.path.exists(self.path):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            others = (os.path.join(self.args.output_dir, name) for name in ("metrics.jsonl", "tensorboard"))
            for path in (self.path, *others):
                if os.path.exists(path):
                    os.replace(path, f"{path}.{stamp}")
            print(f"--restart: starting afresh; the previous checkpoint and metrics are kept as *.{stamp}", flush=True)

    def save(self, epoch: int, step: int = 0, epoch_loss: tuple[float, float] = (0.0, 0.0)) -> None:
        """`epoch` epochs and `step` steps of the next one are done. Every rank calls it: weights that are
        not finite raise Diverged on every rank (they are the same on all) and overwrite nothing; then
        rank 0 writes and the others return."""
        weights = unwrap(self.parts["model"]).state_dict()
        floats = [t for t in weights.values() if t.is_floating_point()]
        if not torch.stack([torch.isfinite(t).all() for t in floats]).all().item():  # one device sync
            raise Diverged(f"the weights are not finite at epoch {epoch + 1 if step else epoch}, step {step}: the run "
                           f"diverged; try a lower --lr than {self.args.lr:g}. {self.path} was not overwritten")
        if not self.env.is_main:
            return
        state = {name: (weights if name == "model" else part.state_dict())
                 for name, part in self.parts.items() if part is not None}
        state.update(arch=ARCH, script=self.script, seed=self.args.seed, epoch=epoch, step=step,
                     epoch_loss=list(epoch_loss), run=run_flags(self.args),
                     world_size=self.env.world_size, batch_size=self.args.batch_size)
        os.makedirs(self.args.output_dir, exist_ok=True)
        save_atomic(state, self.path)
