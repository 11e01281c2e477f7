"""The run's safety net in one object, called by a script at a few named places: checkpoints and resume,
stop signals and preemption, the divergence guard, the output directory's lock, progress lines and
metrics.jsonl (and TensorBoard events), a crash in one line. Delete those calls from a copy of a script and it
still trains.

Every method that communicates with the other ranks says so in the first line of its docstring, and
every rank calls it at the same line of the script: moved onto one rank's path, it would hang the others.

    with SafetyNet.for_flags(args, __file__) as safety:  # first: stop signals caught; errors one line
        ... dist.init_process_group(...)
        with safety.running(env):                     # every rank: the stop agreement's group; at the end a barrier
            start_epoch = safety.resume(model=..., optimizer=..., scheduler=..., steps_per_epoch=...)
            for epoch in range(start_epoch, epochs):
                start_step = safety.begin_epoch(epoch)   # 0, or the step a mid-epoch checkpoint reached
                for images, targets in loader:
                    ...
                    if safety.step_done(loss):           # True once every rank knows of a stop signal
                        break
                results = metrics.evaluate(..., stop=safety.stop_received_here)
                if safety.end_epoch(results, lr):        # a stop agreed: its checkpoint written, leave
                    break
                scheduler.step()
                safety.save(epoch + 1)
"""
import contextlib
import importlib.util
import multiprocessing
import os
import sys

import torch

from safety_net import checkpoint as checkpoints
from safety_net import crash_report, metrics_log, profiling, stopping
from safety_net.progress import EpochProgress
from utils import errors, flags


class SafetyNet:
    """One run's checkpoints, stop signals, progress and metrics; every value it needs is given to it."""

    def __init__(self, script: str, options: checkpoints.Options, *, print_freq: int = 50, tensorboard: bool = False,
                 watch_launcher: bool = False, profile_steps: int | None = None,
                 checkpoint_kind=checkpoints.Checkpoint):
        """Catches SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 from now on: make it first, in every process of the run.

        script: the training script's path, recorded in each checkpoint (one continues only its own run).
        options: what the checkpoints are told (where, the values that define the run, resume or restart, ...).
        print_freq: a progress line every N steps. tensorboard: also write TensorBoard events.
        watch_launcher: also stop when the process that started this one dies (torchrun's agent, the spawn parent).
        profile_steps: record that many steps with torch.profiler (safety_net/profiling.py); None: no profiler.
        checkpoint_kind: the class that writes and reads the checkpoints: checkpoint.Checkpoint (one file), or
        FSDP's sharded_checkpoint.ShardedCheckpoint (a directory of shards), which the FSDP script passes."""
        self.script, self.options, self.checkpoint_kind = script, options, checkpoint_kind
        self.print_freq, self.tensorboard = print_freq, tensorboard
        self.stop = stopping.StopSignals(watch_launcher=watch_launcher)
        self.env = self.checkpoint = self.log = self.progress = None
        self.start_at = (0, 0)  # (epoch, step) the run continues from
        self.newest = None  # the checkpoint to continue or evaluate, read once by __enter__'s checks (newest_readable)
        self.steps_per_epoch = 0
        self.progress_note = None  # a function whose words end each progress line (safety_net/healing.py)
        self.profile_steps, self.profiler = profile_steps, None  # made by running() when asked for

    @staticmethod
    def add_flags(parser: flags.Parser, sharded: bool = False) -> None:
        """The safety net's flags, after utils.flags.add_training_flags: --print-freq among the training flags, and the
        group "checkpoints and output" (sharded: the checkpoints are directories, FSDP's)."""
        name = os.path.splitext(parser.prog)[0]
        newest, older = ("checkpoint.dcp/", "checkpoint.1.dcp/") if sharded else ("checkpoint.pt", "checkpoint.1.pt")
        flags.group(parser, "training").add_argument(
            "--print-freq", type=flags.positive_int, default=50,
            help="log progress every N steps and at each epoch's first (the only host syncs)")
        ckpt = parser.add_argument_group("checkpoints and output")
        ckpt.add_argument("--output-dir", default=os.path.join("runs", name),
                          help=f"where metrics.jsonl, {newest} and eval.json are written")
        ckpt.add_argument("--save-every-steps", type=flags.non_negative_int, default=0, metavar="N",
                          help="also write the checkpoint every N steps within an epoch (0: only at the end of "
                               "each epoch)")
        ckpt.add_argument("--resume", default=None, metavar="PATH",
                          help=f"continue from this checkpoint (default: <output-dir>/{newest}, when there is one)")
        ckpt.add_argument("--restart", action="store_true",
                          help="start afresh although <output-dir> holds a checkpoint; the old ones are kept, renamed")
        ckpt.add_argument("--init-from", default=None, metavar="PATH",
                          help="start a new run from the model weights in PATH (a checkpoint of any of these scripts, "
                               "or a state_dict), with a fresh optimizer and schedule: to train longer, or fine-tune")
        ckpt.add_argument("--keep", type=flags.positive_int, default=2, metavar="N",
                          help=f"keep the newest N checkpoints ({newest}, {older}, ...); a run whose "
                               "newest cannot be read continues from the one before")
        ckpt.add_argument("--evaluate", action="store_true",
                          help=f"evaluate <output-dir>/{newest} on the test set, write eval.json, do not train")
        ckpt.add_argument("--tensorboard", action="store_true",
                          help="also write the metrics as TensorBoard events into <output-dir>/tensorboard "
                               "(needs the tensorboard package); view with: tensorboard --logdir <output-dir>")
        profiling.add_flag(ckpt)  # --profile-steps
        parser.checks.append(_tensorboard_missing)
        parser.checks.append(_init_from_conflicts)

    # what the net hands utils.errors.exit_on_error: a crash as one line and exit status 1, its traceback in a file
    # (crash_report.py)
    report_crash = staticmethod(crash_report.report)

    @classmethod
    def for_flags(cls, args, script: str, sharded_checkpoint=None) -> "SafetyNet":
        """The safety net for the scripts' flags (utils.flags): the one place that reads them for it. It watches the
        launcher (stops when it is gone) where one started this process: torchrun's agent or mp.spawn.
        sharded_checkpoint: the class of FSDP's sharded checkpoints (sharded_checkpoint.ShardedCheckpoint), for a
        script that writes them; None: one file, checkpoint.Checkpoint."""
        # torchrun's agent (it sets TORCHELASTIC_RUN_ID) or mp.spawn's parent waits for this process
        watch_launcher = "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process() is not None
        kind, sharded = sharded_checkpoint or checkpoints.Checkpoint, sharded_checkpoint is not None
        return cls(script, checkpoints.Options.from_flags(args, sharded), print_freq=args.print_freq,
                   tensorboard=args.tensorboard, watch_launcher=watch_launcher, profile_steps=args.profile_steps,
                   checkpoint_kind=kind)

    def __enter__(self) -> "SafetyNet":
        """`with SafetyNet.for_flags(...) as safety:` around a process's work: _check_before_start first; an error
        within is one line (utils.errors.exit_on_error: bad input exit status 2, a crash 1, its traceback in a file)."""
        self._errors = errors.exit_on_error(self.report_crash)
        self._errors.__enter__()
        try:
            self.newest = _check_before_start(self.options, self.script, self.profile_steps)
        except Exception:
            self.__exit__(*sys.exc_info())  # its line and exit status
            raise  # (exit_on_error exits on every Exception: not reached)
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        return self._errors.__exit__(kind, error, traceback)

    @staticmethod
    def check_flags_before_spawn(args, script: str) -> None:
        """The checks of `with SafetyNet.for_flags(...)` in a process that only starts the ranks (mp.spawn's parent),
        an error one line: it keeps nothing it read, where a rank keeps the checkpoint for its resume (it would hold
        it the whole run)."""
        with errors.exit_on_error(SafetyNet.report_crash):
            _check_before_start(checkpoints.Options.from_flags(args), script, args.profile_steps)

    def recorded_precision(self) -> tuple[str | None, str | None]:
        """(precision, path): what the checkpoint this run continues trained in (utils.precision.autocast_dtype
        keeps it), and where it is; (None, None) for a new run or --evaluate."""
        return checkpoints.recorded_precision(self.options, *self.newest[:2])

    @contextlib.contextmanager
    def running(self, env):
        """Every rank, around the training once the process group exists (collectives: the stop agreement's gloo
        group made; at the end a barrier after its last all-reduce). Within, an error every rank meets exits every
        rank at once; after a stop (end_epoch returned True) the process exits with 128 + the signal's number."""
        self.env = env
        errors.note_ranks_met()
        self.stop.arm(  # on the CPU the ranks meet every step (DDP over gloo): a stop waits for no further step
            env.world_size, one_step=env.device.type == "cpu", is_main=env.is_main)
        if self.profile_steps:
            folder = os.path.join(self.options.output_dir, profiling.FOLDER)
            self.profiler = profiling.StepProfiler(self.profile_steps, folder, env.rank, env.device.type)
        yield self
        if self.stop.saved:  # the stopped run's checkpoint is written, every rank met after it
            sys.exit(self.stop.exit_status)
        self._finish()

    def write_eval(self, results: dict) -> None:
        """Rank 0 writes <output-dir>/eval.json and prints the results."""
        metrics_log.write_eval(self.options.output_dir, results, self.env.is_main)

    def resume(self, *, steps_per_epoch: int, precision: torch.dtype | None = None, before_save=None, **parts) -> int:
        """Every rank (collectives: the output directory's lock agreed, weights broadcast when sharded): take
        <output-dir>, and restore every part (model=, optimizer=, scheduler=, scaler=) from its newest
        checkpoint, or the weights of --init-from for a new run; under --evaluate only the model's weights, and
        <output-dir> is not taken. Returns the epoch to start at.
        precision: the autocast dtype the run trains in (None: float32), recorded so that a resume keeps it.
        before_save: a function every rank calls before each checkpoint is written (ZeRO-1's consolidation)."""
        self.checkpoint = self.checkpoint_kind(self.options, self.env, self.script, precision=precision,
                                               before_save=before_save, **parts)
        if self.options.evaluate:  # --evaluate: only the weights (sharded: each rank its shards), nothing to train
            self.checkpoint.load_weights(self.newest and self.newest[1])
            return self.options.epochs
        self.stop.checkpoint_path = self.checkpoint.path  # what a stop that leaves at once says it keeps
        self.start_at = self.checkpoint.resume(self.newest)
        self.newest = None  # its tensors are in the parts now: not held for the whole run
        self.steps_per_epoch = steps_per_epoch
        self.log = metrics_log.MetricsLog(self.options.output_dir, is_main=self.env.is_main,
                                          done_epochs=self.start_at[0], done_steps=self.start_at[1],
                                          steps_per_epoch=steps_per_epoch, tensorboard=self.tensorboard)
        if self.profiler:  # the profiled steps and their warm-up must fit in the steps left
            steps_left = (self.options.epochs - self.start_at[0]) * steps_per_epoch - self.start_at[1]
            profiling.check_steps_left(self.profile_steps, steps_left, steps_per_epoch)
        if self.start_at[0] == self.options.epochs and self.env.is_main:
            epochs = f"{self.options.epochs} epoch{'s' if self.options.epochs > 1 else ''}"
            print(f"nothing left to train: the checkpoint already has the {epochs} asked for (--evaluate tests it)")
        return self.start_at[0]

    def begin_epoch(self, epoch: int) -> int:
        """Starts the epoch's clock and loss; returns the step to start from: 0, or on the epoch a mid-epoch
        checkpoint was written in, the step it reached (the loader leaves out the batches before it)."""
        start_step = self.start_at[1] if epoch == self.start_at[0] else 0
        self.progress = EpochProgress(steps=self.steps_per_epoch, epoch=epoch, epochs=self.options.epochs, env=self.env,
                                      global_batch=self.options.batch_size, print_freq=self.print_freq,
                                      lr=self.options.lr,
                                      start_step=start_step, epoch_loss=self.checkpoint.epoch_loss, log=self.log,
                                      note=self.progress_note)
        self.stop.epoch_starts(epoch, start_step, self.steps_per_epoch)  # where a stop lands, the step clock
        if self.profiler:  # --profile-steps: from the first step on (only the first call starts it)
            self.profiler.start()
        return start_step

    def step_done(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None = None) -> bool:
        """Every rank, after each optimizer step (collectives: the stop flag all-reduced every step on a gloo
        group of its own, the loss every --print-freq steps, a checkpoint every --save-every-steps). The loss is
        summed on the device (None: this rank has none, a pipeline's stage but the last); a non-finite one stops the
        run (Diverged); `grad_norm`: --clip-grad-norm's norm before clipping, for the progress lines and
        metrics.jsonl. True once every rank knows of a stop
        signal: leave the epoch's loop."""
        if self.profiler:  # --profile-steps: the step ends here in the trace; the last recorded one writes it
            self.profiler.step()
        progress = self.progress
        progress.record(loss, grad_norm)
        if self.stop.agreed():  # a stop signal reached some rank: every rank leaves at this same step
            return True
        if self.checkpoint.due(progress.step, progress.total):  # --save-every-steps
            epoch_loss = progress.loss_so_far()
            self.checkpoint.save(epoch=progress.epoch, step=progress.step, epoch_loss=epoch_loss)
        return False

    def stop_received_here(self) -> bool:
        """Whether this process got a stop signal: a local check, for loops every rank may leave at its own
        step (the evaluation); end_epoch() then makes it everyone's."""
        return bool(self.stop.signum or self.stop.received)

    def end_epoch(self, results: dict, lr: float) -> bool:
        """Every rank, after the evaluation (collectives: the stop flag and the epoch's loss all-reduced; on a stop, the
        checkpoint's). A stop signal reached some rank: the checkpoint of the step all reached, rank 0 says how to
        continue, True (leave). Else rank 0 writes and prints the epoch's line of metrics.jsonl, False."""
        progress = self.progress
        if self.stop.agree_now():  # a signal reached some rank (in the evaluation, say): every rank stops here
            self.checkpoint.save(epoch=progress.epoch, step=progress.step, epoch_loss=progress.loss_so_far())
            self.stop.finish_stopped_run(epoch=progress.epoch, step=progress.step, steps=progress.total,
                                         path=self.checkpoint.path, is_main=self.env.is_main)
            return True
        self.log.write({"epoch": progress.epoch + 1, "lr": lr, **progress.summary(), **results,
                        "world_size": self.env.world_size})
        return False

    def save(self, epochs_done: int) -> None:
        """Every rank (collectives: the weights checked finite on every rank, resume's before_save, rank 0's
        write agreed): the checkpoint after `epochs_done` epochs; weights that are not
        finite stop the run and overwrite nothing."""
        self.checkpoint.save(epoch=epochs_done)

    def _finish(self) -> None:
        """Every rank, at the end (collective: a barrier after the stop flag's last all-reduce)."""
        self.stop.finish()
        if self.progress is not None and self.progress.bar:
            self.progress.bar.close()
        if self.profiler:  # every rank wrote its trace before the barrier above
            self.profiler.close()
            if self.env.is_main:
                print(self.profiler.last_line(self.options.output_dir, self.env.world_size), flush=True)


def _check_before_start(options: checkpoints.Options, script: str, profile_steps: int | None) -> tuple:
    """Before any process group or data (a UsageError, one line): <output-dir> can be written and no other run holds
    it, --init-from names a file, and the checkpoint that --evaluate or a resume would read is there, readable, and
    of this script's run. Returns that checkpoint as checkpoint.newest_readable does."""
    checkpoints.check_output_dir_writable(options)
    if not options.evaluate:
        checkpoints.check_output_dir_free(options.output_dir)
    newest = checkpoints.check_before_start(options, script)
    profiling.check_before_start(profile_steps, options.evaluate, options.output_dir)  # --profile-steps
    return newest


def _init_from_conflicts(args) -> str | None:
    if args.init_from and args.resume:
        return "--init-from starts a new run and --resume continues one: give one of them"
    if args.init_from and args.evaluate:
        return "--evaluate tests <output-dir>'s newest checkpoint; --init-from is for training (drop one of them)"
    return None


def _tensorboard_missing(args) -> str | None:
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return "--tensorboard needs the tensorboard package: pip install tensorboard"
    return None
