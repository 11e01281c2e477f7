"""When the link between machines fails: DDP (distributed.py, its CpuSyncBatchNorm on) under torchrun on two hosts,
network namespaces joined by a veth pair (benchmarks.network's TwoHosts), one rank each, the link set down on host 0's
end as a pulled cable (nothing passes, no connection is reset); skipped without root.

A short outage: the run waits it out and ends on the weights of the same run never cut, bit for bit. A lasting cut:
every process on both hosts ends about --dist-timeout after the cut with one line that names the wait's flag, the
newest checkpoint is intact, and with the link back the same command continues from it to the same weights.
"""
import re
import subprocess
import time

import pytest
import torch
from processes import Machine, two_hosts
from script_runs import ROOT, load_checkpoint, subprocess_env

from benchmarks import link_faults, network
from benchmarks.link_faults import CUT_AFTER, PORT, STEP, TORCHRUN, TRAINING, cut_after, stood_still
from safety_net import crash_report

TIMEOUT_S = 10  # --dist-timeout
STEPS = 12  # a global batch of 8 over TRAINING's 96 images
OUTAGE_S = 3


def as_test(command: tuple[list[str], dict]) -> Machine:
    """A command of benchmarks.link_faults, started as the tests start theirs (subprocess_env: no launcher's
    variables of the test's own environment)."""
    cmd, env = command
    return Machine(cmd, subprocess_env(**{name: env[name] for name in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}))


def on_host(hosts, host: int, output_dir, launcher: str = "torchrun", script: str = "distributed.py",
            flags: tuple[str, ...] = ()) -> Machine:
    """One host's launcher as a user starts a fixed pair (benchmarks.link_faults' host_command): torchrun with a
    static rendezvous and `script`, or distributed_mp.py spawning its rank."""
    return as_test(link_faults.host_command(hosts, host, output_dir, launcher, script,
                                            ("--dist-timeout", str(TIMEOUT_S), *flags)))


@pytest.fixture(scope="module")
def hosts():
    with two_hosts("link-test", named=True) as made:  # named: torchft advertises its servers by hostname
        yield made


def run_both(hosts, output_dir, launcher: str = "torchrun", during=None, **script) -> list[Machine]:
    """Both hosts' launchers on `output_dir` (`script`: Host's script and flags); `during(machines)` while they run;
    back once both have exited, or killed with every process of theirs when the test fails."""
    return link_faults.both(hosts, [on_host(hosts, host, output_dir, launcher, **script) for host in (0, 1)], during)


@pytest.fixture(scope="module")
def never_cut(hosts, tmp_path_factory):
    """The weights of the run with its link up throughout (torchrun's and the spawn script's are the same:
    test_multinode)."""
    out = tmp_path_factory.mktemp("never-cut")
    for machine in run_both(hosts, out):
        assert machine.status == 0, machine.text()[-3000:]
    return load_checkpoint(out)["model"]


def assert_same_weights(expected: dict, output_dir):
    got = load_checkpoint(output_dir)
    assert (got["epoch"], got["step"], got["world_size"]) == (1, 0, 2)
    for name, tensor in expected.items():
        assert torch.equal(got["model"][name], tensor), name


def namespace_processes(hosts) -> list[str]:
    return [pid for name in hosts.names
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_short_outage_is_waited_out_and_the_run_ends_on_the_uncut_weights(launcher, hosts, never_cut, tmp_path):
    cut = {}

    def one_outage(machines):
        cut["at"] = cut_after(hosts, machines[0], CUT_AFTER, OUTAGE_S)

    first, second = run_both(hosts, tmp_path, launcher, one_outage)
    assert first.status == second.status == 0, first.text()[-3000:] + second.text()[-3000:]
    assert_same_weights(never_cut, tmp_path)
    steps = {int(match[1]): when for when, line in first.lines if (match := STEP.search(line))}
    assert sorted(steps) == list(range(1, STEPS + 1))
    intervals = sorted(steps[s] - steps[s - 1] for s in range(2, STEPS + 1))
    still = stood_still(first, cut["at"])
    assert still is not None and still >= OUTAGE_S, f"the run did not wait for the link: {still} s between two steps"
    print(f"{launcher}, a {OUTAGE_S} s outage: {still:.1f} s between the step lines on either side of it "
          f"(a step takes {intervals[len(intervals) // 2]:.2f} s, median)")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_lasting_cut_ends_every_process_in_time_and_the_same_command_continues(launcher, hosts, never_cut,
                                                                                 tmp_path):
    cut = {}

    def for_good(machines):
        cut["at"] = cut_after(hosts, machines[0], CUT_AFTER)
        for machine in machines:
            machine.status, machine.exited = machine.ended()
        cut["left"] = namespace_processes(hosts)  # before the link comes back, as a user would find them

    machines = run_both(hosts, tmp_path, launcher, for_good)
    for host, machine in enumerate(machines):
        took = machine.exited - cut["at"]
        said = [line for _, line in machine.lines if "error:" in line]
        assert machine.status != 0 and TIMEOUT_S - 1 < took < TIMEOUT_S + 15, (host, took, machine.text()[-3000:])
        assert len(said) == 1 and f"rank {host}: no answer from another rank for {TIMEOUT_S} s in " in said[0] \
            and "(--dist-timeout sets the wait)" in said[0], machine.text()[-3000:]
        print(f"{launcher}, host {host}: exit status {machine.status} {took:.1f} s after a lasting cut (--dist-timeout "
              f"{TIMEOUT_S})")
    assert cut["left"] == [], cut["left"]
    assert load_checkpoint(tmp_path)["step"] == 3  # intact and readable: the step before the cut

    again = run_both(hosts, tmp_path, launcher)  # the same command, the link back
    for machine in again:
        assert machine.status == 0, machine.text()[-3000:]
    assert "resuming from" in again[0].text() and ": epoch 1, step 3 (" in again[0].text(), again[0].text()[-3000:]
    assert_same_weights(never_cut, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rendezvous_that_cannot_be_reached_ends_each_host_in_its_wait(hosts, tmp_path):
    """Both hosts started with the link down: the spawn script's ranks wait --dist-timeout for the rendezvous, then
    one line each (exit status 2); an elastic torchrun (the c10d rendezvous on host 0) waits its store's read_timeout
    (--rdzv-conf; 60 s by default), then torch's RendezvousConnectionError (exit status 1); no process is left."""
    hosts.set_link(False)
    try:
        spawned = [on_host(hosts, host, tmp_path / "spawn", "spawn") for host in (0, 1)]
        elastic = Machine(hosts.prefix(1) + TORCHRUN + [
            "--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={network.ADDRESSES[0]}:"
            f"{PORT + 1}", "--rdzv-id=unreachable", "--rdzv-conf=read_timeout=5", str(ROOT / "distributed.py"),
            *TRAINING, "--output-dir", str(tmp_path / "elastic")], subprocess_env())
        ended = [machine.ended()[0] for machine in (*spawned, elastic)]
        left = namespace_processes(hosts)
    finally:
        hosts.set_link(True)
    where = f"{network.ADDRESSES[0]}:{PORT}"
    lines = [[line for _, line in host.lines if line.startswith("distributed_mp.py: error: ")] for host in spawned]
    assert ended[:2] == [2, 2] and len(lines[0]) == len(lines[1]) == 1, [m.text()[-2000:] for m in spawned]
    assert f"not all processes joined at {where} within --dist-timeout" in lines[0][0]
    assert f"could not reach the rendezvous at {where} within --dist-timeout" in lines[1][0]
    assert ended[2] == 1 and "RendezvousConnectionError" in elastic.text(), elastic.text()[-3000:]
    assert left == [] and not (tmp_path / "spawn" / "checkpoint.pt").exists()


DILOCO = {"script": "distributed_diloco.py", "flags": ("--sync-every", "4")}  # rounds end at steps 4, 8 and 12


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_waits_out_an_outage_inside_a_round_and_one_across_its_all_reduce(hosts, tmp_path):
    """DiLoCo's ranks meet only at a round's end (and at the safety net's per-step flag): an outage after step 1
    (mid-round) and one after step 7 (step 8 ends the round with its all-reduce) are waited out, and the run ends
    on the weights of the same run never cut."""
    for machine in run_both(hosts, tmp_path / "never-cut", **DILOCO):
        assert machine.status == 0, machine.text()[-3000:]

    cuts = []

    def two_outages(machines):
        for after_step in (1, 7):
            cuts.append(cut_after(hosts, machines[0], after_step, OUTAGE_S))

    first, second = run_both(hosts, tmp_path / "cut", during=two_outages, **DILOCO)
    for machine in (first, second):
        assert machine.status == 0, machine.text()[-3000:]
    stills = [stood_still(first, cut_at) for cut_at in cuts]
    assert None not in stills and min(stills) >= OUTAGE_S, (stills, first.text()[-3000:])
    assert_same_weights(load_checkpoint(tmp_path / "never-cut")["model"], tmp_path / "cut")


HEARTBEAT_S = 2
LIVE = ("--train-samples", "1920", "--dist-timeout", str(TIMEOUT_S))  # 240 steps
ALONE = re.compile(r"^epoch 1/1 step (\d+)/240 .*, 1 of 2 replica groups")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_partition_under_live_recovery_leaves_group_0_training_and_group_1_heals_once_back(hosts, tmp_path):
    """The lighthouse and replica group 0 on host 0, group 1 on host 1, the link cut for good at group 0's step 20:
    group 0 trains on alone within --dist-timeout (its collective with group 1 gives up: torchft's own default, 60 s,
    held it about that long), group 1 ends with one line (its quorum waits --dist-timeout for the lighthouse; torchft
    0.2.0 gives up there); the link back, group 1's same command heals from group 0 and both end on the same
    weights."""
    lighthouse = link_faults.start_lighthouse(hosts, HEARTBEAT_S)
    groups = []
    try:
        groups = [as_test(link_faults.replica_group_command(hosts, g, tmp_path, LIVE)) for g in (0, 1)]
        groups[0].wait_for(re.compile(r"^epoch 1/1 step 20/240 .*, 2 of 2 replica groups"))
        hosts.set_link(False)
        cut_at = time.monotonic()
        alone_at, _ = groups[0].wait_for(ALONE, after=cut_at)
        status, exited = groups[1].ended()
        said = [line for _, line in groups[1].lines if "error:" in line]
        hosts.set_link(True)
        groups.append(back := as_test(link_faults.replica_group_command(hosts, 1, tmp_path, LIVE)))
        back.wait_for(re.compile(r"healed from a live replica group"))
        ends = [groups[0].ended()[0], back.ended()[0]]
    finally:
        hosts.set_link(True)
        for group in groups:
            if group.proc.poll() is None:
                group.kill()
        lighthouse.kill()
        lighthouse.wait()
    print(f"live recovery, a lasting cut: group 0 stood still {alone_at - cut_at:.1f} s, group 1 ended (status "
          f"{status}) {exited - cut_at:.1f} s after it (--dist-timeout {TIMEOUT_S}, heartbeat {HEARTBEAT_S} s): "
          f"{said}")
    assert alone_at - cut_at < TIMEOUT_S + 15, groups[0].text()[-3000:]
    # group 1 waits for group 0 in their collective, then for a quorum: --dist-timeout each, at most
    assert status != 0 and TIMEOUT_S - 1 < exited - cut_at < 2 * TIMEOUT_S + 15, groups[1].text()[-3000:]
    assert len(said) == 1 and "no quorum from the torchft lighthouse within --dist-timeout" in said[0], said
    assert ends == [0, 0], groups[0].text()[-2000:] + back.text()[-2000:]
    states = [torch.load(tmp_path / f"replica_group_{g}" / "checkpoint.pt", map_location="cpu", weights_only=True)
              for g in (0, 1)]
    for name, tensor in states[0]["model"].items():
        assert torch.equal(states[1]["model"][name], tensor), name


@pytest.mark.parametrize(("message", "said"), [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
     "no answer from another rank for 20 s in a collective (--dist-timeout sets the wait): "),
    ("Application timeout caused pair closure", "no answer from another rank within --dist-timeout in a collective")])
def test_a_collective_no_rank_answered_is_told_in_the_users_words(message, said):
    """gloo's two ways of saying the process group's timeout ran out (the first collective to wait it out, and a later
    one on the connection it closed), as the lasting cut's runs meet them."""
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        line = crash_report.crash_line(error)
    assert line.startswith(said) and "the same command continues from the last checkpoint (" in line \
        and "test_link_faults.py:" in line, line  # the line that called it, outside installed packages


def test_a_replica_group_without_a_quorum_is_told_in_the_users_words():
    def _async_quorum():  # torchft's Manager method whose quorum wait runs out
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    try:
        _async_quorum()
    except TimeoutError as error:
        line = crash_report.crash_line(error)
    assert line.startswith("no quorum from the torchft lighthouse within --dist-timeout: "), line
