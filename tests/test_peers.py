"""The benchmark's peers train the collection's workload: the tuned tutorial loop (benchmarks/peers/plain_ddp.py
--tuned's channels-last weights and inputs and fused SGD; its torch.compile is left to the GPU check, since
compiling ResNet-18 on these CPUs takes most of a minute) gives distributed.py's losses, step for step, on the
same model, seed, batch and images."""
import json
import subprocess
import sys

import pytest
from script_runs import ROOT, check, subprocess_env

from utils.spawn import free_port

STEPS = ["--device", "cpu", "--lr", "0.1", "--workers", "0", "--no-augment"]  # 16 images, one step an epoch, 2 epochs


@pytest.mark.slow
def test_the_tuned_peer_takes_the_steps_of_distributed_py(tmp_path):
    """The first step's loss (the same weights from --seed 0 on the same 16 images) agrees to the 4 decimals ours
    prints, and the second's (after one SGD step of lr 0.1, momentum 0.9, weight decay 5e-4 on both) to 1e-3:
    channels-last, the fused kernel and the threads' summation order (two processes share the 2 cores) change the
    order of the arithmetic, which one step of a fresh ResNet-18 amplifies to about 3e-4 here. Measured beside it:
    --seed 1 moves the first loss by 0.1, and a learning rate 10% lower the second by 8e-3."""
    one_process = subprocess_env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=str(free_port()))
    peer = subprocess.Popen([sys.executable, "-m", "benchmarks.peers.plain_ddp", *STEPS, "--batch-size", "16",
                             "--steps", "1", "--epochs", "2", "--seed", "0", "--channels-last", "--fused-sgd"],
                            cwd=ROOT, env=one_process, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ours = check(subprocess.run([sys.executable, "distributed.py", *STEPS, "--dataset", "synthetic", "--train-samples",
                                 "16", "--test-samples", "16", "--batch-size", "16", "--epochs", "2", "--seed", "0",
                                 "--no-sync-bn", "--print-freq", "1", "--output-dir", str(tmp_path / "run")],
                                cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300))
    out, err = peer.communicate(timeout=300)
    assert peer.returncode == 0, err[-3000:]
    peer_losses = [json.loads(line)["train_loss"] for line in out.splitlines() if line.startswith("{")]
    our_losses = [float(line.split(" loss ")[1].split()[0]) for line in ours.stdout.splitlines()
                  if " step 1/1 loss " in line]
    assert len(peer_losses) == len(our_losses) == 2, (out, ours.stdout)
    assert peer_losses[0] == pytest.approx(our_losses[0], abs=1e-4), (peer_losses, our_losses)  # 4 decimals
    assert peer_losses[1] == pytest.approx(our_losses[1], rel=1e-3), (peer_losses, our_losses)


def test_the_tuned_peer_is_a_row_beside_our_compiled_graph_row(monkeypatch):
    """In the benchmark, our fastest row (compiled, in CUDA graphs) is compared with the tuned loop of its precision,
    whose flags its program accepts; on the CPU it is left out of --quick, as the compiled ceiling is."""
    from benchmarks import run as bench
    from benchmarks.peers import plain_ddp
    assert bench.ours_beside_peers("cuda")["DDP + bfloat16, CUDA graphs, compiled"] == bench.TUNED_LOOP_BF16
    (tuned,) = [r for r in bench.rows("cuda") if r.name == bench.TUNED_LOOP_BF16]
    assert (tuned.script, tuned.table, tuned.amp) == (bench.PLAIN, "peer", "bfloat16") and not tuned.full_only
    assert [r.full_only for r in bench.rows("cpu") if r.name == bench.TUNED_LOOP_BF16] == [True]
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = plain_ddp.parse_args([*tuned.flags, "--device", "cpu"])
    assert args.compile and args.channels_last and args.fused_sgd and args.precision == "bfloat16"
