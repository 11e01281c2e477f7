"""Each bad input: one line on stderr naming the problem, exit status 2, nothing overwritten."""
import importlib
import os
import socket
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from processes import run_clocked
from script_runs import TINY, check, launcher, run, run_main

from utils import errors, launch, spawn
from utils.errors import UsageError

# Seconds from an error's line on stderr to the launcher's exit, where no rank may wait: the exits of the ranks and
# the launcher (2-3 s here; starts are not counted, they vary 2-3x between machines), half the 30 s that a silent
# rank waits for local rank 0 before the ranks meet (utils.errors), which a wait after they met would add
AFTER_THE_LINE_S = 15

# Checked in-process, through each script's main(): these fail before any process would start.
CASES = {
    "gpu-not-visible": ("dataparallel", ["--gpu", "3"], "--gpu 3"),
    "cuda-without-gpu": ("distributed", ["--device", "cuda"], "--device cuda"),
    "nccl-without-gpu": ("distributed_mp", ["--backend", "nccl"], "--backend nccl"),
    "batch-not-divisible": ("distributed_mp", ["--nprocs", "2", "--batch-size", "15"], "not divisible by"),
    "batch-not-divisible-3": ("distributed_apex", ["--nprocs", "3"], "not divisible by"),
    "micro-batch-not-divisible": ("distributed_gradient_accumulation", ["--nprocs", "2", "--grad-accu-steps", "3"],
                                  "--grad-accu-steps 3"),
    "apex-opt-level-O2": ("distributed_apex", ["--opt-level", "O2"], "O1"),
    "amp-dtype-with-float32": ("dataparallel", ["--amp-dtype", "bfloat16"], "--opt-level O1"),
    "init-from-missing": ("distributed", ["--init-from", "/no/such/weights.pt"], "--init-from /no/such"),
    "init-from-with-resume": ("distributed_mp", ["--init-from", "a.pt", "--resume", "b.pt"], "give one of them"),
    "apex-fused-sgd-missing": ("distributed_apex", ["--optimizer", "apex-fused-sgd"], "NVIDIA apex"),
    "no-checkpoint-to-evaluate": ("distributed_mp", ["--evaluate"], "no checkpoint"),
    "bad-flag-value": ("distributed", ["--epochs", "0"], "--epochs"),
    "warmup-as-long-as-training": ("distributed", ["--epochs", "2", "--warmup-epochs", "2"], "--warmup-epochs 2"),
    "node-rank-outside": ("distributed_mp", ["--nnodes", "2", "--node-rank", "2", "--port", "29999"], "--node-rank 2"),
    "negative-lr": ("distributed_mp", ["--lr", "-1"], "--lr"),
    "nan-lr": ("distributed", ["--lr", "nan"], "--lr"),
    "negative-momentum": ("distributed_apex", ["--momentum", "-1"], "--momentum"),
    "infinite-weight-decay": ("dataparallel", ["--weight-decay", "inf"], "--weight-decay"),
    "empty-output-dir": ("distributed_mp", ["--output-dir="], "--output-dir is empty"),
    "ip-does-not-resolve": ("distributed_mp", ["--ip", "no-such-host.invalid"], "does not resolve"),
    "ip-does-not-resolve-torchrun-script": ("distributed", ["--ip", "no-such-host.invalid"], "does not resolve"),
    "pipeline-batch-not-in-microbatches": ("distributed_pipeline", ["--microbatches", "5"], "does not divide into"),
    "pipeline-one-image-microbatches": ("distributed_pipeline", ["--batch-size", "4", "--microbatches", "4"],
                                        "BatchNorm needs two"),
}


def assert_one_line_error(result, expected: str):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error:" in lines[0] and expected in lines[0], lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    module, flags, expected = CASES[case]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # read by torch only before CUDA starts: see skip below
    if torch.cuda.is_available():
        pytest.skip("these inputs are bad only on a machine without a GPU")
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("earlier run\n")
    argv = TINY + ["--output-dir", str(out)] + flags  # a case may give its own --output-dir
    result = run_main(importlib.import_module(module).main, argv, capsys)
    assert_one_line_error(result, expected)
    assert (out / "metrics.jsonl").read_text() == "earlier run\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("module", ["distributed", "distributed_gradient_accumulation"])
def test_an_output_dir_that_is_a_file_is_refused_untouched(module, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    result = run_main(importlib.import_module(module).main, TINY + ["--output-dir", str(out / "run")], capsys)
    assert_one_line_error(result, "is a file, not a directory")
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize("module", ["distributed", "distributed_mp"])  # torchrun's ranks; spawn's parent, before any
def test_an_output_dir_in_a_folder_no_one_can_write_in_is_one_line(module, capsys):
    """The nearest existing folder is tried with a real write (root passes os.access on a read-only disk; /proc takes
    no file even from root): the user reads the flag and the folder, not a traceback at the first checkpoint."""
    result = run_main(importlib.import_module(module).main, TINY + ["--output-dir", "/proc/cifar-run"], capsys)
    assert_one_line_error(result, "--output-dir /proc/cifar-run: cannot write in /proc (")


@pytest.mark.slow
def test_error_in_a_spawned_rank_reaches_the_user_once(tmp_path):
    """A checkpoint of another script: the spawn parent refuses it before starting any process; under
    torchrun the ranks find it themselves, and only rank 0 says so."""
    out = tmp_path / "out"
    out.mkdir()
    check(run(launcher("python", "distributed.py") + TINY + ["--train-samples", "16", "--test-samples", "4",
                                                             "--output-dir", str(out)]))
    before = (out / "checkpoint.pt").read_bytes()
    result = run(launcher("spawn", "distributed_mp.py") + TINY + ["--output-dir", str(out)], timeout=120)
    assert_one_line_error(result, "was written by distributed.py")
    result = run(launcher("torchrun", "distributed_mp.py") + TINY + ["--output-dir", str(out)], timeout=120)
    assert result.returncode != 0 and "was written by distributed.py" in result.stderr
    assert result.stderr.count("was written by distributed.py") == 1
    assert (out / "checkpoint.pt").read_bytes() == before


def test_under_a_launcher_local_rank_0_alone_prints_a_bad_flag_or_the_help(capsys, monkeypatch):
    """torchrun starts N ranks (srun N tasks) that each parse the flags: local rank 0 prints, the others exit as it
    does, silently (or a bad flag's line and --help would come N times, one a rank)."""
    import distributed
    waits = []  # a silent rank exits after local rank 0 would have said why (torchrun stops the others at once)
    monkeypatch.setattr(time, "sleep", waits.append)
    for variable, local_rank, prints in (("LOCAL_RANK", "1", False), ("LOCAL_RANK", "0", True),
                                         ("SLURM_LOCALID", "1", False)):
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        monkeypatch.setenv(variable, local_rank)
        result = run_main(distributed.main, ["--epochs", "-1"], capsys)
        assert result.returncode == 2 and result.stdout == "", result
        assert ("error: argument --epochs" in result.stderr) == prints and result.stderr.count("\n") == prints, result
        result = run_main(distributed.main, ["--help"], capsys)
        assert result.returncode == 0 and ("--batch-size" in result.stdout) == prints and result.stderr == "", result
        result = run_main(distributed.main, ["--ip", "no-such-host.invalid"], capsys)  # found after the parsing
        assert result.returncode == 2 and ("does not resolve" in result.stderr) == prints, result
    assert waits == [30.0] * 4  # a bad flag and the bad --ip on the two silent ranks; not --help's exits (status 0)
    monkeypatch.setattr(errors, "_ranks_met", True)  # once the ranks have met (SafetyNet.running): no rank waits
    monkeypatch.setenv("SLURM_LOCALID", "1")
    result = run_main(distributed.main, ["--ip", "no-such-host.invalid"], capsys)
    assert result.returncode == 2 and result.stderr == "" and waits == [30.0] * 4, (result, waits)


@pytest.mark.parametrize("module", ["distributed", "distributed_mp", "distributed_apex",
                                    "distributed_gradient_accumulation"])
def test_under_torchrun_every_script_checks_its_flags_before_the_rendezvous(module, tmp_path, capsys, monkeypatch):
    """A rank as torchrun starts it (RANK and WORLD_SIZE set): the spawn-style scripts' worker runs the checks that
    distributed.py's main runs, so --evaluate on an empty folder gets the same line, before any process group (a
    MASTER_PORT nobody listens on: reaching the rendezvous would fail with another line)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    result = run_main(importlib.import_module(module).main, TINY + ["--evaluate", "--output-dir", str(tmp_path)],
                      capsys)
    assert_one_line_error(result, f"no checkpoint at {tmp_path / 'checkpoint.pt'}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_bad_flag_under_torchrun_is_said_once_even_when_local_rank_0_parses_last(tmp_path):
    """Local rank 0 says it, though here it starts 3 s after rank 1: a CI run once had rank 1 exit first, silently,
    and torchrun stop rank 0 before it had said anything; the silent ranks now wait for it."""
    late_rank_0 = tmp_path / "late_rank_0.sh"  # torchrun --no-python starts this instead of python
    late_rank_0.write_text(f'#!/bin/sh\n[ "$LOCAL_RANK" = 0 ] && sleep 3\nexec {sys.executable} "$@"\n')
    late_rank_0.chmod(0o755)
    command = launcher("torchrun", "distributed.py")
    command[-1:-1] = ["--no-python", str(late_rank_0)]  # before the script: the wrapper runs python on it
    result = run(command + TINY + ["--epochs", "-1", "--output-dir", str(tmp_path / "out")], timeout=120)
    assert result.returncode != 0 and result.stderr.count("error: argument --epochs") == 1, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the spawn launcher's ranks, which the slow mark is for (it was the one quick test that starts them)
def test_cifar100_absent_says_where_and_what_to_do(tmp_path):
    """Found by the spawned ranks after they met (utils.data.prepare agrees on it in a collective): every rank
    exits at once, as its line is said, none waits for local rank 0 as before a rendezvous (30 s)."""
    clocked = run_clocked(launcher("spawn", "distributed_mp.py") + TINY + ["--dataset", "cifar100", "--data-dir",
                                                                           str(tmp_path / "d"), "--output-dir",
                                                                           str(tmp_path / "out")])
    result = clocked.result
    assert_one_line_error(result, str(tmp_path / "d"))
    seconds = clocked.seconds_after("error:")
    assert seconds < AFTER_THE_LINE_S, f"{seconds:.1f} s from the line to the exit: a rank waited after the ranks met"
    assert "cifar-100-python.tar.gz" in result.stderr and "--dataset synthetic" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["torchrun", "spawn"])
def test_an_error_after_the_rendezvous_returns_in_seconds(launch, tmp_path):
    """Too few images for one batch, found in train() after the ranks met (2 CPU ranks): one line, and the shell
    has its prompt back within seconds (was 31 s under torchrun, 39 s under spawn: the ranks but local rank 0 waited
    30 s, a wait meant only for errors before the rendezvous, and the launcher's SIGTERM did not end it)."""
    script = "distributed.py" if launch == "torchrun" else "distributed_mp.py"
    clocked = run_clocked(launcher(launch, script) + TINY + ["--train-samples", "8", "--output-dir",
                                                             str(tmp_path / "out")])
    result = clocked.result
    said = [line for line in result.stderr.splitlines() if "training images make no whole batch" in line]
    assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
    seconds = clocked.seconds_after("training images make no whole batch")
    assert seconds < AFTER_THE_LINE_S, f"{seconds:.1f} s from the line to the exit: a rank waited for local rank 0"


@pytest.mark.slow
def test_a_check_before_the_rendezvous_under_torchrun_returns_once_local_rank_0_has_said_it(tmp_path):
    """distributed_mp.py under torchrun, --evaluate on an empty folder: its worker's checks refuse it before the
    rendezvous (as distributed.py's main does), local rank 0 says it once, and rank 1's wait for it (meant for a
    local rank 0 still importing torch) ends when torchrun stops it, not after 30 s."""
    (tmp_path / "out").mkdir()
    clocked = run_clocked(launcher("torchrun", "distributed_mp.py") + TINY + ["--evaluate", "--output-dir",
                                                                              str(tmp_path / "out")])
    result = clocked.result
    assert result.returncode != 0 and result.stderr.count("error: no checkpoint at") == 1, result.stderr[-3000:]
    seconds = clocked.seconds_after("error: no checkpoint at")
    assert seconds < AFTER_THE_LINE_S, f"{seconds:.1f} s: torchrun's SIGTERM, once local rank 0 exits, should end " \
        "rank 1's wait (30 s)"


@pytest.mark.slow
def test_cifar100_absent_under_torchrun_is_reported_once(tmp_path):
    result = run(launcher("python", "distributed.py") + TINY + ["--dataset", "cifar100", "--data-dir",
                                                                str(tmp_path / "d")], timeout=120)
    assert_one_line_error(result, "--dataset synthetic")


def test_port_in_use(tmp_path, capsys):
    import distributed_mp
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_main(distributed_mp.main, TINY + ["--port", str(port), "--output-dir", str(tmp_path / "out")],
                          capsys)  # the spawn parent checks the port before any rank starts
    assert_one_line_error(result, f"127.0.0.1:{port}")


def test_more_processes_than_gpus_with_nccl(monkeypatch):
    """Needs GPUs to reach through a script; the check itself is tested with a pretended count."""
    monkeypatch.setattr(launch, "resolve_device", lambda flag: "cuda")
    args = SimpleNamespace(device="cuda", backend="auto")
    with pytest.raises(UsageError, match="4 processes on this machine but only 2 GPU"):
        spawn.check_launch(args, local_processes=4, gpu_count=2)
    spawn.check_launch(args, local_processes=2, gpu_count=2)


def test_corrupt_checkpoint_is_refused_and_left_untouched(tmp_path, capsys):
    """Refused by the checks before the process group forms: main(argv) in this process, as `python distributed.py`
    runs it."""
    import distributed
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    before = (out / "checkpoint.pt").read_bytes()
    result = run_main(distributed.main, TINY + ["--output-dir", str(out)], capsys)
    assert_one_line_error(result, "not a readable checkpoint")
    assert (out / "checkpoint.pt").read_bytes() == before


@pytest.mark.parametrize(("world_size", "flags", "says"), [
    ("9", [], "ResNet-18 splits into at most 8 (one residual block each)"),
    ("3", ["--microbatches", "2", "--batch-size", "16"], "--microbatches 2 is fewer than the 3 stages"),
])
def test_a_pipeline_that_cannot_work_is_refused_before_its_ranks_meet(world_size, flags, says, tmp_path, capsys,
                                                                      monkeypatch):
    """distributed_pipeline.py on more ranks than ResNet-18 has blocks, or with fewer micro-batches than stages
    (torch's schedules hang: pytorch/torchtitan#775): one line from the rank torchrun started, before any process
    group (MASTER_PORT 1: nobody listens there)."""
    import distributed_pipeline
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in dict(RANK="0", WORLD_SIZE=world_size, LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    result = run_main(distributed_pipeline.main, TINY + flags + ["--output-dir", str(tmp_path / "out")], capsys)
    assert_one_line_error(result, says)
    assert not (tmp_path / "out").exists()


def test_a_pipeline_on_an_output_dir_another_run_holds_is_refused_touching_nothing(tmp_path, capsys, monkeypatch):
    """One run per directory, for the pipeline as for every script: a stage started by torchrun on a folder whose
    lock another run holds (here this process, as a second open of the lock would be) says so in one line before any
    process group, and the other run's checkpoint stays as it was."""
    import distributed_pipeline
    from safety_net import checkpoint
    out = tmp_path / "out"
    (out / "checkpoint.dcp").mkdir(parents=True)
    (out / "checkpoint.dcp" / "run.pt").write_bytes(b"the other run's")
    held = checkpoint.lock_output_dir(str(out))
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT="1").items():
            monkeypatch.setenv(name, value)
        result = run_main(distributed_pipeline.main, TINY + ["--output-dir", str(out)], capsys)
    finally:
        os.close(held)
    assert_one_line_error(result, f"--output-dir {out} is in use by another run (process {os.getpid()}")
    assert sorted(p.name for p in out.iterdir()) == sorted([checkpoint.LOCKNAME, "checkpoint.dcp"])
    assert (out / "checkpoint.dcp" / "run.pt").read_bytes() == b"the other run's"


@pytest.mark.parametrize("module", ["distributed", "distributed_mp", "distributed_apex",
                                    "distributed_gradient_accumulation", "dataparallel", "distributed_fsdp",
                                    "distributed_pipeline"])
def test_every_flag_has_help(module, monkeypatch):
    script = importlib.import_module(module)
    parsers = []
    parse = script.flags.parse
    monkeypatch.setattr(script.flags, "parse", lambda parser, argv=None: parsers.append(parser) or parse(parser, argv))
    script.parse_args([])
    (parser,) = parsers
    missing = [action.option_strings for action in parser._actions if action.option_strings and not action.help]
    assert not missing, f"flags without help: {missing}"
    assert len(parser._actions) >= 17


def test_help_shows_defaults_that_say_something(capsys, monkeypatch):
    """--help states a flag's default, but not "None" or "False", nor twice when its help already does."""
    import distributed
    monkeypatch.setenv("COLUMNS", "80")  # a subprocess's width: argparse wraps to the terminal's
    result = run_main(distributed.main, ["--help"], capsys)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "number of training epochs (default: 30)" in text
    assert "and the augmentation (default: 0)" in text  # --seed: 0 is a value, not "nothing to show"
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "when there is one) (default" not in text  # --resume's help states its default itself
