"""A torchft lighthouse of one's own, started as a process on this machine: for live_recovery_demo.py (beside it), the
live recovery tests and the benchmark's live recovery row."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request


def program() -> str | None:
    """torchft_lighthouse beside this Python (a virtual environment's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")


def free_port() -> int:
    """A port nobody listens on now (another process may take it before the lighthouse does)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(port: int, min_replicas: int, heartbeat_timeout_ms: int = 5000, output=subprocess.DEVNULL,
          new_session: bool = False) -> subprocess.Popen:
    """torchft_lighthouse on `port` of every address: it forms no quorum of fewer than `min_replicas` replica groups,
    and counts a group whose heartbeats stop for `heartbeat_timeout_ms` as dead. Its output (stdout and stderr) goes
    to `output`; with `new_session`, a Ctrl-C at the terminal does not reach it."""
    return subprocess.Popen([program(), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)], stdout=output,
                            stderr=subprocess.STDOUT, start_new_session=new_session)


def address(port: int) -> str:
    """What the replica groups' --lighthouse takes."""
    return f"http://localhost:{port}"


def answers(lighthouse: subprocess.Popen, port: int, wait_s: float) -> bool:
    """Whether the lighthouse answers on its status page within wait_s (a group started before that refuses to
    start; on a loaded machine the lighthouse takes seconds); False at once if it has ended."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            urllib.request.urlopen(address(port) + "/status", timeout=5).close()
            return True
        except OSError:
            if lighthouse.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def stop(lighthouse: subprocess.Popen) -> None:
    lighthouse.kill()
    lighthouse.wait()


@contextlib.contextmanager
def on_a_free_port(min_replicas: int, heartbeat_timeout_ms: int = 5000, wait_s: float = 60):
    """A lighthouse on a free port, yielded as its address once it answers, stopped at exit. One that does not answer
    within wait_s is a RuntimeError."""
    port = free_port()
    lighthouse = start(port, min_replicas, heartbeat_timeout_ms)
    try:
        if not answers(lighthouse, port, wait_s):
            raise RuntimeError(f"the lighthouse on port {port} did not start")
        yield address(port)
    finally:
        stop(lighthouse)
