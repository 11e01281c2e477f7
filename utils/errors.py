"""Errors the user can act on are reported as one line on stderr, never as a traceback."""
import contextlib
import json
import os
import signal
import sys
import time
import traceback

import torch.distributed as dist
from tqdm import tqdm


class OneLineError(Exception):
    """An error whose message says all the user needs: exit_on_error prints that one line, no traceback, and
    exits with `exit_status` (the safety net's Diverged and StorageError are others)."""

    exit_status = 1


class UsageError(OneLineError):
    """Input the user can fix (a flag, a missing file, a busy port): one line, exit status 2."""

    exit_status = 2


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's first line, cut at `limit` characters (its type's name when it has no message)."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def local_rank() -> str:  # this process's rank on its machine: torchrun's LOCAL_RANK, srun's SLURM_LOCALID, or "0"
    return os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))


def print_line(message: str, *, error: bool = True, local_rank_0_only: bool = False, rank_named: bool = False):
    """The collection's one printer of a line for the user: "<script>: error: <message>" on stderr (error=False: no
    "error: "), above rank 0's progress bar where stderr is a terminal. local_rank_0_only: under a launcher only
    local rank 0 of each machine prints it, so the N ranks of a machine do not repeat what all of them know (and a
    machine that cannot reach the others still says why). rank_named: "rank R: " before the message, when a
    launcher started this process (RANK is set): what only this rank knows."""
    if local_rank_0_only and local_rank() != "0":
        return
    rank = f"rank {os.environ['RANK']}: " if rank_named and "RANK" in os.environ else ""
    line = f"{os.path.basename(sys.argv[0]) or 'python'}: {'error: ' if error else ''}{rank}{message}"
    if sys.stderr.isatty():
        tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def worker_lines(error: BaseException) -> list[str]:
    """The lines of an error a DataLoader worker raised ("Caught ValueError in DataLoader worker process 0.",
    then the worker's own traceback, its last line the original error); [] for any other error."""
    text = str(error).strip()
    return text.splitlines() if text.startswith("Caught ") and "worker" in text else []


def missing_file_line(error: OSError) -> str:
    """The one line of a file that is missing or cannot be read; from a DataLoader worker, whose message
    is "Caught FileNotFoundError in DataLoader worker process 0." and its traceback, the original line."""
    if lines := worker_lines(error):
        return lines[-1].split(": ", 1)[-1][:200]
    if error.filename and error.strerror:
        return f"{error.strerror}: {error.filename}"
    return first_line(error, 200)


_ranks_met = False  # this process joined a process group: its ranks all reached the same line (note_ranks_met)


def note_ranks_met() -> None:
    """Say that the ranks have met (dist.init_process_group returned): from then on an error every rank meets exits at
    once on every rank, even after dist.destroy_process_group (SafetyNet.running calls this)."""
    global _ranks_met
    _ranks_met = True


def exit_with_line(message: str, status: int):
    """Exit on an error every rank meets, said once a machine: local rank 0 prints its line, the others nothing.
    Before the ranks have met, the others let it exit first: torchrun stops every rank once one exits, and local rank
    0 may be seconds behind them (importing torch, say), or nobody would say why. They wait at most 30 s, and a stop
    signal (the launcher's, once local rank 0 has exited) ends the wait at once. After the ranks have met they all
    reached this line together: no wait."""
    print_line(message, local_rank_0_only=True)
    if local_rank() != "0" and not (_ranks_met or (dist.is_available() and dist.is_initialized())):
        for signum in (signal.SIGTERM, signal.SIGINT):  # not the safety net's stop handler: torchrun's SIGTERM ends it
            signal.signal(signum, signal.SIG_DFL)
        time.sleep(30.0)
    tell_torchrun(status)
    exit_process(status)


def tell_torchrun(status: int) -> None:
    """Under torchrun, whose report after a rank's non-zero exit (ChildFailedError) ends with what the rank's error
    file (TORCHELASTIC_ERROR_FILE) holds, else with a link to torch's docs: that file, in the format of torch's
    ErrorHandler, holding a pointer to this script's line above the report (not the line again: it is said once)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        said = f"exit status {status}: {os.path.basename(sys.argv[0])} said why in one line above this report"
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": said, "extraInfo": {"py_callstack": said,
                                                                  "timestamp": str(int(time.time()))}}}, f)


def exit_process(status: int):
    """Exit with status; DataLoader's SIGCHLD handler is removed first, or it would report the workers that
    the exit itself stops ("DataLoader worker exited unexpectedly", one traceback each)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.exit(status)


@contextlib.contextmanager
def exit_on_error(crash_report=None):
    """Turn a OneLineError (a UsageError, SafetyNet's Diverged, ...) raised inside the block into its line on stderr
    and its exit status; a file that is missing or cannot be read (your datasets() reading --data-dir, say) and a
    process group that cannot form (dist.init_process_group fails: a busy port, a rank that never came) are
    UsageErrors too. Any other exception is a crash: `crash_report(error)` reports it and exits (the safety net's
    SafetyNet.report_crash: one line, the traceback in a file); without one, Python prints the traceback, exit
    status 1."""
    try:
        yield
    except OneLineError as error:
        exit_with_line(str(error), error.exit_status)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as error:
        # your datasets(), say: a path only this rank may lack
        print_line(f"{missing_file_line(error)} (check --data-dir and the paths given)", rank_named=True)
        tell_torchrun(UsageError.exit_status)
        exit_process(UsageError.exit_status)
    except Exception as error:  # a rank that fails ends the run: the launcher (torchrun, spawn) stops the others
        if _raised_in(error, "init_process_group", "torchrun_restart_store"):  # the ranks never met
            exit_with_line(rendezvous_line(error), UsageError.exit_status)
        if crash_report is None:
            raise
        crash_report(error)


def _raised_in(error: BaseException, *functions: str) -> bool:
    return any(frame.name in functions for frame in traceback.extract_tb(error.__traceback__))


def rendezvous_line(error: BaseException) -> str:
    """Why the process group did not form, in one line: where its ranks were to meet (MASTER_ADDR:MASTER_PORT)
    and the likeliest cause, from the words of torch's error."""
    where, text = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}", first_line(error, 120)
    if "EADDRINUSE" in str(error) or "failed to listen" in text:
        return f"cannot host the rendezvous on {where} ({text}); choose another --port"
    if "trying to connect" in text or "failed to connect" in text:  # refused; no route, or no answer, to it
        return (f"could not reach the rendezvous at {where} within --dist-timeout ({text}); "
                "is node 0 started, are the address and port right and the port open?")
    return (f"not all processes joined at {where} within --dist-timeout ({text}); "
            "is every machine started, with the same --nnodes and --nprocs?")
