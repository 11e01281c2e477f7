"""The scripts run as a user runs them: in subprocesses through their real launchers (launcher, run, check) or
main(argv) in pytest's own process (run_main), and what a run writes (read_metrics, load_checkpoint)."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Tiny synthetic runs: 3 optimizer steps of a global batch of 16, a test set that 2 and 3 do not divide.
TINY = ["--dataset", "synthetic", "--train-samples", "48", "--test-samples", "21", "--batch-size", "16",
        "--epochs", "1", "--workers", "0", "--print-freq", "1"]


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    # CPU tests stay on the CPU on a machine with GPUs too; GPU tests pass CUDA_VISIBLE_DEVICES
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


def launcher(kind: str, script: str, nprocs: int = 2) -> list[str]:
    """The command line that starts `script` the way a user would."""
    path = str(ROOT / script)
    if kind == "python":
        return [sys.executable, path]
    if kind == "spawn":
        return [sys.executable, path, "--nprocs", str(nprocs)]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", path]
    if kind == "launch":  # the deprecated launcher, which passes --local-rank=N to the script
        return [sys.executable, "-m", "torch.distributed.launch", "--standalone", f"--nproc_per_node={nprocs}",
                path]
    raise ValueError(kind)


def run(cmd: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def run_main(main, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """main(argv) in pytest's own process, reported as `run` reports a subprocess: for inputs refused before
    any process group forms, where a subprocess would spend its 3 seconds importing torch. The stop-signal
    handlers a script installs are undone, and so is its note that its ranks had met."""
    from utils import errors
    environment = dict(os.environ)  # launch.read_and_fill_environment sets MASTER_ADDR/MASTER_PORT for a world of one
    try:
        with stop_handlers_undone():
            main(argv)
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        errors._ranks_met = False  # what SafetyNet.running noted of this process: the next main() starts anew
    said = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, said.out, said.err)


@contextlib.contextmanager
def stop_handlers_undone():
    """Within: code that makes a SafetyNet (its SIGTERM, SIGINT and SIGUSR1 handlers, its wakeup fd); after: pytest's
    own handlers again."""
    import signal
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(-1)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def load_checkpoint(output_dir: Path) -> dict:
    return torch.load(output_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
