"""DataLoader worker processes that leave the stop signals (SIGTERM, SIGINT, SIGUSR1) to their rank: a
Ctrl-C or scancel reaches the whole process group, workers too, and a worker killed by it would fail its
rank's next batch instead of letting the rank stop at an agreed step (safety_net.stopping)."""
import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class WorkersForkedWithSignalsHeld:
    """A DataLoader whose worker processes are forked with the stop signals blocked, so that a signal to
    the whole process group at that moment cannot kill a worker before its worker_init_fn (below) runs;
    the rank itself still gets the signal at once, in another of its threads."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):  # .dataset, .batch_size, ...: the DataLoader's own
        return getattr(self.loader, name)

    def __iter__(self):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            return iter(self.loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def leave_stop_signals_to_the_rank(_worker_id: int) -> None:
    """DataLoader's worker_init_fn: its workers leave stop signals to their rank (a signal to the whole
    process group, as Ctrl-C or scancel send, would otherwise kill them and fail the rank's next batch).
    SIGTERM still ends a worker when its own rank sends it: DataLoader terminates workers that are slow
    to shut down."""
    for signum in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # blocked already if forked as above
    rank = os.getppid()

    def sigterm_from_the_rank_only():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
            pass
        os._exit(128 + signal.SIGTERM)
    threading.Thread(target=sigterm_from_the_rank_only, daemon=True).start()
