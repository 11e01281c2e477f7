"""Stop signals: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 end a run at a step every rank agrees on.

A scheduler stops a job with a signal (scancel, docker stop, a Kubernetes eviction, `timeout`; SLURM's
`--signal=USR1@90` before a time limit), usually to one process of the run, and kills it for good some
seconds later (torchrun and SLURM wait 30 s). So a signal only records a request here; the training loop
asks `agreed()` once per step, every rank at the same step, and all ranks leave at the step where the
request is known to all of them, so that rank 0 can write a checkpoint of that step.

Agreeing costs no device sync: the flag is a CPU tensor all-reduced over a gloo group of its own. On the CPU,
where DDP's gloo all-reduce makes the ranks meet at every step anyway, each step waits for its own flag (about
0.2 ms), so the ranks stop at the end of the step the signal came in. On a GPU, whose host runs ahead of the
device, a flag started at one step is read at the next (by then long done), so that no host waits for the
others, and the ranks stop one step later.

A thread reads the signals as they come, also while the main thread waits in a collective or a rendezvous.
Before the run can stop at a step it exits at once. Once it can, the stop waits as long as the steps take,
and rank 0 says at once where it stops and about when. The run is called stuck (a hang, not a slow step), and
exits leaving the last checkpoint as it was, when nothing finishes for twice the slowest recent step (at least
FLOOR_S); under torchrun, and under SLURM for SIGTERM, it exits before the launcher's SIGKILL. A second signal,
REPEAT_S or more after the first, leaves at once: no new checkpoint, the last one kept.
"""
import collections
import contextlib
import functools
import multiprocessing
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from safety_net.checkpoint import temporary_path
from utils import collectives
from utils.errors import print_line

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FLOOR_S = 25  # after a signal, nothing finished for this long (or MARGIN slowest recent steps): the run is stuck
MARGIN = 2
FIRST_STEP_S = 120  # the same for a run's first step, untimed (its warm-up: compilation, the workers' start)
SAVE_S = 5  # the stopped step's checkpoint and the exit, counted against a scheduler's SIGKILL (about 3 s here)
REPEAT_S = 2  # a signal this soon after the first is a copy of it (the terminal's and the launcher's)
KILL_WAIT_S = 30  # torchrun (--shutdown-timeout) and SLURM (KillWait) send SIGKILL 30 s after SIGTERM by default
RECENT_STEPS = 8  # the step times a stop's wait is derived from
_LAUNCHER_GONE = "the launcher's exit"
# the stop flag of a rank whose launcher is gone (it stops as on SIGTERM): above every signal's number, so that the
# all-reduce's MAX carries the reason to the ranks that have not seen it yet, and rank 0 names it whichever saw it
_LAUNCHER_GONE_FLAG = 64


class StopSignals:
    """Install at the start of a training process; `arm(world_size)` once the process group exists."""

    def __init__(self, watch_launcher: bool = False):
        """watch_launcher: also stop when the process that started this one is gone (a spawn parent or
        torchrun killed outright), checked every second. Not for a process started from a shell, whose
        exit (nohup, a closed terminal) must not stop the run."""
        self.received = 0  # the first stop signal this process got (0: none)
        self.reason = ""  # what rank 0 says stopped the run
        self.signum = 0  # the signal all ranks agreed to stop on (0: not agreed)
        self.launcher_gone = False  # the agreed stop came from a launcher's exit, on this rank or another
        self.armed = False
        self.saved = False  # the stopped step's checkpoint is written: a later signal changes nothing
        self.checkpoint_path = ""  # the run's newest checkpoint (set by the safety net): what a second signal keeps
        self.is_main = True  # this rank says where a stop lands, and warns when a SIGKILL would come first
        self._group, self._work, self._flag = None, None, torch.zeros(1, dtype=torch.int32)
        self._one_step = False  # each step reads its own flag (arm)
        self._launcher = os.getppid() if watch_launcher else None
        # where the loop is, and the step clock: set by epoch_starts and agreed(), read by the watcher
        self._lock = threading.Lock()
        self._epoch, self._step, self._steps, self._between_epochs = 0, 0, 0, False
        self._step_started = None
        self._first_step_s, self._recent = None, collections.deque(maxlen=RECENT_STEPS)
        self._warned = False
        self._signalled_at = self._deadline = self._kill_at = None
        # The interpreter runs Python handlers only between bytecodes of the main thread, never while it
        # waits inside torch (a collective, a rendezvous); the wakeup fd gets each signal's number at once.
        self._read, write = socket.socketpair()
        write.setblocking(False)
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        self._write = write  # kept open for the process's lifetime
        for signum in SIGNALS:
            signal.signal(signum, lambda *_: None)  # the thread below acts on it
        threading.Thread(target=self._watch, name="stop-signals", daemon=True).start()
        _leave_stop_signals_to_the_rank_in_forked_workers()

    def arm(self, world_size: int, *, one_step: bool = False, is_main: bool = True) -> None:
        """From now on a signal waits for the next agreed step; call on every rank at the same point.
        one_step: each step waits for its own flag, so the ranks stop at the step a signal came in: for ranks
        that meet at every step anyway (DDP over gloo on the CPU); otherwise a flag is read one step later.
        is_main: this rank says where a stop lands, and warns when a scheduler's SIGKILL would come first."""
        if world_size > 1:  # a gloo group of its own: CPU tensors, no device sync, no mix with DDP's traffic; it waits
            self._group = collectives.new_group_like_world(backend="gloo")  # as long as the scripts' (--dist-timeout)
        self._one_step, self.is_main = one_step or world_size == 1, is_main
        self._step_started = time.monotonic()
        self.armed = True

    def epoch_starts(self, epoch: int, step: int, steps: int) -> None:
        """The loop starts `epoch` at `step` of `steps`: a stop's step is counted from here, and the step clock
        starts again (the evaluation and the checkpoint between two epochs are no step)."""
        with self._lock:
            self._epoch, self._step, self._steps, self._between_epochs = epoch, step, steps, False
            self._step_started = time.monotonic()

    def agreed(self) -> bool:
        """True once every rank knows of a stop signal. Call once per step, at the same steps on every rank:
        it times the step and all-reduces the flags, this step's (one_step) or else the previous step's,
        starting this step's."""
        if self.signum:
            return True
        with self._lock:  # a signal from here on is in the next step's flag: the watcher counts on it
            flag = self._local_flag()
            self._step += 1
            self._time_step()
        if self._group is None:  # a world of one agrees with itself
            self.signum = self._agreed_on(flag)
        elif self._one_step:
            self._flag.fill_(flag)
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            self.signum = self._agreed_on(int(self._flag.item()))
        else:
            self.signum = self._agreed_on(self._in_flight())
            if not self.signum:
                self._flag.fill_(flag)
                self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if self.received or self.signum:
            self._moved_on()
        elif not self._warned:
            self._warn_if_a_stop_cannot_beat_sigkill()
        return bool(self.signum)

    def agree_now(self) -> bool:
        """True on every rank iff some rank got a stop signal by now: the all-reduce in flight is waited for,
        then one more, blocking (between epochs, where a step's worth of delay would cost an evaluation)."""
        if not self._settled_locally():
            with self._lock:
                flag = self._local_flag()
            self._flag.fill_(max(flag, self._in_flight()))
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            self.signum = self._agreed_on(int(self._flag.item()))
        if self.signum:
            self._moved_on()
        else:
            with self._lock:  # a signal from here on stops the run at the next epoch's first step
                self._between_epochs = True
        return bool(self.signum)

    def _settled_locally(self) -> bool:
        """Whether no all-reduce is needed: the ranks agreed already, or a world of one agrees with itself."""
        if not self.signum and self._group is None:
            with self._lock:
                self.signum = self._agreed_on(self._local_flag())
        return bool(self.signum) or self._group is None

    def _local_flag(self) -> int:
        """(Holding the lock.) This rank's stop flag: its signal's number, _LAUNCHER_GONE_FLAG, or 0."""
        return _LAUNCHER_GONE_FLAG if self.reason == _LAUNCHER_GONE else self.received

    def _agreed_on(self, flag: int) -> int:
        """The signal an agreed flag stands for (0: none): a launcher's exit on any rank is a SIGTERM that every
        rank knows the reason of."""
        if flag == _LAUNCHER_GONE_FLAG:
            self.launcher_gone = True
            return signal.SIGTERM
        return flag

    def _in_flight(self) -> int:
        """Waits for the all-reduce the last agreed() started: the largest flag any rank had then (0: none)."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._flag.item())

    def _time_step(self) -> None:
        """(Holding the lock.) The step that just ended into the recent step times; the process's first step,
        its warm-up (compilation, the DataLoader workers' start), is kept apart."""
        now = time.monotonic()
        if self._step_started is not None:
            if self._first_step_s is None:
                self._first_step_s = now - self._step_started
            else:
                self._recent.append(now - self._step_started)
        self._step_started = now

    def _slowest_step_s(self) -> float | None:
        """(Holding the lock, or on the main thread.) The slowest recent step; the first step of the process
        only while no other is timed; None before any."""
        return max(self._recent) if self._recent else self._first_step_s

    def _patience_s(self) -> float:
        """How long a stop waits for the next step, or for the checkpoint after the agreed one, before it calls
        the run stuck: MARGIN times the slowest recent step, at least FLOOR_S (FIRST_STEP_S before any is timed)."""
        step_s = self._slowest_step_s()
        return max(FLOOR_S, MARGIN * step_s) if step_s else FIRST_STEP_S

    def _moved_on(self) -> None:
        """A step (or the agreement) after a signal: the run is not stuck, its deadline moves on."""
        if self._deadline is not None:
            self._deadline = time.monotonic() + self._patience_s()

    def _warn_if_a_stop_cannot_beat_sigkill(self) -> None:
        """Once, at the first step timed after the warm-up: where a launcher sends SIGKILL some seconds after
        SIGTERM (torchrun, SLURM) and the steps are too slow for a stop to save within them, rank 0 says so."""
        if not self._recent:
            return
        self._warned = True
        budget = kill_budget(signal.SIGTERM)
        if not budget or not self.is_main:
            return
        seconds, who, setting = budget
        step_s = max(self._recent)
        needed = (1 if self._one_step else 2) * step_s + SAVE_S
        if needed <= usable_s(seconds):
            return
        advice = ("give torchrun a longer --shutdown-timeout" if who == "torchrun" else
                  "ask SLURM for the signal earlier (#SBATCH --signal=USR1@SECONDS: this run saves on SIGUSR1)")
        print_line(f"warning: a step takes about {_seconds(step_s)} s, so a stop signal needs up to {needed:.0f} s to "
                   f"save one; {who} sends SIGKILL {seconds:.0f} s after a signal ({setting}), and a stop not saved "
                   f"{usable_s(seconds):.0f} s after it exits without a new checkpoint; {advice}, save more often "
                   "with --save-every-steps, or use a smaller per-rank batch", error=False)

    def finish_stopped_run(self, *, epoch: int, step: int, steps: int, path: str, is_main: bool) -> int:
        """After the checkpoint of the agreed step: wait until every rank is here (so none exits while rank 0
        still writes), rank 0 says what stopped the run and where it continues, and on SIGUSR1 under SLURM
        requeues the job. Returns the exit status, 128 + the signal's number as the shell has it."""
        self.saved = True
        if self._group is not None:
            dist.barrier(group=self._group)
        if is_main:
            why = _LAUNCHER_GONE if self.launcher_gone else self.name
            print(f"stopped by {why} at epoch {epoch + 1}, step {step}/{steps}: checkpoint written to {path}; "
                  "run the same command to continue", flush=True)
            if self.signum == signal.SIGUSR1 and (requeued := requeue_slurm_job()):
                print(requeued, flush=True)
        return self.exit_status

    def finish(self) -> None:
        """Wait for the all-reduce in flight, then for every rank, before the process group is destroyed.
        Waiting in the barrier frees the GIL for gloo's threads to release the tensors of the collectives
        they just finished; one still waiting for the GIL when the interpreter exits aborts the process
        ("terminate called without an active exception", pytorch/pytorch#190489)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._group is not None:
            dist.barrier(group=self._group)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention for a process ended by a signal

    def _watch(self) -> None:
        while True:
            if select.select([self._read], [], [], 1.0)[0]:
                for signum in self._read.recv(64):  # also SIGCHLD and others with Python handlers: skipped
                    if signum in SIGNALS:
                        self._request(signum, signal.Signals(signum).name)
            elif self._launcher is not None and os.getppid() != self._launcher:
                self._request(signal.SIGTERM, _LAUNCHER_GONE)
            now = time.monotonic()
            if self._kill_at is not None and now > self._kill_at:
                self._give_up(before_sigkill=True)
            if self._deadline is not None and now > self._deadline:
                self._give_up(before_sigkill=False)

    def _request(self, signum: int, reason: str) -> None:
        now = time.monotonic()
        if self.received:
            # Ctrl-C reaches a process twice (terminal and launcher), and spawn's join repeats it once a rank
            # exits: a copy is no second request, nor is anything once the stopped step is saved
            if reason != _LAUNCHER_GONE and now - self._signalled_at >= REPEAT_S and not self.saved:
                self._leave_at_once(signum)
            return
        if self._launcher is not None and os.getppid() != self._launcher:
            reason = _LAUNCHER_GONE  # spawn's children get SIGINT when their parent dies
        with self._lock:  # the step this signal is seen at, and the step clock, as agreed() left them
            self.received, self.reason, self._signalled_at = int(signum), reason, now
            where, when, seconds = self._where_it_stops(now)
            self._deadline = now + self._patience_s()
        if not self.armed:  # starting up: nothing to save yet, nothing to wait for
            if os.environ.get("RANK", "0") == "0":
                print_line(f"stopped by {reason} while starting; nothing was trained, no checkpoint written",
                           error=False)
            self._exit(128 + signum)
        budget = kill_budget(signum)
        if budget:  # leave before the launcher's SIGKILL, with a line that says why
            self._kill_at = now + usable_s(budget[0])
        if self.is_main:
            late = (f" (past {usable_s(budget[0]):.0f} s it exits without one, before {budget[1]}'s SIGKILL)"
                    if budget and (seconds or 0) + SAVE_S > usable_s(budget[0]) else "")
            kept = f"keeping the last checkpoint ({path})" if (path := self._last_checkpoint()) else \
                "before any checkpoint is written"
            again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"  # kill -TERM: no terminal
            print_line(f"{reason}: stopping {where} with a checkpoint, {when}{late}; {again} leaves at once, {kept}",
                       error=False)

    def _where_it_stops(self, now: float) -> tuple[str, str, float | None]:
        """(Holding the lock.) Where a signal seen now stops the run and when, in words, and in about how many
        seconds (None: not known)."""
        if not self._steps:  # the first epoch has not started (the checkpoint is being read)
            return "after the first step", "when it is done (no step timed yet)", None
        if self._between_epochs:  # the epoch's evaluation is over, its checkpoint next
            return "after the next step", "once this epoch's checkpoint is written", None
        if self._step >= self._steps:
            where = f"at the end of epoch {self._epoch + 1} (step {self._steps}/{self._steps})"
            return where, "once the evaluation gives way", 0
        stop = min(self._step + (1 if self._one_step else 2), self._steps)
        where = f"after step {stop}/{self._steps} of epoch {self._epoch + 1}"
        if not (step_s := self._slowest_step_s()):
            return where, "when it is done (no step timed yet)", None
        seconds = max(1.0, (stop - self._step) * step_s - (now - self._step_started))
        return where, f"in about {seconds:.0f} s", seconds

    def _last_checkpoint(self) -> str:
        """The run's newest checkpoint, what a run that leaves now keeps; "" if there is none yet."""
        return self.checkpoint_path if self.checkpoint_path and os.path.exists(self.checkpoint_path) else ""

    def _leave_at_once(self, signum: int) -> None:
        """A second signal: exit now, the last checkpoint as it was, one line from rank 0."""
        if self.is_main:
            kept = f"the last one, {path}, is kept" if (path := self._last_checkpoint()) else \
                "none was written yet (the same command starts afresh)"
            print_line(f"stopped by a second {signal.Signals(signum).name}: left at once without a new checkpoint; "
                       f"{kept}", error=False)
        self._exit(128 + signum)

    def _give_up(self, before_sigkill: bool) -> None:
        """The stop's deadline passed: a rank stuck, or a launcher's SIGKILL due; one line says which."""
        with self._lock:
            step_s, patience_s = self._slowest_step_s(), self._patience_s()
        took = f"a step takes about {_seconds(step_s)} s" if step_s else "no step was timed yet"
        kept = f"the last one, {path}, is kept" if (path := self._last_checkpoint()) else "none was written yet"
        if before_sigkill:
            seconds, who, setting = kill_budget(self.received)
            print_line(f"the stop after {self.reason} did not save its step within {usable_s(seconds):.0f} s, and "
                       f"{who} sends SIGKILL {seconds:.0f} s after the signal ({setting}; {took}); exiting without a "
                       f"new checkpoint, {kept}", local_rank_0_only=True)
        else:
            print_line(f"the run is stuck: nothing finished within {patience_s:.0f} s after {self.reason} "
                       f"({took}; a rank hangs); exiting without a new checkpoint, {kept}", local_rank_0_only=True)
        self._exit(128 + self.received)

    def _exit(self, status: int) -> None:
        """Exit this process now, whatever its main thread does: its DataLoader workers killed (none left
        behind), its half-written checkpoint removed (the last whole one stays), and its named semaphores
        (tqdm's lock) unlinked as a normal exit does, or the resource tracker would warn of a leak."""
        for child in multiprocessing.active_children():
            child.kill()
        if self.checkpoint_path:
            with contextlib.suppress(OSError):
                os.remove(temporary_path(self.checkpoint_path))
        multiprocessing.util._run_finalizers(0)
        os._exit(status)


def _seconds(seconds: float) -> str:
    """A duration for a line: whole seconds, tenths below 1 s."""
    return f"{seconds:.1f}" if seconds < 1 else f"{seconds:.0f}"


def usable_s(kill_after_s: float) -> float:
    """Of the seconds a launcher waits before SIGKILL, those a stop may use: 5 s are left for the exit, or
    half the wait if it is shorter than 10 s."""
    return max(kill_after_s - 5, kill_after_s / 2)


def kill_budget(signum: int) -> tuple[float, str, str] | None:
    """(seconds, who, its setting): how long after a stop signal a launcher sends SIGKILL, where that is known.
    torchrun's agent passes its signals on and waits --shutdown-timeout for its workers; SLURM waits KillWait
    after its SIGTERM (30 s by default; not read, as every task asking the controller would load it). None
    elsewhere: spawn's parent and a shell wait as long as the stop takes."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                agent = f.read().decode(errors="replace").split("\0")
        except OSError:
            agent = []
        return torchrun_shutdown_timeout(agent, os.environ), "torchrun", "its --shutdown-timeout"
    if "SLURM_JOB_ID" in os.environ and signum == signal.SIGTERM:
        return KILL_WAIT_S, "SLURM", "its KillWait, 30 s by default"
    return None


def torchrun_shutdown_timeout(agent: list[str], environ) -> float:
    """The seconds torchrun waits for its workers after a signal before SIGKILL, from the agent's command line
    (`agent`, its words) or, as torchrun reads it, PET_SHUTDOWN_TIMEOUT or TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    for i, word in enumerate(agent):
        name, equals, value = word.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            value = value if equals else (agent[i + 1] if i + 1 < len(agent) else "")
            with contextlib.suppress(ValueError):
                return float(value)
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        with contextlib.suppress(KeyError, ValueError):
            return float(environ[name])
    return KILL_WAIT_S


@functools.cache  # once per process: os.register_at_fork cannot take a hook back
def _leave_stop_signals_to_the_rank_in_forked_workers() -> None:
    """From now on, a process this one forks (its DataLoader workers, which utils.data forks) leaves the stop
    signals to its parent, the rank. Ctrl-C and scancel signal every process of the job, workers too, and a
    worker killed by one would fail the rank's next batch instead of letting the rank stop at an agreed step.
    The child ignores SIGINT and SIGUSR1, and takes SIGTERM only from the rank (DataLoader ends a worker that is
    slow to shut down with one). Installed before the fork runs any code of the child: no window for a signal.
    Workers started by spawn (macOS's default) import afresh and get no such protection."""
    os.register_at_fork(after_in_child=_take_stop_signals_from_the_parent_only)


def _take_stop_signals_from_the_parent_only() -> None:
    signal.set_wakeup_fd(-1)  # the inherited descriptor is the rank's: a signal here must not reach its watcher
    for signum in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    # blocked before the worker sets torch's own SIGTERM handler, which dies of a signal from anyone but the rank
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()

    def sigterm_from_the_parent_only():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(128 + signal.SIGTERM)
    threading.Thread(target=sigterm_from_the_parent_only, daemon=True).start()


def requeue_slurm_job() -> str:
    """Under SLURM, requeue this job if it is requeueable (sbatch --requeue); say what was done."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    if shutil.which("scontrol") is None:
        return f"SLURM job {job}: scontrol not found, not requeued; submit the job again to continue"
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    if "Requeue=1" not in shown.stdout.split():
        return f"SLURM job {job} is not requeueable (sbatch --requeue); submit it again to continue"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    if done.returncode:
        return f"SLURM job {job}: scontrol requeue failed ({(done.stderr or done.stdout).strip()[:160]})"
    return f"SLURM job {job} requeued: it continues from the checkpoint when it starts again"
