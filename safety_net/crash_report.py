"""A crash in one line: an exception nobody expected (a bug, a sample that cannot be decoded) ends its rank with
one line on stderr, its whole traceback in a file that the line names, instead of N tracebacks interleaved; the
scripts hand `report` to utils.errors.exit_on_error (as SafetyNet.report_crash)."""
import os
import re
import sys
import sysconfig
import tempfile
import traceback

import torch.distributed

from utils.errors import exit_process, first_line, print_line, worker_lines

# gloo's words when the other end of a connection is gone: a rank that failed, or was killed
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# gloo's words when a collective's peer sent nothing for the process group's timeout (or a later collective on the
# connection that timeout closed): a rank hangs, its machine stopped, or the network between the machines is down (no
# reset comes over a link that is down)
_NO_ANSWER = re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation"
                        r"|Application timeout caused pair closure")
_TORCH = os.path.dirname(os.path.dirname(torch.distributed.__file__))  # torch's own files: not where a user looks
# installed packages and Python's own modules: what is left of a traceback is the user's (a script, a helper)
_INSTALLED = tuple({sysconfig.get_paths()[kind] + os.sep for kind in ("purelib", "platlib", "stdlib")})


def report(error: BaseException) -> None:
    """Exit status 1, after crash_line from the rank that raised `error`; a rank whose collective failed because
    another rank left exits quietly (that rank, or the launcher, says why)."""
    if not lost_a_peer(error):
        print_line(crash_line(error), rank_named=True)
    exit_process(1)


def lost_a_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank left the process group (it says why itself)."""
    return isinstance(error, torch.distributed.DistNetworkError) or any(w in str(error) for w in _PEER_GONE)


def _shown(path: str) -> str:
    """A path as a user reads it: relative below the current directory, else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path


def crash_line(error: BaseException) -> str:
    """An unexpected exception as one line: its type, message and where it was raised (a collective that timed out:
    which, called where, and the flag that sets the wait); the whole traceback goes to a file in the temporary
    directory, which the line names. An exception raised in a DataLoader worker ("Caught ValueError in DataLoader
    worker process 0." and the worker's traceback) is told by the worker's own last line and place."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{_shown(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    what = f"{type(error).__name__}: {first_line(error, 200)}"
    if lines := worker_lines(error):  # the worker's traceback is in the message
        what = lines[-1][:200]
        places = [line.strip() for line in lines if line.strip().startswith('File "')]
        if places:  # 'File "/path/data.py", line 346, in __getitem__'
            filename, line, function = places[-1][6:].split(", ", 2)
            filename = _shown(filename.strip('"'))
            where = f"{filename}:{line.removeprefix('line ')} {function}"
    elif waited := _NO_ANSWER.search(str(error)):
        what, where = no_answer(int(waited[1]) / 1000 if waited[1] else None, frames)
    elif isinstance(error, TimeoutError) and any(frame.name == "_async_quorum" for frame in frames):
        what, where = ("no quorum from the torchft lighthouse within --dist-timeout: it, or the network to it, is "
                       "down; torchft 0.2.0 ends this replica group here: once the lighthouse answers, the same "
                       "command heals it from a live group"), _our_line(frames)
    path = os.path.join(tempfile.gettempdir(), f"{os.path.basename(sys.argv[0]) or 'python'}-"
                                               f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.traceback")
    try:
        with open(path, "w") as f:
            f.writelines(traceback.format_exception(error))
    except OSError:
        traceback.print_exception(error)
        return f"{what} ({where})"
    return f"{what} ({where}; the traceback is in {path})"


def no_answer(seconds: float | None, frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(what, where) of a collective that no other rank answered for `seconds` (None: the process group's timeout,
    not said): torch's function (all_reduce, barrier, ...) and the line outside torch that called it, for the user's
    words."""
    called = next((f"DDP's {frame.name}" if frame.filename.endswith("parallel/distributed.py") else frame.name
                   for frame in reversed(frames) if frame.filename.startswith(_TORCH)
                   and (frame.filename.endswith(("distributed_c10d.py", "parallel/distributed.py")))), "a collective")
    waited = f"for {seconds:g} s" if seconds is not None else "within --dist-timeout"
    return (f"no answer from another rank {waited} in {called} (--dist-timeout sets the wait): that rank "
            "hangs, its machine stopped, or the network between the machines is down; once all can meet again, the "
            "same command continues from the last checkpoint"), _our_line(frames)


def _our_line(frames: list[traceback.FrameSummary]) -> str:
    """The innermost line of the traceback outside installed packages (a script's, a helper's): where a user looks."""
    ours = [frame for frame in frames if not frame.filename.startswith("<")  # "<frozen runpy>"
            and not os.path.abspath(frame.filename).startswith(_INSTALLED)]
    return f"{_shown(ours[-1].filename)}:{ours[-1].lineno} in {ours[-1].name}" if ours else ""
