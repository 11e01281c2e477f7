"""Errors the user can act on are reported as one line on stderr, never as a traceback."""
import contextlib
import os
import sys


class UsageError(Exception):
    """Input the user can fix (a flag, a missing file, a busy port): one line, exit status 2."""

    exit_status = 2


class Diverged(Exception):
    """The training loss or the weights became NaN or infinite: one line, exit status 1, and the
    last checkpoint is not overwritten."""

    exit_status = 1


def report(message: str) -> None:
    """Print one error line; under a launcher only local rank 0 of each machine speaks, so the N ranks
    of a machine do not repeat it (and a machine that cannot reach the others still says why)."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        prog = os.path.basename(sys.argv[0]) or "python"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_error():
    """Turn a UsageError or Diverged raised inside the block into its line on stderr and exit status."""
    try:
        yield
    except (UsageError, Diverged) as error:
        report(str(error))
        sys.exit(error.exit_status)
