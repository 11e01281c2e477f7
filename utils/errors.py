"""Bad input is reported as one line on stderr with exit status 2, never as a traceback."""
import contextlib
import os
import sys


class UsageError(Exception):
    """Input the user can fix (a flag, a missing file, a busy port): one line, exit status 2."""


def report(message: str) -> None:
    """Print one error line; under a launcher only local rank 0 of each machine speaks, so the N ranks
    of a machine do not repeat it (and a machine that cannot reach the others still says why)."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        prog = os.path.basename(sys.argv[0]) or "python"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_usage_error():
    """Turn a UsageError raised inside the block into its line on stderr and exit status 2."""
    try:
        yield
    except UsageError as error:
        report(str(error))
        sys.exit(2)
