"""Several machines, played on one host: each test starts two launcher processes ("machines") of one
rank each, and their 2-rank job must end with the weights of the same job on one machine, to the bit."""
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from processes import two_hosts
from script_runs import ROOT, TINY, load_checkpoint, subprocess_env

from benchmarks import network
from utils.errors import UsageError
from utils.launch import first_host, slurm_address
from utils.spawn import check_port_free, free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def start_machines(commands, timeout=240, envs=None):
    """Start one command per "machine" at once; wait for all; return their results."""
    envs = envs or [{}] * len(commands)
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(**env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd, env in zip(commands, envs, strict=True)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def assert_all_ok(results):
    for r in results:
        assert r.returncode == 0, f"{r.args}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def assert_same_bits(reference, out):
    expected, got = load_checkpoint(reference), load_checkpoint(out)
    assert got["world_size"] == 2
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


@pytest.mark.slow
def test_two_torchrun_agents_on_a_c10d_endpoint(runs, tmp_path):
    port = free_port()
    cmd = TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                      "--rdzv-id=two-machines", str(ROOT / "distributed.py")] + TINY + ["--output-dir", str(tmp_path)]
    assert_all_ok(start_machines([cmd, cmd]))
    assert_same_bits(runs("torchrun", "torchrun", "distributed.py"), tmp_path)


@pytest.mark.slow
def test_two_torchrun_agents_with_a_static_master(runs, tmp_path):
    port = free_port()
    cmds = [TORCHRUN + ["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                        f"--master_port={port}", str(ROOT / "distributed.py")] + TINY + ["--output-dir", str(tmp_path)]
            for node in (0, 1)]
    assert_all_ok(start_machines(cmds))
    assert_same_bits(runs("torchrun", "torchrun", "distributed.py"), tmp_path)


@pytest.mark.slow
def test_two_spawn_machines_with_node_ranks(runs, tmp_path):
    port = free_port()
    cmds = [[sys.executable, str(ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank", str(node),
             "--nprocs", "1", "--ip", "127.0.0.1", "--port", str(port)] + TINY + ["--output-dir", str(tmp_path)]
            for node in (0, 1)]
    assert_all_ok(start_machines(cmds))
    assert_same_bits(runs("spawn", "spawn", "distributed_mp.py"), tmp_path)


@pytest.mark.slow
def test_srun_without_a_launcher(runs, tmp_path):
    """What srun sets for 2 tasks on one node; the store's host comes from the node list."""
    cmd = [sys.executable, str(ROOT / "distributed.py")] + TINY + ["--output-dir", str(tmp_path)]
    port = str(free_port())
    envs = [{"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port} for r in (0, 1)]
    results = start_machines([cmd, cmd], envs=envs)
    assert_all_ok(results)
    assert_same_bits(runs("torchrun", "torchrun", "distributed.py"), tmp_path)


def test_first_host_of_a_slurm_node_list():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node-a,node-b") == "node-a"
    assert first_host("n[001-004]-ib") == "n001-ib"


def test_slurm_rendezvous_address(monkeypatch):
    """--port alone keeps the node list's first host (not this machine's loopback)."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[3-4]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert slurm_address(SimpleNamespace(ip=None, port=None)) == ("gpu3", 29956)
    assert slurm_address(SimpleNamespace(ip=None, port=29000)) == ("gpu3", 29000)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert slurm_address(SimpleNamespace(ip=None, port=None)) == ("10.0.0.1", 29956)
    assert slurm_address(SimpleNamespace(ip="10.0.0.2", port=None)) == ("10.0.0.2", 29956)


def last_line(result):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_a_machine_that_cannot_reach_the_master_says_where_it_looked(tmp_path):
    port = free_port()  # nobody listens there
    cmd = [sys.executable, str(ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank", "1", "--nprocs", "1",
           "--ip", "127.0.0.1", "--port", str(port), "--dist-timeout", "3"] + TINY + ["--output-dir", str(tmp_path)]
    (result,) = start_machines([cmd], timeout=60)
    assert result.returncode == 2
    assert f"could not reach the rendezvous at 127.0.0.1:{port}" in last_line(result), result.stderr[-2000:]
    assert not (tmp_path / "checkpoint.pt").exists()


def test_the_port_of_a_run_just_ended_is_free_for_the_next_and_one_listened_on_is_not():
    """The spawn scripts check --port before they start: a store that still listens there is refused; the port of a
    run that just ended, whose connections wait out TCP's TIME_WAIT (a minute), is not (the store reuses it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the store's end closes first: its port waits in TIME_WAIT
    client.close()
    with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port}"):
        check_port_free("127.0.0.1", port)
    listener.close()
    check_port_free("127.0.0.1", port)


@pytest.mark.slow
def test_machines_that_disagree_on_the_job_are_stopped_before_training(tmp_path):
    port = free_port()
    cmds = [[sys.executable, str(ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank", str(node),
             "--nprocs", str(nprocs), "--ip", "127.0.0.1", "--port", str(port), "--dist-timeout", "5"]
            + TINY + ["--output-dir", str(tmp_path)] for node, nprocs in ((0, 1), (1, 2))]
    first, second = start_machines(cmds, timeout=120)
    assert first.returncode == 2 and second.returncode == 2
    for machine in (first, second):  # each within --dist-timeout, one line naming the likely cause
        ours = [line for line in machine.stderr.splitlines() if line.startswith("distributed_mp.py: error:")]
        assert len(ours) == 1 and f"not all processes joined at 127.0.0.1:{port}" in ours[0], machine.stderr[-3000:]
        assert "with the same --nnodes and --nprocs?" in ours[0] and "Traceback" not in machine.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_hosts_in_network_namespaces(runs, tmp_path):
    with two_hosts() as hosts:
        cmds = [hosts.prefix(node) + [sys.executable, str(ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank",
                                      str(node), "--nprocs", "1", "--ip", network.ADDRESSES[0], "--port", "29555"]
                + TINY + ["--output-dir", str(tmp_path)] for node in (0, 1)]
        results = start_machines(cmds, envs=[{"GLOO_SOCKET_IFNAME": iface} for iface in network.INTERFACES])
    assert_all_ok(results)
    assert_same_bits(runs("spawn", "spawn", "distributed_mp.py"), tmp_path)
