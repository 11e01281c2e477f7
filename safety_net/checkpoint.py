"""A run's checkpoints in <output-dir>: written atomically by rank 0, the newest --keep of them kept, read
with weights_only=True; and the lock that lets one run at a time use an output directory.

A checkpoint holds the weights (torch's get_model_state_dict: without DDP's "module." prefix), optimizer
(distributed_zero.py's ZeroRedundancyOptimizer: its shards gathered on rank 0 first, by the script's before_save, so
any world size can resume it), scheduler and, where there is one, the GradScaler, with the epoch and step reached,
the flags that define the run, and what the run resolved them to (the precision it trained in, the optimizer's
implementation). It holds no RNG state because none is needed: the data order and the augmentation are functions
of (--seed, epoch, index) (utils/data.py). checkpoint.pt is the newest; checkpoint.1.pt the one before, and so on.

distributed_fsdp.py writes sharded checkpoints instead: directories checkpoint.dcp, checkpoint.1.dcp, ...
(safety_net/sharded_checkpoint.py: its write and reads). Finding, locking, checking, keeping, saving and
restoring them is the same, and lives here.
"""
import contextlib
import fcntl
import io
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from safety_net.stop_errors import Diverged, StorageError
from utils import collectives
from utils.errors import UsageError, first_line
from utils.models import ARCH

FILENAME = "checkpoint.pt"
SHARDED = "checkpoint.dcp"  # a directory: one file per rank, written with torch.distributed.checkpoint
HEADER = "run.pt"  # in a sharded checkpoint: everything but the model and optimizer, written by rank 0
LOCKNAME = "run.lock"
# The flags that define a run: a checkpoint continues only a run with the same values. The precision is
# compared as the run resolved it (precision.autocast_dtype), the other flags may change (docs/fault_tolerance.md).
RUN_FLAGS = ("seed", "batch_size", "epochs", "lr", "warmup_epochs", "momentum", "weight_decay", "dataset",
             "train_samples", "no_augment", "no_sync_bn", "grad_accu_steps", "microbatches", "clip_grad_norm",
             "init_from", "sync_every", "outer_lr", "outer_momentum", "overlap_round")
# optimizer settings that pick an implementation of the same update: the flag given now is the one in force
IMPLEMENTATION_KEYS = ("foreach", "fused")


class Unreadable(UsageError):
    """A file that is not a whole checkpoint: truncated, corrupt, empty."""


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DataParallel and dataparallel.py's AutocastInForward (each keeps it as .module): torch's
    get_model_state_dict looks through DDP, FSDP and torch.compile's wrapper, not through these."""
    while isinstance(model, nn.DataParallel) or getattr(model, "wraps_module", False):
        model = model.module
    return model


def model_state(model: nn.Module) -> dict:
    """The weights keyed as the bare model's (no "module.", no "_orig_mod."); under FSDP this rank's shards."""
    return get_model_state_dict(unwrap(model))


@dataclass(frozen=True)
class Options:
    """What the checkpoints of one run are told, as plain values: where they go, what defines the run, and
    what this start asks for (resume, restart, a new run from other weights, only an evaluation)."""
    output_dir: str
    seed: int
    batch_size: int  # the global batch
    epochs: int
    lr: float  # named when a run diverges
    run: dict = field(default_factory=dict)  # the values that define the run (RUN_FLAGS); others are refused
    keep: int = 2  # checkpoints kept: the newest and the ones before it
    save_every_steps: int = 0  # also within an epoch, every N steps (0: at its end only)
    resume: str | None = None  # this checkpoint, not <output-dir>'s newest
    restart: bool = False  # start afresh, the old checkpoints renamed
    init_from: str | None = None  # a new run from these weights
    evaluate: bool = False  # only the newest checkpoint's weights are read
    sharded: bool = False  # directories of shards (torch.distributed.checkpoint), FSDP's

    @classmethod
    def from_flags(cls, args, sharded: bool = False) -> "Options":
        """From the flags of SafetyNet.add_flags and utils.flags (the run's values among them)."""
        return cls(output_dir=args.output_dir, seed=args.seed, batch_size=args.batch_size, epochs=args.epochs,
                   lr=args.lr, run=run_flags(args), keep=args.keep, save_every_steps=args.save_every_steps,
                   resume=args.resume, restart=args.restart, init_from=args.init_from, evaluate=args.evaluate,
                   sharded=sharded)


def kept_path(output_dir: str, k: int, sharded: bool = False) -> str:
    """The k-th newest checkpoint: checkpoint.pt, checkpoint.1.pt, checkpoint.2.pt, ... (sharded:
    checkpoint.dcp, checkpoint.1.dcp, ...)."""
    suffix = "dcp" if sharded else "pt"
    return os.path.join(output_dir, f"checkpoint.{suffix}" if k == 0 else f"checkpoint.{k}.{suffix}")


def kept_paths(output_dir: str, sharded: bool = False) -> list[str]:
    """The checkpoints in output_dir, newest first."""
    found = [0] if os.path.exists(kept_path(output_dir, 0, sharded)) else []
    if os.path.isdir(output_dir):
        pattern = re.compile(r"checkpoint\.(\d+)\.dcp" if sharded else r"checkpoint\.(\d+)\.pt")
        found += sorted(int(m[1]) for m in map(pattern.fullmatch, os.listdir(output_dir)) if m)
    return [kept_path(output_dir, k, sharded) for k in found]


def nbytes(obj) -> int:
    """The bytes of the tensors in a (nested) state dict; of a sharded tensor (DTensor), this rank's shard."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def fsync(path: str) -> None:
    """Flush a file, or a directory's entries (renames, new files), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate_in(tmp: str, newest: str, keep: int, sharded: bool = False) -> None:
    """The whole checkpoint `tmp` becomes `newest`, the kept ones moving down one (checkpoint.pt ->
    checkpoint.1.pt ...) and those past `keep` removed: at every moment the newest or the one before is
    whole. A sharded checkpoint is a directory, which no rename may overwrite: the one in the way is
    removed first, and checkpoint.dcp moves down even with keep=1 (then removed once tmp took its place)."""
    directory = os.path.dirname(os.path.abspath(newest))
    remove = shutil.rmtree if sharded else os.remove
    for k in range(max(keep, 2 if sharded else 1) - 1, 0, -1):  # the oldest kept first
        if os.path.exists(older := kept_path(directory, k - 1, sharded)):
            if sharded and os.path.exists(kept_path(directory, k, sharded)):
                remove(kept_path(directory, k, sharded))
            os.replace(older, kept_path(directory, k, sharded))
    os.replace(tmp, newest)
    for extra in kept_paths(directory, sharded)[keep:]:  # keep=1 with a directory, or --keep lowered since
        remove(extra)
    fsync(directory)  # make the renames themselves durable


def storage_error(path: str, reason: str, needed: str, sharded: bool = False) -> StorageError:
    """The one line for a checkpoint that could not be written: why, the room it needed (`needed`, said as
    a clause) and the room free, and which earlier checkpoint is left intact."""
    directory = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
    newest = kept_paths(directory, sharded)
    intact = f"the previous checkpoint, {newest[0]}, is intact" if newest else "no earlier checkpoint exists"
    return StorageError(f"could not write {path} ({reason}; {needed}, {free / 2**20:.0f} MB are free there); {intact}")


def temporary_path(path: str) -> str:
    """Where this process writes `path` before renaming it (save_atomic); a stop that leaves at once removes it."""
    return f"{path}.{os.getpid()}.tmp"


def save_atomic(state: dict, path: str, keep: int | None = None) -> None:
    """Write to a temporary file of this process, flush it to disk, then rename it to `path`; with `keep`,
    `path` is a run's checkpoint.pt and the older ones move down (rotate_in). A crash leaves every earlier
    file whole. A failed write (full disk, I/O error, read-only file system) removes the temporary file and
    raises StorageError, saying how much room was needed."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temporary_path(path)
    try:
        data = io.BytesIO()
        torch.save(state, data)  # in memory first: torch.save would hide a failed write's OSError (no space left)
        with open(tmp, "wb") as f:
            f.write(data.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        if keep is None:  # a file of its own (python -m safety_net.sharded_checkpoint): no other file is touched
            os.replace(tmp, path)
            fsync(directory)
        else:
            rotate_in(tmp, path, keep)
    except OSError as error:
        needed = f"a checkpoint needs about {nbytes(state) / 2**20:.0f} MB"
        raise storage_error(path, error.strerror or str(error), needed) from None
    finally:  # a failure or an interruption at any point: no temporary file left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _read(path: str):
    """torch.load on the CPU with weights_only=True; what went wrong as an Unreadable of one short line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise Unreadable(first_line(e)) from None


def load(path: str) -> dict:
    """A checkpoint as saved; anything unreadable is a UsageError and the file stays as it is. Of a
    sharded checkpoint (a directory), only its header: the shards are read by every rank, into the model."""
    sharded = os.path.isdir(path)
    if sharded:
        if not os.path.isfile(os.path.join(path, ".metadata")):  # DCP's index of the shards, written last
            raise Unreadable(f"{path} is not a whole sharded checkpoint (it has no .metadata); it was left untouched")
        path = os.path.join(path, HEADER)
    if not os.path.isfile(path):
        raise (Unreadable if sharded else UsageError)(f"no checkpoint at {path}")
    try:
        state = _read(path)
    except Unreadable as why:
        raise Unreadable(f"{path} is not a readable checkpoint ({why}); it was left untouched") from None
    if not isinstance(state, dict) or state.get("arch") != ARCH or ("model" not in state and not sharded):
        raise UsageError(f"{path} is not a {ARCH} checkpoint of these scripts; it was left untouched")
    return state


def weights_of(path: str) -> dict:
    """The model weights in `path` for --init-from: a checkpoint of any of these scripts, or a plain
    state_dict (DDP's "module." and torch.compile's "_orig_mod." prefixes removed)."""
    if os.path.isdir(path):
        raise UsageError(f"--init-from {path} is a sharded checkpoint; make it one file with: "
                         f"python -m safety_net.sharded_checkpoint {path}")
    if not os.path.isfile(path):
        raise UsageError(f"--init-from {path}: no such file")
    try:
        state = _read(path)
    except Unreadable as why:
        raise UsageError(f"--init-from {path} is not readable ({why})") from None
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise UsageError(f"--init-from {path} holds neither a checkpoint of these scripts nor a state_dict of tensors")
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", key): value for key, value in weights.items()}


def run_flags(args) -> dict:
    """The values of RUN_FLAGS among the script's flags (a copy's data flags may lack --dataset, say)."""
    return {name: value for name, value in vars(args).items() if name in RUN_FLAGS}


def check_same_run(state: dict, options: Options, script: str, path: str) -> None:
    """A checkpoint continues only the run that wrote it: the same script with the same RUN_FLAGS."""
    if state.get("script") != os.path.basename(script):
        raise UsageError(f"{path} was written by {state.get('script')}, not {os.path.basename(script)}; "
                         "use another --output-dir (or --evaluate to test its weights)")
    for name, value in options.run.items():
        saved = state.get("run", {}).get(name, value)
        if saved != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{path} is a run with {flag} {saved}, not {value}; resume with the same flags, "
                             f"start afresh with --restart, or start a new run from its weights with "
                             f"--init-from {path} and another --output-dir")


def resuming(options: Options) -> bool:
    """Whether this start continues what <output-dir> holds. A restart by torchrun (--max-restarts) always
    resumes: --restart was meant for the first start."""
    restarted_by_torchrun = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    return restarted_by_torchrun or not options.restart


def newest_readable(options: Options) -> tuple[str | None, dict | None, list[tuple[str, Unreadable]]]:
    """The checkpoint this run continues and its contents: --resume, else the newest readable one in
    <output-dir> (unless --restart); (None, None, []) when there is none. Also the newer ones that could
    not be read, each with its Unreadable. When none can be read, the newest one's Unreadable is raised and
    every file is left as it is. Read once where a process starts (check_before_start) and passed down."""
    if options.resume:
        return options.resume, load(options.resume), []
    candidates = kept_paths(options.output_dir, options.sharded) if resuming(options) else []
    errors = []
    for path in candidates:
        try:
            state = load(path)
        except Unreadable as error:
            errors.append((path, error))
            continue
        return path, state, errors
    if errors:
        raise errors[0][1]
    return None, None, []


def recorded_precision(options: Options, path: str | None, state: dict | None) -> tuple[str | None, str | None]:
    """(precision, path): the precision the checkpoint `state` read from `path` (newest_readable's) trained
    in, or None for a new run or --evaluate (and for an older checkpoint that recorded only --opt-level O1
    --amp-dtype auto)."""
    if options.evaluate or state is None:
        return None, None
    if "precision" in state.get("resolved", {}):
        return state["resolved"]["precision"], path
    typed = state.get("run", {})  # older checkpoints: what was typed
    if typed.get("opt_level") == "O0":
        return "float32", path
    return (typed["amp_dtype"], path) if typed.get("amp_dtype", "auto") != "auto" else (None, None)


def check_output_dir_writable(options: Options) -> None:
    """Before any process starts or any data loads, creating nothing: --output-dir can be written (or made)
    and --init-from names a file."""
    if not options.output_dir.strip():
        raise UsageError("--output-dir is empty; name a directory (default: runs/<script name>)")
    path = os.path.abspath(options.output_dir)
    existing = path
    while not os.path.exists(existing):  # the run makes the missing folders: the nearest existing one decides
        existing = os.path.dirname(existing)
    check_writable(existing, f"--output-dir {options.output_dir}")
    if options.init_from and not os.path.exists(options.init_from):
        raise UsageError(f"--init-from {options.init_from}: no such file")


def check_writable(folder: str, flag: str) -> None:
    """A UsageError naming `flag` unless `folder` is a directory this process can write in."""
    if not os.path.isdir(folder):
        raise UsageError(f"{flag}: {folder} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):  # a write, not os.access: root passes that on a read-only disk
            pass
    except OSError as error:
        raise UsageError(f"{flag}: cannot write in {folder} ({error.strerror})") from None


def check_before_start(options: Options, script: str) -> tuple:
    """Fail before any process starts if the checkpoint that --evaluate or a resume would read is unusable;
    return it as newest_readable does (--evaluate: <output-dir>'s newest)."""
    if options.evaluate:
        path = kept_path(options.output_dir, 0, options.sharded)
        return path, load(path), []
    path, state, unreadable = newest_readable(options)
    if state is not None:
        check_same_run(state, options, script, path)
    return path, state, unreadable


def lock_path(output_dir: str) -> str:
    return os.path.join(output_dir, LOCKNAME)


def _busy(output_dir: str, fd: int) -> UsageError:
    os.lseek(fd, 0, os.SEEK_SET)
    holder = os.read(fd, 1000).decode(errors="replace").strip() or "a process that has not said which"
    return UsageError(f"--output-dir {output_dir} is in use by another run ({holder}); wait for it to end, "
                      "stop it, or choose another --output-dir")


def check_output_dir_free(output_dir: str) -> None:
    """Fail at once if another run holds output_dir's lock; take nothing, create nothing."""
    try:
        fd = os.open(lock_path(output_dir), os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(output_dir, fd) from None
    finally:
        os.close(fd)  # releases the probe's lock


def lock_output_dir(output_dir: str) -> int:
    """Take output_dir's lock for this process's lifetime (the OS drops it when the process ends, however
    it ends); say in the lock file who holds it; remove temporary files that crashed runs left behind."""
    os.makedirs(output_dir, exist_ok=True)
    fd = os.open(lock_path(output_dir), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _busy(output_dir, fd)
        os.close(fd)
        raise error from None
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]
    holder = (f"process {os.getpid()}, started by {os.getppid()}, on {socket.gethostname()} since "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode() + b"\n", 0)
    for name in os.listdir(output_dir):
        if re.fullmatch(r"(checkpoint\.pt|metrics\.jsonl)(\.\d+)?\.tmp", name):
            os.remove(os.path.join(output_dir, name))
        elif name == f"{SHARDED}.tmp":  # a sharded checkpoint whose save did not finish
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return fd


class Checkpoint:
    """The checkpoints of one run in <output-dir>: save and restore, one path for every script; write() puts
    them in one file on rank 0, sharded_checkpoint's in every rank's shards. `precision` is the autocast dtype
    the run trains in (None: float32), recorded so that a resume keeps it."""

    full_weights = None  # torch's StateDictOptions for whole weights (set_weights); FSDP's keep each rank's shard

    def __init__(self, options: Options, env, script: str, *, precision: torch.dtype | None = None, before_save=None,
                 **parts):
        self.options, self.env, self.script, self.parts = options, env, os.path.basename(script), parts
        self.before_save = before_save  # every rank, before each save (ZeRO-1's shares gathered on rank 0)
        self.precision = str(precision).removeprefix("torch.") if precision else "float32"
        self.path = kept_path(options.output_dir, 0, options.sharded)
        self.epoch_loss = (0.0, 0.0)  # (sum, count) over all ranks of the losses of the epoch so far
        self.lock = None

    def due(self, step: int, steps: int) -> bool:
        """A mid-epoch checkpoint is due after `step` of `steps` (--save-every-steps; the epoch's end saves anyway)."""
        every = self.options.save_every_steps
        return bool(every) and step % every == 0 and step < steps

    def load_weights(self, state: dict | None = None) -> None:
        """For --evaluate: only the model's weights, from <output-dir>'s newest checkpoint of any of the scripts
        (`state`: that checkpoint as check_before_start read it; None: read now)."""
        self.set_weights((state or load(self.path))["model"], self.path)

    def read_weights(self, path: str, source: str) -> None:
        """The model's weights in the file `path` (weights_of): a checkpoint of any script, or a plain state_dict."""
        self.set_weights(weights_of(path), source)

    def set_weights(self, weights: dict, source: str) -> None:
        """Full weights, keyed as model_state's, into the model (whatever wraps it); weights of another model are
        a UsageError naming `source`."""
        try:  # a copy: torch renames the keys of the dict it is given, in place
            set_model_state_dict(unwrap(self.parts["model"]), dict(weights), options=self.full_weights)
        except (RuntimeError, KeyError, ValueError) as e:  # load_state_dict's second line names the keys
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            raise UsageError(f"{source} holds weights of another architecture ({first[:160]})") from None

    def hold_output_dir(self) -> None:
        """Rank 0 takes <output-dir>'s lock for the whole run; if another run holds it, every rank stops
        with one line (UsageError) before anything in it is touched."""
        error = None
        if self.env.is_main:
            try:
                self.lock = lock_output_dir(self.options.output_dir)
            except UsageError as e:
                error = e
        if not collectives.all_ok(error is None, self.env.device):
            raise error or UsageError(f"--output-dir {self.options.output_dir} is in use by another run")

    def resume(self, newest: tuple | None = None) -> tuple[int, int]:
        """Hold <output-dir>, then restore every part from the checkpoint to continue, if any (or the
        weights of --init-from for a new run); return the (epoch, step) to start at. `newest`: what
        newest_readable gave where the process started (None: read it now)."""
        self.hold_output_dir()
        path, state, unreadable = newest or newest_readable(self.options)
        if self.env.is_main:
            for bad, error in unreadable:  # out of the way: the next save must not keep it instead of a good one
                print(f"{str(error).split('; it was left')[0]}; continuing from {path}, the checkpoint before it",
                      flush=True)
                os.replace(bad, f"{bad}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        if state is None:
            self._keep_old_checkpoints()
            if self.options.init_from:
                self._start_from_weights(self.options.init_from)
            return 0, 0
        check_same_run(state, self.options, self.script, path)
        self.restore(state, path)
        self.epoch_loss = tuple(state.get("epoch_loss", (0.0, 0.0)))
        if state["step"]:  # at an epoch's last step, scheduler.step() comes before this process's first step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        if self.env.is_main and state["epoch"] < self.options.epochs:  # else the script says nothing is left
            print(f"resuming from {path}: epoch {state['epoch'] + 1}, step {state['step']} (checkpoint of "
                  f"{state['world_size']} process(es), global batch {state['batch_size']}) on {self.env.world_size}",
                  flush=True)
        return state["epoch"], state["step"]

    def restore(self, state: dict, path: str) -> None:
        """Every part (model, optimizer, scheduler, scaler) from the checkpoint `state` read from `path`."""
        self.set_weights(state["model"], path)
        self.restore_others(state, path)

    def restore_others(self, state: dict, path: str) -> None:
        """Every part but the model (optimizer, scheduler, scaler, ...) from `state`, read from `path`."""
        for name, part in self.parts.items():
            if name == "optimizer":
                self.load_optimizer(state[name])
            elif name == "scaler":
                load_scaler(part, state.get(name, {}), path)
            elif name != "model" and part is not None:
                if name not in state:  # a part this start asks for and the checkpoint's run did not have
                    raise UsageError(f"{path} holds no {name}; continue it with the flags it was written with")
                part.load_state_dict(state[name])

    def _start_from_weights(self, path: str) -> None:
        self.read_weights(path, f"--init-from {path}")
        if self.env.is_main:
            print(f"starting a new run from the weights in {path} (a fresh optimizer and schedule)", flush=True)

    def _keep_old_checkpoints(self) -> None:
        """--restart: the old checkpoints are renamed, never silently overwritten."""
        old = kept_paths(self.options.output_dir, self.options.sharded)
        if self.env.is_main and old:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            others = (os.path.join(self.options.output_dir, name) for name in ("metrics.jsonl", "tensorboard"))
            for path in (*old, *others):
                if os.path.exists(path):
                    os.replace(path, f"{path}.{stamp}")
            print(f"--restart: starting afresh; the previous checkpoints and metrics are kept as *.{stamp}", flush=True)

    def load_optimizer(self, saved: dict) -> None:
        """The saved state (momentum buffers, learning rate), with the implementation of the optimizer as built
        now: load_state_dict would bring back the saved foreach/fused settings, and a fused SGD built as not
        fused would then meet a GradScaler that unscales for it."""
        optimizer = self.parts["optimizer"]
        built = [{k: group[k] for k in IMPLEMENTATION_KEYS if k in group} for group in optimizer.param_groups]
        self.load_optimizer_state(saved)
        for group, implementation in zip(optimizer.param_groups, built, strict=True):
            group.update(implementation)

    def load_optimizer_state(self, saved: dict) -> None:
        """The optimizer's state_dict() as a one-file checkpoint holds it, parameters by index: torch's
        get_optimizer_state_dict would key them by name, which the checkpoints written so far do not."""
        self.parts["optimizer"].load_state_dict(saved)

    def save(self, epoch: int, step: int = 0, epoch_loss: tuple[float, float] = (0.0, 0.0)) -> None:
        """`epoch` epochs and `step` steps of the next one are done. Every rank calls it (collectives: the weights
        checked finite on every rank, before_save, write's): weights that are not finite on any rank raise Diverged
        on every rank and overwrite nothing; a failed write on any rank raises StorageError on every rank."""
        state = self.state_dicts()
        local = [t.to_local() if hasattr(t, "to_local") else t for t in state["model"].values()]  # FSDP: shards
        finite = torch.stack([torch.isfinite(t).all() for t in local if t.is_floating_point()]).all().item()
        if not collectives.all_ok(finite, self.env.device):  # a pipeline's stages hold different weights
            raise Diverged(f"the weights are not finite at epoch {epoch + 1 if step else epoch}, step {step}: the run "
                           f"diverged; try a lower --lr than {self.options.lr:g}. {self.path} was not overwritten")
        if self.before_save:
            self.before_save()
        self.write(state, epoch, step, epoch_loss)

    def state_dicts(self) -> dict:
        """What save() checks and writes of the model: its weights, keyed as the bare model's."""
        return {"model": model_state(self.parts["model"])}

    def write(self, state: dict, epoch: int, step: int, epoch_loss: tuple[float, float]) -> None:
        """Every rank (collective: rank 0's write agreed): rank 0 writes one file, the weights in `state` and
        every other part's state_dict() (ZeRO-1's optimizer: consolidated on rank 0 by before_save)."""
        error = None
        if self.env.is_main:
            try:
                save_atomic(self.state(state["model"], epoch, step, epoch_loss), self.path, self.options.keep)
            except StorageError as e:
                error = e
        if not collectives.all_ok(error is None, self.env.device):  # no rank trains on without a checkpoint
            raise error or StorageError("rank 0 could not write the checkpoint (its error says why)")

    def state(self, weights: dict, epoch: int, step: int, epoch_loss: tuple[float, float]) -> dict:
        state = {name: (weights if name == "model" else part.state_dict())
                 for name, part in self.parts.items() if part is not None}
        return {**state, **self.header(epoch, step, epoch_loss)}

    def header(self, epoch: int, step: int, epoch_loss: tuple[float, float]) -> dict:
        """What a checkpoint records beside its parts: where the run is, its flags and what it resolved."""
        optimizer = self.parts.get("optimizer")
        scaler = self.parts.get("scaler")
        return dict(arch=ARCH, script=self.script, seed=self.options.seed, epoch=epoch, step=step,
                    epoch_loss=list(epoch_loss), run=self.options.run,
                    resolved={"precision": self.precision, "loss_scaling": bool(scaler and scaler.is_enabled()),
                              "optimizer": {k: optimizer.param_groups[0].get(k) for k in IMPLEMENTATION_KEYS}
                              if optimizer else {}},
                    world_size=self.env.world_size, batch_size=self.options.batch_size)


def load_scaler(scaler: torch.amp.GradScaler, saved: dict, path: str) -> None:
    """The GradScaler's state; an enabled scaler needs a saved one (the precision check makes it so,
    except for a checkpoint older than the recorded precision)."""
    if scaler.is_enabled() and not saved:
        raise UsageError(f"{path} trained without float16 loss scaling and does not record its precision; "
                         "resume with the --amp-dtype it trained in, or start a new run with --init-from")
    if scaler.is_enabled():
        scaler.load_state_dict(saved)
