"""Stop signals: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 end a run at a step every rank agrees on.

A scheduler stops a job with a signal (scancel, docker stop, a Kubernetes eviction, `timeout`; SLURM's
`--signal=USR1@90` before a time limit), usually to one process of the run, and kills it for good some
seconds later (torchrun and SLURM wait 30 s). So a signal only records a request here; the training loop
asks `agreed()` once per step, every rank at the same step, and all ranks leave at the step where the
request is known to all of them, so that rank 0 can write a checkpoint of that step.

Agreeing costs no device sync: the flag is a CPU tensor all-reduced over a gloo group of its own, started
at one step and read at the next (by then long done), so the ranks stop one step after the signal.
A thread reads the signals as they come, also while the main thread waits in a collective or a
rendezvous: before the run can stop at a step it exits at once, and once it can, it exits anyway after
GRACE_S seconds (a rank that never reaches the next step), leaving the last checkpoint as it was.
"""
import contextlib
import datetime
import functools
import multiprocessing
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from utils.errors import report

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
GRACE_S = 25  # torchrun (--shutdown-timeout) and SLURM (KillWait) send SIGKILL 30 s after SIGTERM
_LAUNCHER_GONE = "the launcher's exit"


def _say(message: str) -> None:
    prog = os.path.basename(sys.argv[0]) or "python"
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


class StopSignals:
    """Install at the start of a training process; `arm(world_size)` once the process group exists."""

    def __init__(self, watch_launcher: bool = False):
        """watch_launcher: also stop when the process that started this one is gone (a spawn parent or
        torchrun killed outright), checked every second. Not for a process started from a shell, whose
        exit (nohup, a closed terminal) must not stop the run."""
        self.received = 0  # the first stop signal this process got (0: none)
        self.reason = ""  # what rank 0 says stopped the run
        self.signum = 0  # the signal all ranks agreed to stop on (0: not agreed)
        self.armed = False
        self._group, self._work, self._flag = None, None, torch.zeros(1, dtype=torch.int32)
        self._launcher = os.getppid() if watch_launcher else None
        self._deadline = None
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

    def arm(self, world_size: int) -> None:
        """From now on a signal waits for the next agreed step; call on every rank at the same point."""
        if world_size > 1:  # a gloo group of its own: CPU tensors, no device sync, no mix with DDP's traffic
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GRACE_S * 4))
        self.armed = True

    def agreed(self) -> bool:
        """True once every rank knows of a stop signal. Call once per step, at the same steps on every
        rank: it reads the flags all-reduced at the previous call and starts the next all-reduce."""
        if self._settled_locally():
            return bool(self.signum)
        self.signum = self._in_flight()
        if self.signum:
            return True
        self._flag.fill_(self.received)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def agree_now(self) -> bool:
        """True on every rank iff some rank got a stop signal by now: the all-reduce in flight is waited for,
        then one more, blocking (between epochs, where a step's worth of delay would cost an evaluation)."""
        if self._settled_locally():
            return bool(self.signum)
        self._flag.fill_(max(self.received, self._in_flight()))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        self.signum = int(self._flag.item())
        return bool(self.signum)

    def _settled_locally(self) -> bool:
        """Whether no all-reduce is needed: the ranks agreed already, or a world of one agrees with itself."""
        if not self.signum and self._group is None:
            self.signum = self.received
        return bool(self.signum) or self._group is None

    def _in_flight(self) -> int:
        """Waits for the all-reduce the last agreed() started: the largest signal any rank had then (0: none)."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._flag.item())

    def finish_stopped_run(self, *, epoch: int, step: int, steps: int, path: str, is_main: bool) -> int:
        """After the checkpoint of the agreed step: wait until every rank is here (so none exits while rank 0
        still writes), rank 0 says what stopped the run and where it continues, and on SIGUSR1 under SLURM
        requeues the job. Returns the exit status, 128 + the signal's number as the shell has it."""
        if self._group is not None:
            dist.barrier(group=self._group)
        if is_main:
            why = self.reason if self.reason == _LAUNCHER_GONE else self.name
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
            if self._deadline and time.monotonic() > self._deadline:
                report(f"the run did not reach a step boundary within {GRACE_S} s of {self.reason} "
                       "(a rank stuck or a step slower than that); exiting without a new checkpoint, "
                       "the last one is kept")
                for child in multiprocessing.active_children():  # DataLoader workers: none left behind
                    child.kill()
                os._exit(128 + self.received)

    def _request(self, signum: int, reason: str) -> None:
        if self.received:
            return  # Ctrl-C reaches a process twice (terminal and launcher), and spawn's join repeats it
        if self._launcher is not None and os.getppid() != self._launcher:
            reason = _LAUNCHER_GONE  # spawn's children get SIGINT when their parent dies
        self.received, self.reason = int(signum), reason
        if not self.armed:  # starting up: nothing to save yet, nothing to wait for
            if os.environ.get("RANK", "0") == "0":
                _say(f"stopped by {reason} while starting; nothing was trained, no checkpoint written")
            os._exit(128 + signum)
        self._deadline = time.monotonic() + GRACE_S


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


@contextlib.contextmanager
def forwarded_to_children():
    """In a process that starts the ranks itself (mp.spawn): pass each stop signal on to them and keep
    waiting, so that the ranks save and exit before the parent does (a killed parent orphans them).
    A rank still importing when the signal comes dies of it: then this says so and exits as it would."""
    forwarded = []

    def forward(signum, _frame):
        forwarded.append(signum)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
    previous = {signum: signal.signal(signum, forward) for signum in SIGNALS}
    try:
        yield
    except torch.multiprocessing.ProcessExitedException as error:
        if not forwarded or error.exit_code != -forwarded[0]:
            raise
        _say(f"stopped by {signal.Signals(forwarded[0]).name} while starting; nothing was trained, "
             "no checkpoint written")
        sys.exit(128 + forwarded[0])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
