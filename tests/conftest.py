"""pytest's hooks and fixtures, nothing else: what the test files import is in modules of its own (script_runs.py:
running the scripts and reading what they wrote; processes.py: the processes a run starts and leaves)."""
import collections
import json
import os
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock
from script_runs import TINY, check, launcher, run

# The test files that take longest (seconds on 2 cores, a whole run of the suite), started first: with --dist loadfile
# a worker takes a whole file, and a long file started last leaves the other worker idle until it ends (the longest
# first, the shortest last: the two workers then finish within a short file of each other). A file not named here
# comes after these, in its usual place; a wrong guess costs time, never a test.
LONGEST_FIRST = ["test_live_recovery.py", "test_link_faults.py", "test_stopping.py", "test_resume.py",
                 "test_speed.py", "test_multinode.py", "test_network.py", "test_scripts_equal.py",
                 "test_fsdp_runs.py", "test_zero.py", "test_diloco.py", "test_template.py", "test_elastic.py",
                 "test_diloco_benchmark.py", "test_end_to_end.py", "test_cuda_graphs.py", "test_failures.py",
                 "test_checkpoints.py", "test_learning.py", "test_host_reads.py", "test_a_rank_fails.py",
                 "test_pipeline.py", "test_profiling.py", "test_fsdp.py", "test_bad_input.py"]


def pytest_configure(config):
    """SIGINT as a terminal's Ctrl-C finds it. A pytest started in the background by a shell without job control
    (`pytest &` in a script, `nohup ... &`) inherits SIGINT ignored, and so would every process it starts: a test
    that sends one SIGINT (Ctrl-C) to a benchmark that leaves SIGINT to Python would then see it run on to its end."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(session, config, items):
    """Each file's tests stay together and in their order; the files named in LONGEST_FIRST go first, in its order
    (pyproject.toml's --no-loadscope-reorder keeps xdist to this order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="where each test's CPU seconds go, a JSON line a test: its own process's and those of the "
                          "processes it started and waited for, the launchers' ranks included (not the forkserver "
                          "processes of distributed_helpers.on_ranks); the run ends with the seconds of each test "
                          "file, what the suite's time on a 2-core machine is made of. Default: "
                          ".pytest_cache/cpu-report.jsonl; --cpu-report= (empty): none. Write --cpu-report=FILE: a "
                          "FILE outside the repository given apart is taken by the xdist workers for a test path, "
                          "which moves their root folder away from this conftest")


def _cpu_report(config) -> Path | None:
    """--cpu-report's file: FILE, .pytest_cache/cpu-report.jsonl by default, None when turned off."""
    report = config.getoption("cpu_report")
    if report is None:
        return config.rootpath / ".pytest_cache" / "cpu-report.jsonl"
    return Path(report) if report else None


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended and were waited for (their children's too)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in (resource.getrusage(resource.RUSAGE_SELF),
                                                             resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The test's CPU seconds (setup, call and teardown: a module fixture's runs count for the test that made them),
    appended to --cpu-report's file as one line (O_APPEND: the workers' lines do not mix)."""
    report = _cpu_report(item.config)
    before = _cpu_seconds() if report else 0.0
    yield
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - before, 2)}) + "\n")


def _free_gb() -> float:
    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


def pytest_sessionstart(session):
    """In the controlling process, before any test runs: the free room where the tests write, for the summary, and
    --cpu-report's file emptied (its folder made), to hold this run's lines."""
    if hasattr(session.config, "workerinput"):
        return
    session.config.free_gb_at_start = _free_gb()
    if report := _cpu_report(session.config):
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The free room where the tests write (a run holds up to about 4 GB of checkpoints there at once, 3.7 GB at
    30c82ed, and a full disk fails tests by the dozen, far from the cause); then the CPU seconds of each test file
    that took any, from --cpu-report's file, the costliest first."""
    if hasattr(config, "workerinput"):
        return
    terminalreporter.write_line(f"temporary files under {tempfile.gettempdir()}: {config.free_gb_at_start:.1f} GB "
                                f"free at the start, {_free_gb():.1f} GB at the end (the suite holds up to about 4 GB "
                                "there at once)")
    report = _cpu_report(config)
    if not report or not report.exists():
        return
    per_file = collections.Counter()
    for line in report.read_text().splitlines():
        row = json.loads(line)
        per_file[row["test"].split("::")[0]] += row["cpu_s"]
    terminalreporter.section(f"CPU seconds per test file ({report})")
    for name, seconds in per_file.most_common():
        if seconds >= 0.05:
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}  in all")


def pytest_xdist_auto_num_workers(config) -> int:
    """-n auto: a worker per core, at most 4 and one per 6 GB of memory (a test's ranks hold up to about
    3 GB). Many tests wait on processes that use one core each: 2 workers on 2 cores finished the suite
    in 7:55, one in 9:16 (an AMD EPYC)."""
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(4, os.cpu_count() or 1, int(memory_gb // 6)))


@pytest.fixture(scope="session", autouse=True)
def children_temp_dir(tmp_path_factory):
    """TMPDIR, for the processes the tests start, under pytest's own folder, and deleted with it when every test
    passed: torchrun leaves an empty torchelastic_* folder in the temporary folder each time it starts, and a killed
    process its multiprocessing pymp-* folder, some 200 a run of the suite left in /tmp. Not where the folder's path
    is long (macOS's /var/folders/...): a forkserver's socket, pymp-*/listener-*, must fit in 107 bytes."""
    folder = str(tmp_path_factory.mktemp("children-tmp"))
    if len(folder) <= 70:
        os.environ["TMPDIR"] = folder


@pytest.fixture(scope="module")
def module_dir(request, tmp_path_factory):
    """module_dir(name): a new folder for runs a module's tests share, deleted when the module's tests end unless one
    of them failed: what pyproject's tmp_path_retention_policy = "failed" does for a test's own tmp_path (the suite
    writes checkpoints of about 90 MB a run; kept to the session's end, they filled a CI machine's disk)."""
    failures_before = request.session.testsfailed
    made = []

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    if request.session.testsfailed == failures_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, worker_id):
    """Runs of the scripts on TINY data, each made once per session and shared by the tests: under xdist once for
    all the workers (the first to ask makes it under a lock, in the folder the workers' temporary folders share;
    the others wait for it and read it there)."""
    cache = {}
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent

    def get(name: str, kind: str, script: str, *args: str, nprocs: int = 2) -> Path:
        if name not in cache:
            command = launcher(kind, script, nprocs) + TINY + list(args)
            out = shared / "runs" / name
            with FileLock(str(shared / f"runs-{name}.lock"), timeout=600):
                made = out / "command.json"
                if not made.exists():  # the first to ask: a failed run fails its test, and the next starts afresh
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir(parents=True)
                    check(run(command + ["--output-dir", str(out)]))
                    made.write_text(json.dumps(command))
                # one name, one run: a name asked for with other flags is a mistake in the tests
                assert json.loads(made.read_text()) == command, (name, json.loads(made.read_text()), command)
            cache[name] = out
        return cache[name]

    return get
