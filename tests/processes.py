"""Training commands started as a user starts them, read line by line, and the processes they leave; the two hosts
(network namespaces) that the tests across machines run them on."""
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from script_runs import ROOT, subprocess_env

from benchmarks import launched
from benchmarks.launched import Launched
from examples.local_processes import alive, process_tree
from utils.errors import UsageError


def rank_process(launcher_pid: int, rank: int) -> int:
    """The worker of `rank` among a torchrun agent's processes (torchrun exports RANK to each)."""
    for pid in process_tree(launcher_pid):
        try:
            if f"RANK={rank}".encode() in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


class Machine(Launched):
    """benchmarks.launched's Launched (a launcher on one host, its lines kept with the time each arrived), failing the
    test where it would raise TimeoutError."""

    WAIT_S = launched.WAIT_S

    def wait_for(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match]:
        try:
            return super().wait_for(pattern, after)
        except TimeoutError as error:
            pytest.fail(str(error))

    def ended(self) -> tuple[int, float]:
        try:
            return super().ended()
        except TimeoutError as error:
            pytest.fail(str(error))


class Run:
    """A training command started as a user would, in a session of its own (so that a test can signal
    the whole process group, as Ctrl-C does), read line by line."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env or subprocess_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output}"
        raise AssertionError(f"the run ended before {text!r}:\n{self.output}")

    def finish(self, timeout: float = 60, started: list[int] = ()) -> tuple[int, float]:
        """Wait for the launcher and every process it started; returns (exit status, seconds until the
        last of them was gone). A process still running after `timeout` fails the test and is killed.
        `started`: processes seen before a launcher was killed outright (its children are then orphans,
        no longer in its tree; one closes its end of the output pipe a moment before it is gone)."""
        pids = process_tree(self.proc.pid) + list(started)
        start = time.monotonic()
        try:
            self.lines += self.proc.stdout.readlines()
            self.proc.wait(timeout)
            while alive(pids) and time.monotonic() - start < timeout:
                time.sleep(0.05)
            left = alive(pids)
            assert not left, f"processes left running: {left}\n{self.output}"
        finally:
            for pid in alive(pids):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode, time.monotonic() - start

    @property
    def text(self) -> str:
        """Everything the run printed so far: what a test searches (a stop's torchrun tracebacks can be longer
        than the tail below)."""
        return "".join(self.lines)

    @property
    def output(self) -> str:
        """The last 6000 characters printed: what a failing assertion shows."""
        return self.text[-6000:]


@dataclass
class Clocked:
    """A command run to its end with its stderr lines stamped as they arrived: the seconds from a line to the exit
    are what a test about an error's aftermath bounds, whatever Python, torch and the launcher took to start."""
    result: subprocess.CompletedProcess
    stderr_lines: list[tuple[float, str]]  # (time.monotonic() when the line arrived, the line)
    ended: float  # time.monotonic() when the command had exited

    def seconds_after(self, text: str) -> float:
        """From the first stderr line holding `text` to the command's exit; the test fails if no line holds it."""
        for arrived, line in self.stderr_lines:
            if text in line:
                return self.ended - arrived
        raise AssertionError(f"no {text!r} on stderr:\n{self.result.stderr[-3000:]}")


def run_clocked(cmd: list[str], timeout: float = 120) -> Clocked:
    """`cmd` as script_runs.run runs it (stdout and stderr apart), every stderr line stamped on arrival; a command
    still running after `timeout` is killed with its whole session and fails the test."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, stderr_lines = [], []
    readers = [threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True),
               threading.Thread(target=lambda: stderr_lines.extend((time.monotonic(), line) for line in proc.stderr),
                                daemon=True)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    ended = time.monotonic()
    for reader in readers:
        reader.join(10)
    stderr = "".join(line for _, line in stderr_lines)
    return Clocked(subprocess.CompletedProcess(cmd, proc.returncode, "".join(stdout), stderr), stderr_lines, ended)


def processes_naming(path) -> list[str]:
    """The pids of the processes whose command line names `path` (a test's own folder: what it started there)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except OSError:
            pass
    return found


@contextlib.contextmanager
def two_hosts(prefix: str = "ddp-test", named: bool = False):
    """benchmarks.network's two hosts: network namespaces joined by a veth pair, host i at network.ADDRESSES[i] on
    its interface network.INTERFACES[i] (named: with hostnames of their own), removed afterwards with every process in
    them; skipped without root, iproute2, tc and taskset (and unshare, named)."""
    from benchmarks import network  # only where hosts are made: the benchmark's modules take a while to import
    hosts = network.TwoHosts(prefix, named)
    try:
        hosts.__enter__()
    except UsageError as why:
        pytest.skip(str(why))
    try:
        yield hosts
    finally:
        hosts.__exit__()


def interrupted(proc: subprocess.Popen, starts: str, timeout: float) -> tuple[str, str]:
    """Ctrl-C's SIGINT to `proc` (a benchmark in a session of its own, stdout and stderr piped) once a line of its
    stdout starts with `starts`; then its (stdout, stderr). Still running `timeout` s later: killed with its session."""
    try:
        for line in proc.stdout:
            if line.startswith(starts):
                break
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends it (the runs it starts have sessions of their own)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
