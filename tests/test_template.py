"""Copying a script as a template (docs/template.md): distributed.py, safety_net/ and utils/ copied, and only the two
functions the page names replaced, one by another torchvision model, the other by an image folder of PNG
files. The copy trains under torchrun on 2 CPU ranks, stops on Ctrl-C with a checkpoint, continues, and
evaluates exactly at another world size."""
import ast
import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from processes import Run
from script_runs import ROOT, check, load_checkpoint, read_metrics, subprocess_env

CLASSES = 6
MODEL = '''
def resnet18_cifar(num_classes: int = 100) -> nn.Module:
    return torchvision.models.mobilenet_v3_small(num_classes=num_classes)
'''


def page_block(language: str) -> str:
    """The first ```language block of docs/template.md, as the page has it (its indentation removed)."""
    page = (ROOT / "docs" / "template.md").read_text()
    block = page.split(f"```{language}\n", 1)[1].split("```", 1)[0]
    return textwrap.dedent(block)


DATA = page_block("python")  # the page's add_flags() and datasets() for an image folder


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
    copy = tmp_path / "my_project"
    copy.mkdir()
    shutil.copy(ROOT / "distributed.py", copy)
    shutil.copytree(ROOT / "safety_net", copy / "safety_net", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "speed", copy / "speed", ignore=shutil.ignore_patterns("__pycache__"))
    replace_functions(copy / "utils" / "models.py", MODEL)
    replace_functions(copy / "utils" / "data.py", DATA)
    write_image_folder(tmp_path / "pngs", {"train": 16, "test": 3})
    return copy


def torchrun(script: Path, nprocs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", str(script)]


@pytest.mark.slow
def test_a_copy_with_its_own_model_and_data_trains_continues_and_evaluates_exactly(template, tmp_path):
    said = check(subprocess.run([sys.executable, str(template / "distributed.py"), "--help"], cwd=tmp_path,
                                env=subprocess_env(), capture_output=True, text=True, timeout=120)).stdout
    data_flags = " ".join(said.split("\ndata:\n", 1)[1].split("\n\n", 1)[0].split())
    assert "one folder of images per class" in data_flags and "CIFAR" not in data_flags, data_flags
    assert "--dataset" not in said and "--train-samples" not in said
    out = tmp_path / "run"
    flags = ["--device", "cpu", "--data-dir", str(tmp_path / "pngs"), "--epochs", "2", "--batch-size", "16",
             "--workers", "0", "--print-freq", "1", "--lr", "0.05", "--output-dir", str(out)]
    cmd = torchrun(template / "distributed.py", 2) + flags
    started = Run(cmd)
    started.wait_for("epoch 1/2 step 2/6")  # 96 images, a global batch of 16: 6 steps per epoch
    started.proc.send_signal(signal.SIGINT)  # Ctrl-C
    status, _ = started.finish()
    assert status != 0 and "stopped by SIGINT at epoch 1" in started.text, started.output
    stopped_at = load_checkpoint(out)
    assert stopped_at["epoch"] == 0 and 2 <= stopped_at["step"] < 6
    assert "features.0.0.weight" in stopped_at["model"]  # the copy's model: MobileNetV3, not ResNet-18
    assert stopped_at["model"]["classifier.3.weight"].shape[0] == CLASSES  # one output per class of the folder

    continued = check(subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                                     timeout=300))
    assert f"resuming from {out / 'checkpoint.pt'}: epoch 1, step {stopped_at['step']}" in continued.stdout
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2] and records[-1]["samples"] == 17

    # every test image counted once at another world size: 17 over 4 ranks is 5, 4, 4 and 4
    check(subprocess.run(torchrun(template / "distributed.py", 4) + flags + ["--evaluate"], cwd=tmp_path,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300))
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["samples"] == 17
    for key in ("test_loss", "top1", "top5"):
        assert evaluated[key] == pytest.approx(records[-1][key], rel=1e-5), key


@pytest.mark.slow
def test_a_copy_whose_data_folder_lacks_a_split_says_so_in_one_line(template, tmp_path):
    (tmp_path / "pngs" / "test").rename(tmp_path / "pngs" / "val")  # the page's datasets() reads "test"
    result = subprocess.run([sys.executable, str(template / "distributed.py"), "--device", "cpu", "--data-dir",
                             str(tmp_path / "pngs"), "--workers", "0", "--output-dir", str(tmp_path / "run")],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "error: No such file or directory:" in lines[0] and str(tmp_path / "pngs" / "test") in lines[0], lines
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def page_diff() -> str:
    """The change docs/template.md shows for a copy without the safety net, as the page has it."""
    page = (ROOT / "docs" / "template.md").read_text()
    return page.split("```diff\n", 1)[1].split("```\n", 1)[0]


@pytest.mark.slow
def test_a_copy_without_the_safety_net_trains_and_learns(tmp_path):
    """distributed.py, utils/ and speed/ only, without the modules the page says belong to the other scripts, the
    page's diff applied, the page's image folder: it trains under torchrun, at the learning rate the global batch
    gives, to well above chance (1 in 6), writing nothing."""
    copy = tmp_path / "lean"
    copy.mkdir()
    shutil.copy(ROOT / "distributed.py", copy)
    others = ("spawn.py", "gpus.py", "precision.py", "live_recovery.py",  # as docs/template.md says
              "cuda_graphs.py", "device_loader.py")  # of speed/: distributed_apex.py's fast GPU path
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__", *others))
    shutil.copytree(ROOT / "speed", copy / "speed", ignore=shutil.ignore_patterns("__pycache__", *others))
    replace_functions(copy / "utils" / "data.py", DATA)  # ResNet-18 stays, with 6 outputs
    subprocess.run(["git", "apply", "-"], cwd=copy, input=page_diff(), text=True, check=True)
    assert "safety_net" not in (copy / "distributed.py").read_text()
    write_image_folder(tmp_path / "pngs", {"train": 32, "test": 3})
    result = check(subprocess.run(torchrun(copy / "distributed.py", 2) + [
        "--device", "cpu", "--data-dir", str(tmp_path / "pngs"), "--epochs", "6", "--batch-size", "16", "--workers",
        "0"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300))
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    top1 = [float(line.split("top1 ")[1].split("%")[0]) for line in epochs]
    test_loss = [float(line.split("test_loss ")[1]) for line in epochs]
    assert len(epochs) == 6 and top1[-1] >= 60 and test_loss[-1] < test_loss[0] / 2, result.stdout
    assert not list(tmp_path.glob("**/checkpoint.pt")) and not (tmp_path / "runs").exists()


def test_the_page_counts_each_copy_as_the_command_does():
    """docs/template.md's table of what each copy takes is what `python -m benchmarks.copy_size` prints now, its
    last row measured on the page's own diff applied; and the copy of distributed.py takes nothing of safety_net/
    once the diff is applied, nor of speed/ but its techniques."""
    from benchmarks import copy_size
    table = copy_size.table()
    assert table in (ROOT / "docs" / "template.md").read_text(), table
    lean = table.strip().splitlines()[-1]
    assert "safety_net" not in lean and "cuda_graphs" not in lean and "device_loader" not in lean, lean
