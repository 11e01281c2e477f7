"""python -m benchmarks.diloco: its flags refused in one line, its tables made from its results, each learning run's
figures read from a metrics.jsonl as the scripts write it, a run past its time limit ended with every process it
started, and (slow) a benchmark stopped by Ctrl-C during a learning run that keeps what it measured and leaves no
process. What it counts is tests/test_diloco.py's."""
import json
import signal
import subprocess
import sys

import pytest
from processes import interrupted, processes_naming
from script_runs import ROOT, run_main, subprocess_env

from benchmarks import diloco, harness
from examples.local_processes import alive
from safety_net.metrics_log import MetricsLog


@pytest.mark.parametrize(("argv", "said"), [(["--sync-every", "4,0"], "--sync-every: must be a positive integer"),
                                            (["--steps", "x"], "--steps"),
                                            (["--learning-sync-every", "a"], "--learning-sync-every"),
                                            (["--train-samples", "16"], "fewer than one global batch of 32")])
def test_bad_flags_are_one_line_and_write_nothing(argv, said, tmp_path, capsys):
    out = tmp_path / "out"
    result = run_main(diloco.main, [*argv, "--output-dir", str(out)], capsys)
    assert result.returncode == 2 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
    assert not out.exists()


def test_the_full_run_writes_into_this_machines_folder():
    assert diloco.parse_args(["--learning"]).output_dir == diloco.machine_folder()
    assert diloco.parse_args([]).output_dir == "runs/diloco"  # the counts alone do not replace the folder's file
    assert diloco.machine_folder().startswith("benchmarks/results/cpu-") and diloco.machine_folder().endswith("-diloco")


def test_step_runs():
    assert diloco.step_runs([1, 3, 3, 3]) == "1 in step 1, 3 in each of steps 2-4"
    assert diloco.step_runs([0, 1, 0, 1]) == "0 in step 1, 1 in step 2, 0 in step 3, 1 in step 4"


def fake_results() -> dict:
    rows = diloco.learning_rows([4, 64])
    counts = [{"sync_every": None, "all_reduces": 11, "bytes": 4 * 2**20, "other": {}, "steps": 4,
               "all_reduces_per_step": [2, 3, 3, 3]},
              {"sync_every": 4, "all_reduces": 1, "bytes": 2**20, "other": {}, "steps": 4,
               "all_reduces_per_step": [0, 0, 0, 1]}]
    epochs = [{"epoch": 1, "top1": 61.2, "test_loss": 1.5634, "train_loss": 2.1, "epoch_time_s": 60.0},
              {"epoch": 2, "top1": 100.0, "test_loss": 0.000608, "train_loss": 0.00352, "epoch_time_s": 61.0}]
    learning = [{**rows[0], "command": "torchrun ...", "epochs": epochs, "wall_s": 201.4},
                {**rows[1], "command": "torchrun ...", "error": "still running after 9 s: stopped", "wall_s": 9.2}]
    meta = {"hardware": "2 cores of a CPU, no GPU, torch 2.x", "command": "python -m benchmarks.diloco --learning",
            "commit": "abc1234", "ranks": 2, "unfinished": "2 of 3 learning runs done",
            "learning": {"rows": rows, "train_samples": 64, "epochs": 2, "run_timeout_s": 9,
                         "omp_num_threads": "3"}}
    return {"meta": meta, "counts": counts, "learning": learning}


def test_the_tables_come_from_the_results():
    text = diloco.markdown(fake_results())
    assert text.startswith("Hardware: 2 cores of a CPU, no GPU, torch 2.x. Command: `python -m benchmarks.diloco "
                           "--learning`, at commit abc1234.")
    assert "**Unfinished:** 2 of 3 learning runs done" in text
    assert "`python -m torch.distributed.run --standalone --nproc_per_node=2`, OMP_NUM_THREADS=3)" in text
    assert f"| {diloco.DDP_COUNTED} | 2.75 | 1.000 | 1.0000 |" in text
    assert "| `distributed_diloco.py --sync-every 4` | 0.25 | 0.250 | 0.2500 |" in text
    assert "DDP's all-reduces, step by step: 2 in step 1, 3 in each of steps 2-4." in text
    assert "| run | held-out top-1 (loss) after 2 steps | after 4 | last epoch's training loss | wall s |" in text
    assert "| `distributed.py --no-sync-bn` (DDP) | 61.2% (1.56) | 100.0% (0.000608) | 0.00352 | 201 |" in text
    assert "| `distributed_diloco.py --sync-every 4` | failed: still running after 9 s: stopped | | | 9 |" in text
    assert "| `distributed_diloco.py --sync-every 64` | not measured: the benchmark was stopped" in text
    assert ("torchrun --standalone --nproc_per_node=2 distributed_diloco.py --sync-every 64 --device cpu --dataset "
            "synthetic --train-samples 64 --test-samples 500 --batch-size 32 --lr 0.05 --epochs 2 --no-augment "
            "--workers 0") in text


def test_a_runs_figures_are_read_from_its_metrics_jsonl(tmp_path, capsys):
    """The lines MetricsLog itself writes: a change of their format fails here, not in the full run."""
    log = MetricsLog(str(tmp_path), is_main=True, done_epochs=0)
    for epoch, top1 in ((1, 3.0), (2, 65.4)):
        log.write({"epoch": epoch, "lr": 0.05, "train_loss": 1 / epoch, "epoch_time_s": 70.0, "images_per_s": 29.3,
                   "peak_memory_mb": 500.0, "test_loss": 2 / epoch, "top1": top1, "top5": 9.0, "world_size": 2})
    assert diloco.read_epochs(tmp_path) == [
        {"epoch": 1, "top1": 3.0, "test_loss": 2.0, "train_loss": 1.0, "epoch_time_s": 70.0},
        {"epoch": 2, "top1": 65.4, "test_loss": 1.0, "train_loss": 0.5, "epoch_time_s": 70.0}]


def test_a_run_past_its_limit_is_ended_with_the_processes_it_started():
    """A launcher whose children have sessions of their own (as torchrun's ranks do), one started at once, one as the
    launcher is told to end (as a rank torchrun was starting when the signal came, which CI once saw left): after
    the limit, exit status 124, and none is left."""
    child = "import time; time.sleep(120)"  # its output elsewhere: nothing of the launcher's waits for it to end
    start = (f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid")
    parent = (f"import signal, subprocess, sys, time\ndef end(*_):\n    print({start}, flush=True)\n    sys.exit(0)\n"
              f"signal.signal(signal.SIGTERM, end)\nprint({start}, flush=True)\ntime.sleep(120)")
    result = harness.run_stoppable([sys.executable, "-c", parent], subprocess_env(), limit_s=1.5)
    started = [int(pid) for pid in result.stdout.split()]
    assert result.returncode == 124 and len(started) == 2, result
    assert not alive(started)


# counts of one step, then tiny learning runs (one step of 32 images each)
SMALL = ["--sync-every", "1", "--steps", "1", "--learning", "--learning-sync-every", "1,2", "--train-samples", "32",
         "--epochs", "1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_during_a_run_keeps_the_runs_done_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()  # the runs' temporary output folders: a process of theirs names it in its command
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.diloco", *SMALL, "--output-dir", str(out)], cwd=ROOT,
                            env=subprocess_env(TMPDIR=str(tmp_path / "tmp")), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    # [1/4] the counts, [2/4] DDP's run, then its line: stopped during H = 1's run
    _, stderr = interrupted(proc, "[3/4] DiLoCo H = 1: torchrun", timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("stopped by Ctrl-C after 1 of 3 learning runs"), stderr[-3000:]
    results = json.loads((out / "diloco.json").read_text())
    assert [r["name"] for r in results["learning"]] == ["DDP"] and "unfinished" in results["meta"]
    assert len(results["learning"][0]["epochs"]) == 1 and results["counts"][0]["all_reduces_per_step"]
    text = (out / "diloco.md").read_text()
    assert "**Unfinished:**" in text and "| `distributed_diloco.py --sync-every 1` | not measured" in text
    assert not (ours := processes_naming(tmp_path)), ours


def test_the_page_and_the_results_folder_hold_the_tables_of_their_json():
    """benchmarks/results/cpu-epyc-diloco/diloco.md is what markdown() makes of the diloco.json beside it, and
    docs/diloco.md's table rows are that file's, in its order: a page and its file cannot drift apart."""
    folder = ROOT / "benchmarks" / "results" / "cpu-epyc-diloco"
    made = diloco.markdown(json.loads((folder / "diloco.json").read_text()))
    assert (folder / "diloco.md").read_text() == made
    page = (ROOT / "docs" / "diloco.md").read_text()
    assert [line for line in page.splitlines() if line.startswith("|")] == [
        line for line in made.splitlines() if line.startswith("|")]
