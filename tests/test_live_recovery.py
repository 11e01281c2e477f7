"""distributed_live_recovery.py (torchft): a replica group of two processes killed outright while another trains on,
healed from it when started again, all ending on the same weights bit for bit; a stop signal to every group and the
same commands again; Ctrl-C to the demo; and each bad input in one line."""
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from processes import Run
from script_runs import ROOT, TINY, launcher, run, run_main, stop_handlers_undone, subprocess_env

from examples import own_lighthouse
from examples.local_processes import process_tree

pytest.importorskip("torchft")  # in requirements-dev.txt; an optional dependency of the one script

import distributed_live_recovery  # noqa: E402
from utils import live_recovery  # noqa: E402
from utils.spawn import free_port  # noqa: E402

SCRIPT = "distributed_live_recovery.py"


@pytest.fixture
def lighthouse():
    """A torchft lighthouse of the test's own, as the README starts one (a quorum of one group is enough); its
    address."""
    with own_lighthouse.on_a_free_port(min_replicas=1, heartbeat_timeout_ms=2000, wait_s=30) as address:
        yield address


def final_weights(output_dir, groups: int) -> list[dict]:
    return [torch.load(output_dir / f"replica_group_{g}" / "checkpoint.pt", map_location="cpu", weights_only=True)
            for g in range(groups)]


def assert_same_weights(states: list[dict]) -> None:
    for g, state in enumerate(states[1:], 1):
        first = states[0]["model"]
        differing = [name for name, tensor in state["model"].items() if not torch.equal(tensor, first[name])]
        assert not differing, f"replica group {g} differs from group 0 in {differing[:5]}"
        assert state["manager"] == states[0]["manager"], (state["manager"], states[0]["manager"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_group_heals_from_the_live_one_and_all_end_on_the_same_weights(tmp_path):
    """The demo command with groups of two processes (their gradients and SyncBatchNorm averaged within the group,
    then between groups, then clipped): group 1 SIGKILLed (its torchrun and processes) at step 10; group 0's steps
    go on with 1 of 2 groups while it is down; started again, group 1 heals from group 0; both end bit for bit
    equal. An epoch of 120 steps: after the restart group 0 trains on alone until group 1 has started (in CI, with the
    other tests on the same 2 cores, a restart outlasted the 40 steps that an epoch of 60 left, and group 0 ended
    first)."""
    out = tmp_path / "demo"
    demo = [sys.executable, str(ROOT / "examples" / "live_recovery_demo.py"), "--port", str(free_port()),
            "--procs-per-group", "2", "--kill-at-step", "10", "--down-for-steps", "10", "--output-dir", str(out),
            "--", "--epochs", "1", "--train-samples", "1920", "--clip-grad-norm", "1.0"]
    result = subprocess.run(demo, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    said = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{said[-4000:]}\n{result.stderr[-2000:]}"
    killed, restarted = said.index("[demo] SIGKILL to replica group 1"), said.index("[demo] starting replica group 1")
    alone = [int(s) for s in re.findall(r"\[group 0\] epoch 1/1 step (\d+)/120 .*, 1 of 2 replica",
                                        said[killed:restarted])]
    assert len(alone) >= 2 and alone == sorted(alone) and alone[-1] - alone[0] >= 5, said[killed:restarted]
    assert re.search(r"\[group 1\] healed from a live replica group: .* at epoch 1, step \d+", said[restarted:]), said
    assert "2 of 2 replica groups" in said[said.index("[group 1] healed"):], said
    # --clip-grad-norm after the average over the quorum's groups: each group logs its norm (group 1's epoch mean
    # over the steps since it healed), and all end equal
    norms = {group: re.findall(rf"\[group {group}\] epoch 1: .* grad_norm (\S+) ", said) for group in (0, 1)}
    assert norms[0] and norms[1], norms
    assert_same_weights(final_weights(out, 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_signal_to_every_group_leaves_checkpoints_the_same_commands_continue(tmp_path):
    """SIGTERM to group 0's torchrun once both train in one quorum, then to group 1's once it has trained a step
    alone: each writes its checkpoint and exits, group 1's a step ahead. The same commands again, group 0's first:
    its last step had 2 groups, so it waits for another rather than train alone (alone, it could reach group 1's step
    on other weights, which torchft never heals: CI failed so twice when the groups started together);
    then it heals from group 1 at group 1's step, and both end on the same weights. The lighthouse has min_replicas 1,
    so that group 1 can finish its steps alone once group 0 has stopped."""
    with own_lighthouse.on_a_free_port(min_replicas=1, heartbeat_timeout_ms=2000, wait_s=30) as lighthouse:
        stop_both_groups_then_continue(lighthouse, tmp_path)


def stop_both_groups_then_continue(lighthouse: str, tmp_path) -> None:
    out = tmp_path / "run"
    flags = TINY + ["--train-samples", "160", "--batch-size", "8", "--epochs", "2", "--lighthouse", lighthouse,
                    "--output-dir", str(out)]
    commands = [launcher("torchrun", SCRIPT, 1) + flags + ["--replica-group", str(g)] for g in (0, 1)]
    env = subprocess_env(RUST_LOG="warn")
    runs = [Run(command, env=env) for command in commands]
    for started in runs:  # both in the quorum: a group that started late has healed from the other
        started.wait_for("2 of 2 replica groups")
    runs[0].proc.send_signal(15)
    runs[1].wait_for("1 of 2 replica groups")  # a step of its own, once group 0's heartbeats are overdue
    runs[1].proc.send_signal(15)
    for g, started in enumerate(runs):
        status, _ = started.finish(timeout=60)
        assert status == 1 and "stopped by SIGTERM" in started.text, f"group {g}: exit {status}\n{started.output}"
    behind, ahead = final_weights(out, 2)
    assert (behind["epoch"], behind["step"]) < (ahead["epoch"], ahead["step"]), (behind["step"], ahead["step"])
    assert behind["manager"]["groups"] == 2 and ahead["manager"]["groups"] == 1, (behind["manager"], ahead["manager"])
    first = Run(commands[0], env=env)
    first.wait_for("waiting for 1 more replica group(s) before the first step")
    then = Run(commands[1], env=env)  # seconds before its manager beats: steps enough for group 0, had it not waited
    for g, continued in enumerate((first, then)):
        status, _ = continued.finish(timeout=200)
        assert status == 0, f"group {g}: exit {status}\n{continued.output}"
        assert f"resuming from {out}/replica_group_{g}/checkpoint.pt: epoch " in continued.text, continued.output
    before_group_1 = first.text[:first.text.index("healed from")]
    assert not re.search(r"step \d+/20 loss", before_group_1), first.output
    assert (f"healed from a live replica group: its weights, optimizer and schedule at epoch {ahead['epoch'] + 1}, "
            f"step {ahead['step']}") in first.text, first.output
    assert "healed" not in then.text, then.output
    assert_same_weights(final_weights(out, 2))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_stops_the_demo_and_leaves_no_process(tmp_path):
    """SIGINT to the demo (as Ctrl-C in its terminal): every group stops at a step and writes its checkpoint, the
    lighthouse goes too, the demo exits 130."""
    out = tmp_path / "demo"
    demo = Run([sys.executable, str(ROOT / "examples" / "live_recovery_demo.py"), "--port", str(free_port()),
                "--kill-at-step", "1000", "--output-dir", str(out)])
    demo.wait_for("[group 1] epoch 1/2 step 5/60", timeout=120)
    started = process_tree(demo.proc.pid)
    assert len(started) >= 5, started  # the lighthouse, and each group's torchrun and process
    demo.proc.send_signal(signal.SIGINT)
    status, _ = demo.finish(timeout=60, started=started)
    assert status == 130 and "[demo] SIGINT: stopping every group" in demo.text, demo.output
    for g in (0, 1):
        assert f"[group {g}] stopped by SIGTERM at epoch 1" in demo.text, demo.output
        assert (out / f"replica_group_{g}" / "checkpoint.pt").exists()
        assert "SignalException" in (out / f"replica_group_{g}.log").read_text()  # torchrun's report: in the log
    assert "Traceback" not in demo.text, demo.output  # and not on the terminal


def test_bad_flags_are_one_line(capsys, tmp_path):
    cases = {("--replica-group", "2", "--replica-groups", "2"): "--replica-group 2 is not below --replica-groups 2",
             ("--min-replica-groups", "3"): "--min-replica-groups 3 is more than --replica-groups 2",
             ("--lighthouse", "localhost:29510"): "is not an address like http://host:29510",
             ("--wait-for-groups", "-1"): "--wait-for-groups: must be a finite number, 0 or more, got -1",
             # DDP's technique flags are not offered: the gradients leave through the script's hook, and every group
             # keeps DDP's buckets as built
             ("--comm-hook", "fp16"): "unrecognized arguments: --comm-hook fp16",
             ("--static-graph",): "unrecognized arguments: --static-graph",
             ("--cuda-graphs",): "unrecognized arguments: --cuda-graphs"}
    for flags, words in cases.items():
        said = run_main(distributed_live_recovery.main, TINY + ["--output-dir", str(tmp_path / "out"), *flags], capsys)
        assert said.returncode == 2 and words in said.stderr, (flags, said)
        assert len(said.stderr.strip().splitlines()) == 1, said.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_without_batchnorm_has_no_statistics_to_average():
    """A copy's own model without BatchNorm (GroupNorm): the end of an epoch averages nothing, and asks no all-reduce
    (torch.cat of no buffers raised)."""
    class NoManager:
        def allreduce(self, tensor):
            raise AssertionError("an all-reduce of no statistics")

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GroupNorm(2, 4))
    before = [p.clone() for p in model.parameters()]
    distributed_live_recovery.average_batchnorm_statistics(NoManager(), model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.timeout(120)
def test_importing_the_plumbing_changes_nothing():
    """utils/live_recovery.py sets no RUST_LOG, warning filter or log filter when imported: only the script's call of
    import_torchft_with_quiet_logs does (a fresh interpreter: this one imported the script)."""
    state = ("print(os.environ.get('RUST_LOG'), "
             "sum(bool(f[1] and f[1].pattern.startswith('The given buffer')) for f in warnings.filters), "
             "len(logging.getLogger('torchft.manager').filters))")
    code = (f"import logging, os, warnings; import utils.live_recovery; {state}; "
            f"utils.live_recovery.import_torchft_with_quiet_logs(); {state}")
    env = {key: value for key, value in subprocess_env().items() if key != "RUST_LOG"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=100)
    assert result.stdout.split("\n")[:2] == ["None 0 0", "warn 1 1"], result


def test_no_lighthouse_is_one_line(capsys, tmp_path):
    port = free_port()
    said = run_main(distributed_live_recovery.main, TINY + ["--output-dir", str(tmp_path), "--device", "cpu",
                                                            "--lighthouse", f"http://127.0.0.1:{port}"], capsys)
    assert said.returncode == 2, said
    assert said.stderr.strip().endswith(f"error: no lighthouse answers at "
                                f"http://127.0.0.1:{port} ([Errno 111] Connection refused); start one first: "
                                "torchft_lighthouse --min_replicas 1 --bind [::]:29510"), said.stderr


def test_a_replica_group_id_in_use_is_one_line(lighthouse, capsys, tmp_path, monkeypatch):
    """A live group 1 heartbeats to the lighthouse: a second group 1 is refused, group 0 is not."""
    from torchft._torchft import LighthouseClient

    client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=5))
    beating = threading.Event()
    beating.set()

    def heartbeat():
        while beating.is_set():
            client.heartbeat("1:4b1d")
            time.sleep(0.2)
    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        deadline = time.monotonic() + 5
        while live_recovery.live_replica_groups(lighthouse) != {1}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        monkeypatch.setattr(live_recovery, "HEARTBEATS_OVERDUE_S", 1.0)
        said = run_main(distributed_live_recovery.main, TINY + ["--output-dir", str(tmp_path), "--device", "cpu",
                                                                "--lighthouse", lighthouse, "--replica-group", "1"],
                        capsys)
        assert said.returncode == 2, said
        assert said.stderr.strip().endswith(f"error: replica group 1 is already training (the "
                                    f"lighthouse at {lighthouse} has its heartbeats): give each group its own "
                                    "--replica-group"), said.stderr
        live_recovery.check_lighthouse(distributed_live_recovery.parse_args(["--lighthouse", lighthouse]))
    finally:
        beating.clear()


def test_a_resumed_group_waits_for_fresh_heartbeats_only_and_not_past_its_limit(lighthouse, capsys):
    """wait_for_replica_groups, the wait of a group continuing from its checkpoint: group 1 beating counts (with this
    group, 2 of 2: no wait); once it stops, its heartbeat counts no more after HEARTBEAT_FRESH_S, long before the
    lighthouse marks it old (2 s here, 5 s by default), so a group that stopped a moment ago is not taken for one that
    came back; waiting for a group that does not come ends at --wait-for-groups, in two lines; a stop ends it at
    once."""
    from torchft._torchft import LighthouseClient

    client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=5))
    for _ in range(5):
        client.heartbeat("1:4b1d")
        time.sleep(0.1)
    assert live_recovery.live_replica_groups(lighthouse, seen_within_s=live_recovery.HEARTBEAT_FRESH_S) == {1}
    client.heartbeat("0:4b1e")  # this group, once
    assert live_recovery.live_replica_groups(lighthouse, seen_within_s=live_recovery.HEARTBEAT_FRESH_S) == {0, 1}
    started = time.monotonic()
    live_recovery.wait_for_replica_groups(lighthouse, 2, 30.0, is_main=True, stop=lambda: False)
    assert time.monotonic() - started < 1 and capsys.readouterr().out == ""
    time.sleep(live_recovery.HEARTBEAT_FRESH_S + 0.2)
    assert live_recovery.live_replica_groups(lighthouse, seen_within_s=live_recovery.HEARTBEAT_FRESH_S) == set()
    started = time.monotonic()
    live_recovery.wait_for_replica_groups(lighthouse, 2, 1.0, is_main=True, stop=lambda: False)
    assert 1 <= time.monotonic() - started < 5
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("waiting for 2 more replica group(s) before the first step (0 s of --wait-for-groups "
                              "1): the checkpoint's last step had 2"), said
    assert said[1:] == ["training without the 2 missing replica group(s) after --wait-for-groups 1 s"], said
    started = time.monotonic()
    live_recovery.wait_for_replica_groups(lighthouse, 2, 30.0, is_main=True, stop=lambda: True)
    assert time.monotonic() - started < 1


def test_a_group_with_other_flags_is_refused_when_it_would_heal(tmp_path):
    """The state a live group hands over (HealingSafetyNet.state_for_a_peer) carries its run's flags: a group started
    with another --lr is refused in one line when it would take it, before any of it is loaded. (By hand, a group 1
    with --lr 0.05 joining a group 0 at the default rate exits 2 with this line; group 0 trains on.)"""
    from safety_net.healing import HealingSafetyNet
    from utils.errors import UsageError

    def flags_of(*extra):
        return distributed_live_recovery.parse_args(TINY + ["--output-dir", str(tmp_path), *extra])

    with stop_handlers_undone():
        live = HealingSafetyNet.for_flags(flags_of(), SCRIPT)
        joiner = HealingSafetyNet.for_flags(flags_of("--lr", "0.05"), SCRIPT)
        with pytest.raises(UsageError) as refused:
            joiner.take_state_from_a_peer({"run": live.options.run, "epoch": 0, "step": 8})
    assert str(refused.value) == (f"the live replica groups train with --lr {live.options.run['lr']}, this one with "
                                  "0.05: start every replica group with the same flags")
    assert joiner.epoch_to_start() == 0 and not list(tmp_path.iterdir())


def test_without_torchft_it_is_one_line(tmp_path):
    """torchft not installed (an import of it fails): one line naming the package, exit status 2."""
    (tmp_path / "torchft").mkdir()
    (tmp_path / "torchft" / "__init__.py").write_text("raise ImportError('No module named torchft')\n")
    said = run(launcher("python", SCRIPT) + TINY + ["--output-dir", str(tmp_path / "out")],
               PYTHONPATH=str(tmp_path))
    assert said.returncode == 2, said
    assert said.stderr.strip() == ("distributed_live_recovery.py: error: torchft is not installed: pip install torchft "
                                   "(PyTorch's fault-tolerance library) (see --help)"), said.stderr
    assert not (tmp_path / "out").exists()
