"""The processes of this machine, read from Linux's /proc: those below a process, those of a process group or a
session, those started with a value in their environment, and which are still running. Used by
live_recovery_demo.py (beside it), the benchmarks, the tests and the GPU check."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Process:
    pid: int
    state: str  # "R" running, "S" sleeping, ..., "Z" a zombie: ended, waiting for its parent to reap it
    parent: int
    group: int
    session: int


def stat(pid: int) -> Process | None:
    """The process `pid` from /proc/<pid>/stat, or None where there is none (it has ended and been reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            # after the command name, which is in parentheses and may itself hold spaces and ")"
            state, parent, group, session = file.read().rsplit(")", 1)[1].split()[:4]
        return Process(pid, state, int(parent), int(group), int(session))
    except (OSError, IndexError, ValueError):
        return None


def every_process() -> list[Process]:
    """Every process now (one that ends while they are read is left out)."""
    found = (stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit())
    return [process for process in found if process is not None]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (its children, theirs, and so on), each after its parent; zombies included."""
    children = {}
    for process in every_process():
        children.setdefault(process.parent, []).append(process.pid)
    found, level = [], [pid]
    while level:
        level = [child for parent in level for child in children.get(parent, [])]
        found += level
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, `pid` first."""
    return [pid, *descendants(pid)]


def alive(pids: list[int]) -> list[int]:
    """Those of pids still running (a zombie waiting for its parent to reap it counts as gone)."""
    return [pid for pid in pids if (process := stat(pid)) is not None and process.state != "Z"]


def carrying(variable: str, value: str) -> list[int]:
    """The live processes whose environment, as they were started with it, holds variable=value: all a program started
    with that value in its environment and everything they started in turn (each inherits it unless
    started with an environment of its own), whichever session they
    are in and wherever their parent is."""
    wanted = f"{variable}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit():
                with open(f"/proc/{entry}/environ", "rb") as file:
                    if wanted in file.read().split(b"\0"):
                        found.append(int(entry))
        except OSError:  # ended meanwhile, or another user's
            pass
    return alive(found)


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a zombie counts as gone)."""
    return [process.pid for process in every_process() if process.group == pgid and process.state != "Z"]


def session_members(sid: int) -> list[int]:
    """The processes of session `sid`, zombies included."""
    return [process.pid for process in every_process() if process.session == sid]
