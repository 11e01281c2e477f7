"""Errors the user can act on are reported as one line on stderr, never as a traceback."""
import contextlib
import os
import sys

import torch.distributed


class UsageError(Exception):
    """Input the user can fix (a flag, a missing file, a busy port): one line, exit status 2."""

    exit_status = 2


class Diverged(Exception):
    """The training loss or the weights became NaN or infinite: one line, exit status 1, and the
    last checkpoint is not overwritten."""

    exit_status = 1


class StorageError(Exception):
    """A file could not be written (a full disk, an I/O error, a read-only file system): one line, exit
    status 1; the previous checkpoint is intact."""

    exit_status = 1


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's first line, cut at `limit` characters (its type's name when it has no message)."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def report(message: str) -> None:
    """Print one error line; under a launcher only local rank 0 of each machine speaks, so the N ranks
    of a machine do not repeat it (and a machine that cannot reach the others still says why)."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        prog = os.path.basename(sys.argv[0]) or "python"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def missing_file_line(error: OSError) -> str:
    """The one line of a file that is missing or cannot be read; from a DataLoader worker, whose message
    is "Caught FileNotFoundError in DataLoader worker process 0." and its traceback, the original line."""
    text = str(error).strip()
    if text.startswith("Caught ") and "worker" in text:
        return text.splitlines()[-1].split(": ", 1)[-1][:200]
    if error.filename and error.strerror:
        return f"{error.strerror}: {error.filename}"
    return first_line(error, 200)


@contextlib.contextmanager
def exit_on_error():
    """Turn a UsageError, Diverged or StorageError raised inside the block into its line on stderr and exit status;
    a file that is missing or cannot be read (your datasets() reading --data-dir, say) and a process group that
    times out waiting for its ranks are UsageErrors too."""
    try:
        yield
    except (UsageError, Diverged, StorageError) as error:
        report(str(error))
        sys.exit(error.exit_status)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as error:
        report(f"{missing_file_line(error)} (check --data-dir and the paths given)")  # your datasets(), say
        sys.exit(UsageError.exit_status)
    except torch.distributed.DistStoreError as error:  # in init_process_group: a rank that never came
        report(f"not all processes joined within --dist-timeout ({str(error).splitlines()[0][:120]}); "
               "is every machine started, with the same --nnodes and --nprocs?")
        sys.exit(UsageError.exit_status)
