"""What every benchmark shares, each written once: where the repository is, the commit and the hardware its files
name, how a row's script is launched, the child processes it starts and stops (a benchmark stopped with Ctrl-C,
SIGTERM or SIGHUP leaves none running), progress lines with the time left, Markdown tables, files replaced whole.
Light to import: torch only inside the functions that need it."""
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from examples import own_lighthouse
from examples.local_processes import carrying

ROOT = Path(__file__).resolve().parent.parent
EPOCH_IMAGES = 50_000  # every "s per epoch" figure: a CIFAR-100 training epoch
RUN_MARK = "DDP_BENCHMARK_RUN"  # run_stoppable's mark in the environment of all a run starts
_runs = itertools.count()


def git_commit() -> str:
    """The commit checked out here, with "+changes" when the tree differs from it; "unknown" without git (a copy
    of the tree without .git: give --commit)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")

def processor() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows."""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def hardware(device: str, nprocs: int) -> str:
    """The line every benchmark's files open with: the devices and torch's version."""
    import torch
    if device == "cuda":
        return f"{nprocs} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{os.cpu_count()} cores of {processor()}, no GPU, torch {torch.__version__}"


def threads_env(processes: int) -> dict:
    """On the CPU each process gets an equal share of the cores, so every row uses all of them."""
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}

def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None

@dataclass
class Row:
    name: str
    script: str
    start: str  # python (one process), torchrun, spawn, side by side (N bare-step processes, no process group), or
    # replica groups (a torchft lighthouse and N torchruns of one process: distributed_live_recovery.py)
    flags: list = field(default_factory=list)
    table: str = "method"  # method, technique or peer
    amp: str | None = None  # the autocast dtype, which picks the ideal it is compared with
    gpu_only: bool = False
    full_only: bool = False  # left out of --quick
    needs: str | None = None  # an optional package the row imports: left out, saying so, where it is missing

def launch_target(script: str, root: Path = ROOT) -> list[str]:
    """What torchrun is told to run: a script at the top by its path under `root`; the peers, which live in
    benchmarks/ and import utils, as modules (-m), found from the repository's root (the working directory)."""
    if script.startswith("benchmarks/"):
        return ["-m", script.removesuffix(".py").replace("/", ".")]
    return [str(root / script)]


def launch(row: Row, nprocs: int) -> list[str]:
    path = str(ROOT / row.script)
    if row.start in ("torchrun", "replica groups"):  # replica groups: one process per group's torchrun
        per_launcher = 1 if row.start == "replica groups" else nprocs
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_launcher}",
                *launch_target(row.script)]
    return [sys.executable, path] + (["--nprocs", str(nprocs)] if row.start == "spawn" else [])


def run_stoppable(cmd: list[str], env: dict | None, limit_s: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) from the repository's root, its output captured. When the benchmark is stopped
    meanwhile (Ctrl-C, SIGTERM), or the run is still going after `limit_s` seconds (its result then has exit status
    124), the row's launcher gets SIGTERM, which it passes to its ranks, and up to 30 s to exit (then SIGKILL), and
    every process it started that is still alive is killed: no rank outlives the benchmark or writes into its row's
    directory once removed. The launcher runs in a session of its own, so that SIGTERM is the one signal it gets: a
    terminal's Ctrl-C reaching torchrun too would cut short its wait for its ranks."""
    # What it started is found by a mark in their environment, not as the launcher's children: torchrun starts each
    # rank in a session of its own, and a rank it was starting as the signal came is not in any list of its own
    mark = f"{os.getpid()}-{next(_runs)}"
    try:
        env = {**(os.environ if env is None else env), RUN_MARK: mark}
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                stdout, stderr = proc.communicate(timeout=limit_s)
            except (subprocess.TimeoutExpired, KeyboardInterrupt) as stopped:
                proc.terminate()
                try:  # communicate, not wait: its output is read meanwhile, so that a full pipe cannot hold it
                    stdout, stderr = proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                if isinstance(stopped, KeyboardInterrupt):
                    raise
                return subprocess.CompletedProcess(cmd, 124, stdout, stderr)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    finally:  # also when the stop came while Popen was starting the launcher (before it returned its handle)
        deadline = time.monotonic() + 10
        while (left := carrying(RUN_MARK, mark)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def run_replica_groups(cmd: list[str], groups: int, env: dict) -> subprocess.CompletedProcess:
    """`cmd` (distributed_live_recovery.py under torchrun) as `groups` replica groups of one process each, side by
    side, under a torchft lighthouse of their own on a free port. It forms no quorum before every group has joined:
    with fewer, the first group could train ahead alone and a late one heal past the epochs timed. A stop of the
    benchmark (Ctrl-C, SIGTERM) stops them as run_stoppable stops its launcher. The first group that failed gives
    the result's status and stderr."""
    try:
        with own_lighthouse.on_a_free_port(min_replicas=groups) as address:
            errors = [tempfile.TemporaryFile("w+") for _ in range(groups)]
            procs = [subprocess.Popen(cmd + ["--replica-group", str(g), "--replica-groups", str(groups),
                                             "--lighthouse", address], cwd=ROOT, env={**env, "RUST_LOG": "warn"},
                                      stdout=subprocess.DEVNULL, stderr=errors[g], text=True, start_new_session=True)
                     for g in range(groups)]
            try:
                for proc in procs:
                    proc.wait()
            except KeyboardInterrupt:
                stop(procs)
                raise
    except RuntimeError as error:  # the lighthouse did not start: no group was
        return subprocess.CompletedProcess(cmd, 1, "", str(error))
    failed = next((g for g, proc in enumerate(procs) if proc.returncode), 0)
    errors[failed].seek(0)
    said = errors[failed].read()
    for error in errors:
        error.close()
    return subprocess.CompletedProcess(cmd, procs[failed].returncode, "", said)

def why_it_failed(stderr: str) -> str:
    """The line that says why a row's command failed: the script's own one-line error or an exception's last line,
    not the report torchrun prints after it (its last line is a rule of '=')."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if ": error: " in line or (re.match(r"^[\w.]+(Error|Exception)\b", line)
                                                              and "ChildFailedError" not in line)]
    return ((said or lines or ["no output"])[-1])[:200]


def script_and_flags(r: dict) -> str:
    """A row's script and its flags, as the tables show them."""
    return " ".join([r["script"], *r["flags"]])

def stop_as_ctrl_c(signum: int, _frame) -> None:
    """A signal handler: the benchmark stops as on Ctrl-C (KeyboardInterrupt), told which signal it was."""
    raise KeyboardInterrupt(signum)


@contextlib.contextmanager
def stopped_as_ctrl_c():
    """kill -TERM or a closed terminal (SIGHUP) stop the benchmark within as Ctrl-C does (stop_as_ctrl_c); the
    handlers in place before come back at the end."""
    previous = {signum: signal.signal(signum, stop_as_ctrl_c) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def which_stop(stop: KeyboardInterrupt) -> tuple[int, str]:
    """The signal behind a KeyboardInterrupt of stopped_as_ctrl_c (Ctrl-C's SIGINT if none), and its name."""
    signum = stop.args[0] if stop.args else signal.SIGINT
    return signum, "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

def write_whole(out: Path, files: dict[str, str]) -> None:
    """Each file {name: text} in `out` replaced whole (written beside, then renamed over): a run stopped or killed
    meanwhile leaves the previous copy or the new one, never half of one."""
    for name, text in files.items():
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)

def stop(procs: list[subprocess.Popen], grace_s: float = 30) -> None:
    """SIGTERM to each process (a launcher passes it to its ranks, which stop at a step every rank reaches), up to
    grace_s for them all to exit, then SIGKILL to the session of each one left (the benchmarks start their children
    in sessions of their own)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def last_json_lines(commands: list[list[str]], envs: list[dict]) -> list[dict] | None:
    """Each command started at once (the bare step, side by side) and the JSON object its last line printed; None if
    one failed (its error went to stderr). Stopped meanwhile: they are killed, having nothing to keep."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for cmd, env in zip(commands, envs, strict=True)]
    try:
        outputs = [proc.communicate()[0] for proc in procs]
    except KeyboardInterrupt:
        stop(procs, grace_s=0)
        raise
    if any(proc.returncode for proc in procs):
        return None
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def spawn_ranks(target, nprocs: int, *args) -> list:
    """target(rank, nprocs, port, *args) in `nprocs` spawned processes, `port` a free one for their process group;
    what each returned (JSON), in rank order. Stopped (Ctrl-C, SIGTERM): the ranks are ended, then the stop goes on."""
    import torch.multiprocessing as mp

    from utils.spawn import free_port
    with tempfile.TemporaryDirectory() as scratch:
        context = mp.start_processes(_rank_returns, args=(target, nprocs, free_port(), scratch, args), nprocs=nprocs,
                                     join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except KeyboardInterrupt:
            for process in context.processes:
                process.terminate()
            for process in context.processes:
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join()
            raise
        return [json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def _rank_returns(rank: int, target, nprocs: int, port: int, scratch: str, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent ends the ranks (spawn_ranks)
    Path(scratch, f"rank{rank}.json").write_text(json.dumps(target(rank, nprocs, port, *args)))


class Progress:
    """One line per stage done, "[k/n] what it did; about M min left", the time left estimated from the stages done."""

    def __init__(self, stages: int, write=print):
        self.stages, self.finished, self.write, self.started = stages, 0, write, time.perf_counter()

    def done(self, text: str) -> None:
        self.finished += 1
        left = (time.perf_counter() - self.started) / self.finished * (self.stages - self.finished)
        eta = f"; about {left / 60:.0f} min left" if left >= 60 else "; under a minute left" if left else ""
        self.write(f"[{self.finished}/{self.stages}] {text}{eta}")


def stopped_status(stop: KeyboardInterrupt, what: str) -> int:
    """A benchmark's last line when stopped, "stopped by <signal> <what>" on stderr, and its exit status, 128 + the
    signal's number."""
    signum, how = which_stop(stop)
    print(f"stopped by {how} {what}", file=sys.stderr, flush=True)
    return 128 + signum


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines, an empty cell (or None) as "| |" (a library such as tabulate would add a dependency
    for these lines)."""
    def line(cells):
        return "|" + "".join(" |" if cell is None or cell == "" else f" {cell} |" for cell in cells)
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def rows_named(every: list, only: list[str] | None, keywords: dict[str, set] | None = None) -> list | str:
    """The rows (anything with a .name) that the --only values name, in the order named (every row without --only),
    or why a text names none. A value that is a whole row name or a keyword stands for itself, commas and all; any
    other value is split at its commas, and each part is a keyword (its set of names), a whole name (that row, not
    its namesakes) or a part of names, in any case."""
    keywords = keywords or {}
    if not only:
        return every
    names = {r.name.lower() for r in every}
    texts = [text.strip() for value in only
             for text in ([value] if value.lower() in names or value in keywords else value.split(",")) if text.strip()]
    wanted = {}
    for text in texts:
        low = text.lower()
        named = [r for r in every if (r.name in keywords[text] if text in keywords else
                                      r.name.lower() == low if low in names else low in r.name.lower())]
        if not named:
            return f"--only {text!r} matches no row (the rows: {'; '.join(r.name for r in every)})"
        wanted |= {r.name: r for r in named if r.name not in wanted}
    return list(wanted.values())
