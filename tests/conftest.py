"""pytest's hooks and fixtures, nothing else: what the test files import is in modules of its own (script_runs.py:
running the scripts and reading what they wrote; processes.py: the processes a run starts and leaves)."""
import os
from pathlib import Path

import pytest
from script_runs import TINY, check, launcher, run


def pytest_xdist_auto_num_workers(config) -> int:
    """-n auto: a worker per core, at most 4 and one per 6 GB of memory (a test's ranks hold up to about
    3 GB). Many tests wait on processes that use one core each: 2 workers on 2 cores finished the suite
    in 7:55, one in 9:16 (an AMD EPYC)."""
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(4, os.cpu_count() or 1, int(memory_gb // 6)))


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Runs of the scripts on TINY data, each made once per session and shared by the tests."""
    cache = {}

    def get(name: str, kind: str, script: str, *args: str, nprocs: int = 2) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            check(run(launcher(kind, script, nprocs) + TINY + list(args) + ["--output-dir", str(out)]))
            cache[name] = out
        return cache[name]

    return get
