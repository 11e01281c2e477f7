"""A launcher started on one host, read line by line as it runs, each line with the time it came: what
benchmarks.link_faults and the tests across hosts act on (a cut when a step's line comes). No torch: light to import."""
import contextlib
import os
import re
import signal
import subprocess
import threading
import time

from benchmarks.harness import ROOT
from examples.local_processes import process_tree

STEP = re.compile(r"^epoch 1/1 step (\d+)/\d+ loss")  # a progress line of an epoch of one
WAIT_S = 150  # the longest any stage may take on a slow, shared machine


class Launched:
    """A launcher on one host (a command in its namespace), its output lines (stdout and stderr) kept with the time
    each arrived (time.monotonic()) by a thread of its own, so that the caller can act while it runs."""

    def __init__(self, cmd: list[str], env: dict):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match]:
        """The first line past time `after` that matches, and when it came; TimeoutError after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if when > after and (match := pattern.search(line)):
                    return when, match
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise TimeoutError(f"no line like {pattern.pattern!r} within {WAIT_S} s:\n{self.text()[-4000:]}")

    def ended(self) -> tuple[int, float]:
        """(exit status, when it exited) once the launcher exits; TimeoutError after WAIT_S."""
        try:
            status = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running after {WAIT_S} s:\n{self.text()[-4000:]}") from None
        when = time.monotonic()
        self.reader.join(timeout=10)
        return status, when

    def kill(self) -> list[int]:
        """SIGKILL to the launcher and every process below it, as a machine that is switched off."""
        pids = process_tree(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def steps(self) -> dict[int, float]:
        """{step: when its progress line came} of an epoch of one."""
        return {int(match[1]): when for when, line in self.lines if (match := STEP.search(line))}

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)
