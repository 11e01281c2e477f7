"""One rank raises mid-epoch (a sample that cannot be decoded, seen by rank 1 only): the whole run ends within
seconds under torchrun and under spawn, no process is left, the failing rank and its error are one line, and
the checkpoint of the last epoch is intact."""
import re
import shutil
from pathlib import Path

import pytest
from processes import Run
from script_runs import ROOT, TINY, launcher, load_checkpoint, subprocess_env
from test_template import replace_function

# rank 1 meets sample 89 in its second batch of epoch 2 (the sampler's order for --seed 0, 96 images, 2 ranks)
CORRUPT = '''
class DecodesUntilEpoch2(Dataset):
    """The training set, but sample 89 cannot be decoded from epoch 2 on (a file gone bad, say)."""

    def __init__(self, inner):
        self.inner, self.classes = inner, inner.classes

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __getitem__(self, index):
        if index == 89 and self.inner.epoch >= 1:
            raise ValueError(f"cannot decode sample {index}")
        return self.inner[index]


def datasets(args, env) -> tuple[Dataset, Dataset]:
    prepare(args, env)
    return DecodesUntilEpoch2(load(args, train=True)), load(args, train=False)
'''


@pytest.fixture
def copy_with_a_bad_sample(tmp_path) -> Path:
    copy = tmp_path / "project"
    copy.mkdir()
    for script in ("distributed.py", "distributed_mp.py"):
        shutil.copy(ROOT / script, copy)
    for package in ("utils", "speed", "safety_net"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    replace_function(copy / "utils" / "data.py", "datasets", CORRUPT)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("kind, script", [("torchrun", "distributed.py"), ("spawn", "distributed_mp.py")])
def test_a_rank_that_raises_ends_the_run_in_one_line(kind, script, copy_with_a_bad_sample, tmp_path):
    out = tmp_path / "run"
    cmd = launcher(kind, script) + TINY + ["--train-samples", "96", "--epochs", "2", "--workers", "1",
                                           "--output-dir", str(out)]
    cmd[cmd.index(str(ROOT / script))] = str(copy_with_a_bad_sample / script)
    started = Run(cmd, env=subprocess_env())
    started.wait_for("error: rank 1")
    status, seconds = started.finish(timeout=60)  # every process gone, or the test fails naming them
    output = started.text
    errors = [line for line in output.splitlines() if "error:" in line]
    assert status != 0 and len(errors) == 1, output
    assert re.search(r"error: rank 1: ValueError: cannot decode sample 89 \(\S*utils/data\.py:\d+ in __getitem__; "
                     r"the traceback is in (\S+)\)", errors[0]), errors[0]
    traceback_file = Path(errors[0].rsplit("the traceback is in ", 1)[1].rstrip(")"))
    assert "cannot decode sample 89" in traceback_file.read_text()
    traceback_file.unlink()
    assert "[rank0]" not in output and "[rank1]" not in output and "Connection closed" not in output, output
    if kind == "spawn":  # torchrun adds a traceback of its own (ChildFailedError), which the script cannot prevent
        assert "Traceback" not in output, output
    # from the error's line to the last process gone: the exits alone (2-3 s here), half the 30 s that a rank would
    # wait for local rank 0 before the ranks meet, and far below --dist-timeout, had rank 0 waited in its collective
    assert seconds < 15, f"{seconds:.1f} s from the error's line to the last process gone\n{output}"
    assert load_checkpoint(out)["epoch"] == 1  # the checkpoint of epoch 1, whole


def crash_in_exit_on_error(crash_report):
    """The exit status of a RuntimeError raised inside exit_on_error(crash_report), or the error it let through."""
    from utils.errors import exit_on_error
    try:
        with exit_on_error(crash_report):
            raise RuntimeError("an unexpected failure")
    except SystemExit as stop:
        return stop.code
    except RuntimeError as passed:
        return passed


def test_a_crash_is_the_safety_nets_one_line_and_without_it_pythons_traceback(capsys, monkeypatch):
    """The safety net hands exit_on_error its crash report (`with SafetyNet.for_flags(...)`, the spawn parent's
    check_flags_before_spawn): one line naming the error and its place, the
    traceback in a file, exit status 1. A copy without the safety net gets the exception back: Python's traceback."""
    from safety_net import SafetyNet
    monkeypatch.setattr("signal.signal", lambda *_: None)  # exit_process resets SIGCHLD: not in the test process
    assert crash_in_exit_on_error(SafetyNet.report_crash) == 1
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"\S+: error: RuntimeError: an unexpected failure \(\S*test_a_rank_fails\.py:\d+ in "
                        r"crash_in_exit_on_error; the traceback is in (\S+)\)", line), line
    traceback_file = Path(line.rsplit("the traceback is in ", 1)[1].rstrip(")"))
    assert "Traceback" in traceback_file.read_text()
    traceback_file.unlink()
    assert str(crash_in_exit_on_error(None)) == "an unexpected failure"
    assert capsys.readouterr().err == ""
