"""Each bad input: one line on stderr naming the problem, exit status 2, nothing overwritten."""
import socket
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, launcher, run

from utils import dist
from utils.errors import UsageError

CASES = {
    "gpu-not-visible": (["python", "dataparallel.py", "--gpu", "3"], "--gpu 3"),
    "cuda-without-gpu": (["python", "distributed.py", "--device", "cuda"], "--device cuda"),
    "nccl-without-gpu": (["spawn", "distributed_mp.py", "--backend", "nccl"], "--backend nccl"),
    "batch-not-divisible": (["spawn", "distributed_mp.py", "--batch-size", "15"], "not divisible by"),
    "batch-not-divisible-torchrun-world": (["python", "distributed_apex.py", "--nprocs", "3"], "not divisible by"),
    "micro-batch-not-divisible": (["spawn", "distributed_gradient_accumulation.py", "--grad-accu-steps", "3"],
                                  "--grad-accu-steps 3"),
    "apex-opt-level-O2": (["spawn", "distributed_apex.py", "--opt-level", "O2"], "O1"),
    "apex-fused-sgd-missing": (["spawn", "distributed_apex.py", "--optimizer", "apex-fused-sgd"], "NVIDIA apex"),
    "no-snapshot-to-evaluate": (["spawn", "distributed_mp.py", "--evaluate"], "no snapshot"),
    "bad-flag-value": (["python", "distributed.py", "--epochs", "0"], "--epochs"),
    "node-rank-outside": (["spawn", "distributed_mp.py", "--nnodes", "2", "--node-rank", "2", "--port", "29999"],
                          "--node-rank 2"),
}


def run_bad(kind_and_script: list[str], extra: list[str], out):
    kind, script, *flags = kind_and_script
    return run(launcher(kind, script) + TINY + flags + extra + ["--output-dir", str(out)], timeout=120)


def assert_one_line_error(result, expected: str):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error:" in lines[0] and expected in lines[0], lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    command, expected = CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("earlier run\n")
    result = run_bad(command, [], out)
    assert_one_line_error(result, expected)
    assert (out / "metrics.jsonl").read_text() == "earlier run\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_cifar100_absent_says_where_and_what_to_do(tmp_path):
    result = run_bad(["spawn", "distributed_mp.py"], ["--dataset", "cifar100", "--data-dir", str(tmp_path / "d")],
                     tmp_path / "out")
    assert_one_line_error(result, str(tmp_path / "d"))
    assert "cifar-100-python.tar.gz" in result.stderr and "--dataset synthetic" in result.stderr
    assert not (tmp_path / "out").exists()


def test_cifar100_absent_under_torchrun_is_reported_once(tmp_path):
    result = run(launcher("python", "distributed.py") + TINY + ["--dataset", "cifar100", "--data-dir",
                                                                str(tmp_path / "d")], timeout=120)
    assert_one_line_error(result, "--dataset synthetic")


def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_bad(["spawn", "distributed_mp.py", "--port", str(port)], [], tmp_path / "out")
    assert_one_line_error(result, f"127.0.0.1:{port}")


def test_more_processes_than_gpus_with_nccl(monkeypatch):
    """Needs GPUs to reach through a script; the check itself is tested with a pretended count."""
    monkeypatch.setattr(dist, "resolve_device", lambda flag: "cuda")
    args = SimpleNamespace(device="cuda", backend="auto")
    with pytest.raises(UsageError, match="4 processes on this machine but only 2 GPU"):
        dist.check_launch(args, local_processes=4, gpu_count=2)
    dist.check_launch(args, local_processes=2, gpu_count=2)


def test_corrupt_snapshot_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a snapshot")
    before = (out / "checkpoint.pt").read_bytes()
    result = run(launcher("python", "distributed.py") + TINY + ["--output-dir", str(out)], timeout=120)
    assert_one_line_error(result, "not a readable snapshot")
    assert (out / "checkpoint.pt").read_bytes() == before


def test_every_flag_has_help():
    for script in ("distributed.py", "distributed_mp.py", "distributed_apex.py",
                   "distributed_gradient_accumulation.py", "dataparallel.py"):
        result = run(launcher("python", script) + ["--help"], timeout=60)
        assert result.returncode == 0
        source = (ROOT / script).read_text()
        assert "help=" in source or script == "distributed_mp.py"
        for line in result.stdout.splitlines():
            stripped = line.strip()
            if stripped.startswith("--") and "  " not in stripped:
                # argparse wraps a flag without help onto a line of its own, with nothing after it
                nxt = result.stdout.splitlines()[result.stdout.splitlines().index(line) + 1]
                assert nxt.startswith(" " * 10), f"{script}: {stripped} has no help"
