"""Machines that come and go: torchrun's elastic launch (--nnodes=1:2, a c10d rendezvous on host 0) on two hosts,
network namespaces joined by a veth pair (benchmarks.network's TwoHosts), one rank each; skipped without root.

One run is made for the module and read by several tests: host 0 starts alone (world 1); host 1 joins in the middle
of an epoch (torchrun stops host 0's worker with SIGTERM, the safety net writes the step it stops at, and a new round
starts both at world 2 from it); then host 1 is killed outright, every process of it (host 0's worker fails its
collective, its agent restarts it at world 1 from the newest checkpoint). Its model is the float64 stand-in of
test_scripts_equal (tests/script_driver.py --model float64), so that what it computes compares with the same run on
one process to 1e-9; each step is paced to last 1 s (--step-seconds) so that the join and the kill land mid-epoch on a
slow machine too. Every torchrun has TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it the join hangs (utils.launch's
joins_hang says why).
"""
import json
import re
import subprocess
import sys
import time

import processes
import pytest
import torch
from processes import two_hosts
from script_runs import ROOT, TINY, load_checkpoint, read_metrics, subprocess_env

from benchmarks import network
from examples.local_processes import alive, process_tree
from utils.launch import joins_hang
from utils.spawn import free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PORT = 29400  # the rendezvous, on host 0's address: each host is a namespace of its own, no other job is there
EPOCHS, STEPS = 3, 12  # steps an epoch: a global batch of 8 over 96 images
TRAINING = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "96", "--test-samples", "21",
            "--batch-size", "8", "--epochs", str(EPOCHS), "--workers", "0", "--print-freq", "1",
            "--save-every-steps", "3"]
STEP = re.compile(r"^epoch (\d+)/\d+ step (\d+)/\d+ loss")
RESUMED = re.compile(r"^resuming from .*: epoch (\d+), step (\d+) \(checkpoint of (\d+) process\(es\).*\) on (\d+)$")
WAIT_S = processes.Machine.WAIT_S


class Machine(processes.Machine):
    """One host's elastic torchrun."""

    def __init__(self, hosts, host: int, output_dir, restarts: int = 1):
        rdzv = "last_call_timeout=3" + (",is_host=1" if host == 0 else "")  # one hostname in both namespaces
        cmd = hosts.prefix(host) + TORCHRUN + [
            "--nnodes=1:2", "--nproc_per_node=1", f"--max-restarts={restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={network.ADDRESSES[0]}:{PORT}", "--rdzv-id=elastic", f"--rdzv-conf={rdzv}",
            f"--local-addr={network.ADDRESSES[host]}", str(ROOT / "tests" / "script_driver.py"), "--model", "float64",
            "--step-seconds", "1", "distributed.py", *TRAINING, "--output-dir", str(output_dir)]
        super().__init__(cmd, subprocess_env(GLOO_SOCKET_IFNAME=network.INTERFACES[host],
                                             TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                             LOGLEVEL="INFO"))  # the agent's lines, among them each restart


@pytest.fixture(scope="module")
def hosts():
    with two_hosts("elastic-test") as made:
        yield made


@pytest.fixture(scope="module")
def grown_and_shrunk(hosts, tmp_path_factory):
    """The module's run, world 1 -> 2 -> 1: both machines, the output folder and the times of each event."""
    out = tmp_path_factory.mktemp("elastic")
    machines = [first := Machine(hosts, 0, out)]
    try:
        first.wait_for(STEP)  # world 1 is training
        machines.append(second := Machine(hosts, 1, out))
        joined, grown = first.wait_for(RESUMED, after=second.started)
        first_at_two, _ = first.wait_for(STEP, after=joined)
        first.wait_for(STEP, after=first.wait_for(STEP, after=first_at_two)[0])  # two more steps at world 2
        killed_at = time.monotonic()
        killed = second.kill()
        left, shrunk = first.wait_for(RESUMED, after=killed_at)
        first_at_one, _ = first.wait_for(STEP, after=left)
        status = first.proc.wait(timeout=WAIT_S)
        first.reader.join(timeout=10)
        return dict(first=first, second=second, out=out, grown=grown, shrunk=shrunk, status=status, killed=killed,
                    killed_at=killed_at, join_pause=first_at_two - second.started, leave_pause=first_at_one - killed_at)
    finally:
        for machine in machines:
            if machine.proc.poll() is None:
                machine.kill()


def steps_printed(text: str) -> list[tuple[int, int]]:
    return [(int(m[1]), int(m[2])) for line in text.splitlines() if (m := STEP.search(line))]


@pytest.mark.slow
def test_a_join_stops_at_a_step_and_continues_at_world_2_from_it(grown_and_shrunk):
    run = grown_and_shrunk
    epoch, step, writers, world = map(int, run["grown"].groups())
    assert (writers, world) == (1, 2), run["first"].text()[-3000:]
    stopped = re.search(r"stopping after step (\d+)/\d+ of epoch (\d+) with a checkpoint", run["first"].text())
    assert stopped and (int(stopped[2]), int(stopped[1])) == (epoch, step), run["first"].text()[-3000:]
    before_the_kill = steps_printed("\n".join(line for when, line in run["first"].lines if when < run["killed_at"]))
    assert len(before_the_kill) == len(set(before_the_kill)), f"a step done twice across the join: {before_the_kill}"
    print(f"join: {run['join_pause']:.1f} s from host 1's start to the first step at world 2")


@pytest.mark.slow
def test_a_leave_restarts_host_0_at_world_1_from_the_newest_checkpoint(grown_and_shrunk):
    run = grown_and_shrunk
    _, _, writers, world = map(int, run["shrunk"].groups())
    assert (writers, world) == (2, 1), run["first"].text()[-3000:]
    assert run["status"] == 0, run["first"].text()[-3000:]
    assert not alive(run["killed"])
    printed = steps_printed(run["first"].text())
    flat = [(e - 1) * STEPS + s for e, s in printed]
    redone = [step for i, step in enumerate(flat) if step <= max(flat[:i], default=0)]
    assert len(redone) <= 3, f"steps done twice: {redone} (--save-every-steps 3)"
    print(f"leave: {run['leave_pause']:.1f} s from the kill to the first step at world 1, {len(redone)} steps redone "
          f"(--save-every-steps 3)")


@pytest.mark.slow
def test_a_join_uses_no_restart_and_a_leave_one(grown_and_shrunk):
    """Under --max-restarts=1 the run joined and left and ended with status 0: host 0's agent restarted its workers
    on the join without counting it, and on the leave counted the one restart it had (its own log lines). The
    opt-out in its environment, the warning is not printed."""
    run = grown_and_shrunk
    text = run["first"].text()
    assert run["status"] == 0 and text.count("resuming from") == 2
    assert text.count("Detected 1 new nodes from group_rank=0; will restart worker group") == 1, text[-3000:]
    assert text.count("Worker group FAILED. 1/1 attempts left; will restart worker group") == 1, text[-3000:]
    assert "attempts left" not in text.split("Detected 1 new nodes")[0]  # nothing counted before the join
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs" not in run["first"].text()


@pytest.mark.slow
def test_an_elastic_launch_whose_join_would_hang_says_so_at_start(tmp_path):
    """Without the opt-out, --nnodes=1:2: one line at start (once), and the run alone goes on (world 1)."""
    port = free_port()
    cmd = TORCHRUN + ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                      "--rdzv-id=warned", "--rdzv-conf=last_call_timeout=1", str(ROOT / "distributed.py"), *TINY,
                      "--output-dir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line]
    assert warned == ["distributed.py: warning: under torchrun --nnodes=MIN:MAX a machine that joins this job hangs "
                      "the rendezvous (torch's shared store); start every torchrun with "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/fault_tolerance.md#machines-that-come-and-go)"]


@pytest.mark.slow
def test_the_run_that_grew_and_shrank_computes_what_one_process_computes(grown_and_shrunk, tmp_path):
    run = grown_and_shrunk
    printed = steps_printed(run["first"].text())
    assert sorted(set(printed)) == [(e, s) for e in range(1, EPOCHS + 1) for s in range(1, STEPS + 1)]
    assert [m["epoch"] for m in read_metrics(run["out"])] == list(range(1, EPOCHS + 1))
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=1", str(ROOT / "tests" / "script_driver.py"), "--model",
                      "float64", "distributed.py", *TRAINING, "--output-dir", str(tmp_path)]
    one = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert one.returncode == 0, one.stderr[-3000:]
    expected, got = load_checkpoint(tmp_path), load_checkpoint(run["out"])
    assert (got["epoch"], got["world_size"]) == (EPOCHS, 1)
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-7, atol=1e-9, msg=name)
    for mine, theirs in zip(read_metrics(run["out"]), read_metrics(tmp_path), strict=True):
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-7)
    # --evaluate of its last checkpoint, in one process: the run's own last evaluation (at world 1), every image once
    evaluated = subprocess.run(cmd[:-1] + [str(run["out"]), "--evaluate"], cwd=ROOT, env=subprocess_env(),
                               capture_output=True, text=True, timeout=WAIT_S)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result, last = json.loads((run["out"] / "eval.json").read_text()), read_metrics(run["out"])[-1]
    assert result["samples"] == last["samples"] == 21 and result["top1"] == last["top1"]
    assert result["test_loss"] == pytest.approx(last["test_loss"], rel=1e-12)


@pytest.mark.slow
def test_without_the_rendezvous_host_the_other_machine_ends_and_says_why(hosts, tmp_path):
    first, second = Machine(hosts, 0, tmp_path), Machine(hosts, 1, tmp_path)
    try:
        first.wait_for(re.compile(r"^epoch 1/\d+ step 2/"))
        killed_at = time.monotonic()
        first.kill()
        status = second.proc.wait(timeout=WAIT_S)
        ended = time.monotonic() - killed_at
        second.reader.join(timeout=10)
    finally:
        for machine in (first, second):
            if machine.proc.poll() is None:
                machine.kill()
    print(f"rendezvous host lost: host 1's torchrun ended {ended:.1f} s after host 0 was killed (status {status})")
    # its agent's keep-alive to the rendezvous fails at once (the store's socket is reset), it stops its worker
    # (SIGTERM) and exits; torch's keep-alive gives up after 3 tries 5 s apart where no reset comes (a cut link)
    assert status == 1 and ended < 20, second.text()[-3000:]
    assert "RendezvousConnectionError: The connection to the C10d store has failed" in second.text()
    assert not alive(process_tree(second.proc.pid)[1:])


@pytest.mark.parametrize("agent, shared, hangs", [
    (["torchrun", "--nnodes=1:2", "x.py"], "True", True), (["torchrun", "--nnodes", "1:4", "x.py"], "True", True),
    (["torchrun", "--nnodes=1:2", "x.py"], "False", False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set it so
    (["torchrun", "--nnodes=2", "x.py"], "True", False), (["torchrun", "--nnodes=2:2", "x.py"], "True", False),
    (["torchrun", "--nnodes=1:2", "--nnodes", "2", "x.py"], "True", False),  # argparse keeps the last
    (["torchrun", "--standalone", "x.py"], "True", False), ([], "True", False),
    (["torchrun", "--nnodes"], "True", False)])
def test_a_join_hangs_only_under_a_range_of_machines_with_the_store_shared(agent, shared, hangs):
    assert joins_hang({"TORCHELASTIC_USE_AGENT_STORE": shared}, agent) is hangs
