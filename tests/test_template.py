"""Copying a script as a template, step by step as docs/template.md says, with the page's own commands and blocks:
distributed.py and exactly the files `python -m tools.copy_size --files distributed.py` lists, copied by the
page's command; the data functions replaced by the page's (an image folder of PNG files), the model by another
torchvision model, ARCH renamed, --help's description rewritten. The copy trains under torchrun on 2 CPU ranks,
stops on Ctrl-C with a checkpoint, continues, evaluates exactly at another world size, refuses a checkpoint of
this collection's ARCH and another --epochs, and trains longer with --init-from. The copy without the safety net,
made by the page's commands, learns."""
import ast
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from processes import Run
from script_runs import ROOT, check, load_checkpoint, read_metrics, subprocess_env

from tools import copy_size
from utils import models

CLASSES = 6


def page() -> str:
    return (ROOT / "docs" / "template.md").read_text()


def page_blocks(language: str) -> list[str]:
    """The ```language blocks of docs/template.md in the page's order, each as the page has it (indentation removed)."""
    return [textwrap.dedent(block.split("```", 1)[0]) for block in page().split(f"```{language}\n")[1:]]


def block_after(text: str, language: str = "") -> str:
    """The first ```language block of the page after `text`, its indentation removed."""
    after = page().split(text, 1)[1]
    return textwrap.dedent(after.split(f"```{language}\n", 1)[1].split("```", 1)[0])


# the page's Python: step 2's add_flags() and datasets(), step 3's datasets(), step 4's model, step 5's ARCH line
DATA, DATA_OTHER, MODEL, ARCH_LINE = page_blocks("python")
ARCH = ast.literal_eval(ARCH_LINE.split("=", 1)[1].strip())  # step 5's name
STEP_1 = "\n### 1. Copy the script and exactly the files it imports\n"
LEAN = "\n## Without the safety net\n"
NORMALISATION = "- **Normalisation.**"
DOCSTRING_END = "ResNet-18 on CIFAR-100."  # step 6: the end of distributed.py's first line, replaced by
DESCRIPTION = "MobileNetV3 on my images."  # the page's example
# step 8: the last line but the rule of torchrun's report, after the line of a rank that refused its flags
POINTER = "traceback : exit status 2: distributed.py said why in one line above this report"


def run_page_commands(commands: str, copy: Path) -> None:
    """The page's shell commands, in this repository's root, the copy going to `copy` instead of ../my_project."""
    script = commands.replace("../my_project", shlex.quote(str(copy))).replace(
        "python -m ", f"{shlex.quote(sys.executable)} -m ")
    check(subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=60))


def files_of(copy: Path) -> set[str]:
    return {str(f.relative_to(copy)) for f in copy.rglob("*") if f.is_file() and "__pycache__" not in f.parts}


def measured_mean_std(images: Path) -> str:
    """The line `mean, std = ...` that step 3's command prints for the training set under `images` (run in this
    process: the command's code, its folder `images` made `images`)."""
    command = block_after(NORMALISATION)
    code = command.split('python -c "', 1)[1].rsplit('"', 1)[0].replace("'images/train'", repr(str(images / "train")))
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        exec(code, {})
    (line,) = said.getvalue().splitlines()
    assert re.fullmatch(r"mean, std = \(([\d.]+, ){2}[\d.]+\), \(([\d.]+, ){2}[\d.]+\)", line), line
    return line


def replace_function(path: Path, name: str, source: str) -> None:
    """Replace the top-level function `name` of the module at `path` by `source`, all else as it was."""
    lines = path.read_text().splitlines(keepends=True)
    (node,) = [n for n in ast.parse("".join(lines)).body if isinstance(n, ast.FunctionDef) and n.name == name]
    path.write_text("".join(lines[:node.lineno - 1]) + source.lstrip("\n") + "".join(lines[node.end_lineno:]))


def replace_functions(path: Path, source: str) -> None:
    """Replace each top-level function of `source` in the module at `path` by its namesake in `source`."""
    lines = source.splitlines(keepends=True)
    for node in (n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)):
        replace_function(path, node.name, "".join(lines[node.lineno - 1:node.end_lineno]))


def replace_line(path: Path, start: str, line: str) -> None:
    """Replace the one line of the file at `path` that starts with `start` by `line`."""
    lines = path.read_text().splitlines(keepends=True)
    (at,) = [i for i, text in enumerate(lines) if text.startswith(start)]
    path.write_text("".join(lines[:at]) + line.rstrip("\n") + "\n" + "".join(lines[at + 1:]))


def write_image_folder(root: Path, per_class: dict[str, int]) -> None:
    """<root>/<split>/class<c>/<i>.png: each class a colour of its own under noise, 32x32 RGB."""
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for c in range(CLASSES):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            colour = np.array([(c * 40) % 256, (c * 90) % 256, 255 - c * 40])
            for i in range(count - (split == "test" and c == 0)):  # 17 test images: no world size divides them
                noise = rng.normal(0, 40, (32, 32, 3))
                Image.fromarray(np.clip(colour + noise, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")


@pytest.fixture
def template(tmp_path) -> Path:
    """The page's steps 1 to 6, in its order, on the image folder <tmp_path>/images."""
    copy = tmp_path / "my_project"
    run_page_commands(block_after(STEP_1), copy)  # step 1: exactly the files --files lists
    assert files_of(copy) == {*copy_size.files("distributed.py"), "requirements.txt"}, files_of(copy)
    replace_functions(copy / "utils" / "data.py", DATA)  # step 2: add_flags() and datasets()
    write_image_folder(tmp_path / "images", {"train": 16, "test": 3})
    mean_std = measured_mean_std(tmp_path / "images")  # step 3: its datasets(), with the command's mean and std
    replace_functions(copy / "utils" / "data.py", re.sub(r"mean, std = .*", mean_std, DATA_OTHER, count=1))
    replace_functions(copy / "utils" / "models.py", MODEL)  # step 4: MobileNetV3
    replace_line(copy / "utils" / "models.py", "ARCH = ", ARCH_LINE)  # step 5
    script = (copy / "distributed.py").read_text()  # step 6: --help's description
    assert script.splitlines()[0].endswith(DOCSTRING_END)  # the words that end the file's first line
    (copy / "distributed.py").write_text(script.replace(DOCSTRING_END, DESCRIPTION, 1))
    return copy


def torchrun(script: Path, nprocs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", str(script)]


@pytest.mark.slow
def test_a_copy_with_its_own_model_and_data_trains_continues_and_evaluates_exactly(template, tmp_path):
    said = check(subprocess.run([sys.executable, str(template / "distributed.py"), "--help"], cwd=tmp_path,
                                env=subprocess_env(), capture_output=True, text=True, timeout=120)).stdout
    data_flags = " ".join(said.split("\ndata:\n", 1)[1].split("\n\n", 1)[0].split())
    assert "one folder of images per class" in data_flags, data_flags
    assert "CIFAR" not in said and DESCRIPTION in " ".join(said.split()), said
    assert "--dataset" not in said and "--train-samples" not in said
    out = tmp_path / "run"
    flags = ["--device", "cpu", "--data-dir", str(tmp_path / "images"), "--epochs", "2", "--batch-size", "16",
             "--workers", "0", "--print-freq", "1", "--lr", "0.05"]
    cmd = torchrun(template / "distributed.py", 2) + flags + ["--output-dir", str(out)]
    started = Run(cmd)
    started.wait_for("epoch 1/2 step 2/6")  # 96 images, a global batch of 16: 6 steps per epoch
    os.killpg(started.proc.pid, signal.SIGINT)  # Ctrl-C: every process of the terminal's foreground group
    status, _ = started.finish()
    assert "stopped by SIGINT at epoch 1" in started.text, started.output
    # step 7: torchrun's own traceback after the run's line, and exit status 1
    assert status == 1 and "SignalException" in started.text.split("stopped by SIGINT at epoch 1", 1)[1], \
        (status, started.output)
    stopped_at = load_checkpoint(out)
    assert stopped_at["epoch"] == 0 and 2 <= stopped_at["step"] < 6
    assert stopped_at["arch"] == ARCH  # step 5's name
    assert "features.0.0.weight" in stopped_at["model"]  # the copy's model: MobileNetV3, not ResNet-18
    assert stopped_at["model"]["classifier.3.weight"].shape[0] == CLASSES  # one output per class of the folder

    continued = check(subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                                     timeout=300))
    assert f"resuming from {out / 'checkpoint.pt'}: epoch 1, step {stopped_at['step']}" in continued.stdout
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2] and records[-1]["samples"] == 17

    # every test image counted once at another world size: 17 over 4 ranks is 5, 4, 4 and 4
    check(subprocess.run(torchrun(template / "distributed.py", 4) + flags + ["--output-dir", str(out), "--evaluate"],
                         cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300))
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["samples"] == 17
    for key in ("test_loss", "top1", "top5"):
        assert evaluated[key] == pytest.approx(records[-1][key], rel=1e-5), key

    # step 5: a checkpoint with this collection's ARCH is refused in one line, left as it was
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    torch.save({**load_checkpoint(out), "arch": models.ARCH}, theirs / "checkpoint.pt")
    before = (theirs / "checkpoint.pt").read_bytes()
    refused = subprocess.run([sys.executable, str(template / "distributed.py")] + flags
                             + ["--output-dir", str(theirs), "--evaluate"],
                             cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"distributed.py: error: {theirs / 'checkpoint.pt'} is not a {ARCH} checkpoint of these scripts; it was left "
        "untouched"], refused.stderr[-3000:]
    assert (theirs / "checkpoint.pt").read_bytes() == before and not (theirs / "eval.json").exists()

    # step 8 as the page starts it: the finished run refuses another --epochs in one line, then torchrun's report,
    # which ends by pointing at the line, and torchrun's exit status 1
    more_epochs = flags + ["--output-dir", str(out), "--epochs", "3"]
    refused = subprocess.run(torchrun(template / "distributed.py", 2) + more_epochs, cwd=tmp_path,
                             env=subprocess_env(), capture_output=True, text=True, timeout=120)
    line = f"distributed.py: error: {out / 'checkpoint.pt'} is a run with --epochs 2, not 3"
    said = [text for text in refused.stderr.splitlines() if text.strip()]
    assert refused.returncode == 1 and refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert "ChildFailedError" in refused.stderr.split(line, 1)[1] and said[-2].strip() == POINTER, said[-12:]
    # in one process: the line alone and exit status 2; --init-from trains on from the run's weights
    python = [sys.executable, str(template / "distributed.py")]
    refused = subprocess.run(python + more_epochs, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith(line) and refused.stderr.count("\n") == 1, \
        refused.stderr[-3000:]
    longer = tmp_path / "longer"
    trained = check(subprocess.run(python + flags + ["--epochs", "1", "--init-from", str(out / "checkpoint.pt"),
                                                     "--output-dir", str(longer)],
                                   cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300))
    assert f"starting a new run from the weights in {out / 'checkpoint.pt'}" in trained.stdout, trained.stdout
    assert [r["epoch"] for r in read_metrics(longer)] == [1]


@pytest.mark.slow
def test_a_copy_whose_data_folder_lacks_a_split_says_so_in_one_line(template, tmp_path):
    (tmp_path / "images" / "test").rename(tmp_path / "images" / "val")  # the page's datasets() reads "test"
    result = subprocess.run([sys.executable, str(template / "distributed.py"), "--device", "cpu", "--data-dir",
                             str(tmp_path / "images"), "--workers", "0", "--output-dir", str(tmp_path / "run")],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "error: No such file or directory:" in lines[0] and str(tmp_path / "images" / "test") in lines[0], lines
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_copy_without_the_safety_net_trains_and_learns(tmp_path):
    """Made by the page's commands (exactly the files --files --without-safety-net lists, the page's diff applied),
    step 2's datasets() for the page's image folder: it trains under torchrun, at the learning rate the global batch
    gives, to well above chance (1 in 6), writing nothing."""
    copy = tmp_path / "my_project"
    run_page_commands(block_after(LEAN), copy)
    assert files_of(copy) == {*copy_size.files("distributed.py", without_safety_net=True), "requirements.txt"}
    assert "safety_net" not in (copy / "distributed.py").read_text()
    replace_functions(copy / "utils" / "data.py", DATA)  # ResNet-18 stays, with 6 outputs
    write_image_folder(tmp_path / "images", {"train": 32, "test": 3})
    result = check(subprocess.run(torchrun(copy / "distributed.py", 2) + [
        "--device", "cpu", "--data-dir", str(tmp_path / "images"), "--epochs", "6", "--batch-size", "16", "--workers",
        "0"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300))
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    top1 = [float(line.split("top1 ")[1].split("%")[0]) for line in epochs]
    test_loss = [float(line.split("test_loss ")[1]) for line in epochs]
    assert len(epochs) == 6 and top1[-1] >= 60 and test_loss[-1] < test_loss[0] / 2, result.stdout
    assert not list(tmp_path.glob("**/checkpoint.pt")) and not (tmp_path / "runs").exists()


def test_torchruns_report_after_a_refusal_ends_by_pointing_at_its_line(tmp_path, monkeypatch, capsys):
    """Step 8 under torchrun: a rank that refuses in one line (exit status 2) leaves an error file from which
    torchrun's report (ChildFailedError, as torchrun formats it) ends by pointing at that line, not with a link to
    torch's docs; the line itself is said once, above the report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from utils import errors
    error_file = tmp_path / "error.json"  # torchrun gives each rank its own
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "0")  # the rank that prints the line
    monkeypatch.setattr(sys, "argv", ["distributed.py"])
    monkeypatch.setattr("signal.signal", lambda *_: None)  # exit_process resets SIGCHLD: not in the test process
    refusal = "runs/distributed/checkpoint.pt is a run with --epochs 4, not 8"
    with pytest.raises(SystemExit) as exited:
        errors.exit_with_line(refusal, 2)
    assert exited.value.code == 2 and capsys.readouterr().err == f"distributed.py: error: {refusal}\n"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("distributed.py", {0: failure}).format_msg().splitlines()
    assert report[-2].strip() == POINTER and refusal not in "\n".join(report), report


def test_the_page_counts_each_copy_as_the_command_does(capsys):
    """docs/template.md's table of what each copy takes is what `python -m tools.copy_size` prints now, its
    last row measured on the page's own diff applied; the copy of distributed.py takes nothing of safety_net/ once
    the diff is applied, nor of speed/ but its techniques; the page's lists of the files to copy are what
    `--files` prints, and `--diff` prints the page's diff."""
    table = copy_size.table()
    assert table in page(), table
    lean = table.strip().splitlines()[-1]
    assert "safety_net" not in lean and "cuda_graphs" not in lean and "device_loader" not in lean, lean
    for heading, extra in ((STEP_1, []), (LEAN, ["--without-safety-net"])):
        copy_size.main(["--files", "distributed.py", *extra])
        printed = capsys.readouterr().out
        assert block_after(heading, "text") == printed, printed
        assert printed.splitlines()[0] == "distributed.py" and all((ROOT / f).is_file() for f in printed.split())
    assert "safety_net" not in printed and "speed/cuda_graphs.py" not in printed
    copy_size.main(["--diff"])
    diff = capsys.readouterr().out
    assert diff == page().split("```diff\n", 1)[1].split("```\n", 1)[0] and "-from safety_net import SafetyNet" in diff
