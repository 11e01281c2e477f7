"""distributed_diloco.py: its rounds proven in float64 on the script's own lines (started as torchrun starts it,
tests/distributed_helpers.py's script_on_ranks), against plain DDP, against one process in which the workers take
turns, and against torchft's DiLoCo; a Ctrl-C mid-round continued bit for bit; bad flags in one line; and what it
sends, counted.

The float64 runs: 48 synthetic images in global batches of 12 on 2 ranks, 4 steps an epoch, 2 epochs (the cosine acts
on the second), 23 test images; their model computes in float64 on 8x8 averages of the images. 6 images a rank: with 3,
BatchNorm over layer4's 1x1 maps of 3 images amplified float64's rounding to 30% in 8 steps; with 6, the runs
agree within the tolerance the tests assert.
"""
import copy
import functools
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from distributed_helpers import MODELS, on_ranks, script_on_ranks
from processes import Run
from script_parts import train_loader
from script_runs import TINY, check, launcher, read_metrics, run, run_main
from torch import nn
from torch.utils.data import DataLoader

import distributed_diloco as script
from benchmarks import harness, network
from benchmarks.diloco import count
from safety_net.checkpoint import save_atomic
from utils import data, models
from utils.models import ARCH

WORKERS = 2
ARGS = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "48", "--test-samples", "23",
        "--batch-size", "12", "--epochs", "2", "--lr", "0.05", "--workers", "0", "--print-freq", "100"]
PLAIN = ["--momentum", "0", "--outer-lr", "1", "--outer-momentum", "0"]  # one step of SGD, averaged: DDP's
RUNS = {  # name: script, its own flags
    "H = 1, plain": ("distributed_diloco.py", ["--sync-every", "1", *PLAIN]),
    "DDP, no SyncBatchNorm, no momentum": ("distributed.py", ["--no-sync-bn", "--momentum", "0"]),
    # rounds of 3 steps: the epoch's 4th ends a round of 1; inner momentum 0.9, outer SGD 0.7 with Nesterov 0.9
    "H = 3": ("distributed_diloco.py", ["--sync-every", "3", "--weight-decay", "5e-4"]),
    # torchft's DiLoCo keeps the inner momentum across rounds and counts rounds across epochs: none, and H divides 4
    "H = 2, no inner momentum": ("distributed_diloco.py", ["--sync-every", "2", "--momentum", "0"]),
    # 6 steps an epoch in rounds of 2: the first steps with nothing, the second with the first's mean, the epoch's
    # last with the second's and its own
    "H = 2, overlapped": ("distributed_diloco.py", ["--sync-every", "2", "--train-samples", "72", "--weight-decay",
                                                    "5e-4", "--overlap-round"]),
}
RTOL, ATOL = 1e-6, 1e-9  # float64 in two summation orders: about 1e-7 apart here; a changed line moves 1e-3 or more
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's statistics and its count


@pytest.fixture(scope="module")
def made(module_dir):
    """made(name): the checkpoint of RUNS[name] on 2 ranks, run once for the module."""
    out = module_dir("diloco")

    @functools.cache
    def checkpoint(name: str) -> dict:
        script_name, flags = RUNS[name]
        folder = out / name.replace(" ", "").replace(",", "-")
        statuses = script_on_ranks(WORKERS, script_name, ARGS + flags + ["--output-dir", str(folder)], out / "ranks")
        assert statuses == [0] * WORKERS, f"{name}: exit statuses {statuses}"
        return torch.load(folder / "checkpoint.pt", weights_only=True)
    return checkpoint


def float64_model(num_classes: int) -> nn.Module:
    """The model script_on_ranks gives the script: models.resnet18_cifar in float64 on 8x8 averages of the images."""
    build = models.resnet18_cifar
    for change in MODELS["float64"]:
        build = change(build)
    return build(num_classes)


def batches_of(args, rank: int, world_size: int, epoch: int) -> list:
    """Rank `rank`'s batches of `epoch`, as the script's sampler and DataLoader deal them."""
    train_set = data.load(args, train=True)
    sampler = data.ResumableDistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed,
                                               drop_last=True)
    sampler.set_epoch(epoch)
    return list(train_loader(train_set, sampler, args.batch_size // world_size, script="distributed_diloco.py"))


def inner_step(model, optimizer, images, targets) -> None:
    model.train()
    loss = nn.functional.cross_entropy(model(images), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def simulate(flags: list[str], workers: int = WORKERS) -> tuple[nn.Module, torch.optim.Optimizer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute (and 4 times faster than 2 threads on a busy 2-core machine)
    try:
        return _simulate(flags, workers)
    finally:
        torch.set_num_threads(threads)


def _simulate(flags: list[str], workers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """DiLoCo in one process, written from the paper with torch's parts: `workers` copies of the model take turns
    at their inner steps; at each round's end (every H steps and the epoch's last) the mean of their pseudo-gradients
    (round's start - now) is the outer SGD's gradient, BatchNorm's statistics are averaged, and each worker restarts
    from the new round's start with no inner momentum. With --overlap-round, the delayed outer gradients of arXiv
    2502.12996: a round's end steps with the mean of the round before (an epoch's first round steps with none), so
    the next round starts from weights that lack the round just ended; an epoch's last round then steps with its own
    mean too. At each epoch's end BatchNorm's statistics are measured again at the round's start
    (torch.optim.swa_utils.update_bn). Returns the round's start and the outer optimizer."""
    args = script.parse_args(ARGS + flags)
    classes = data.num_classes(data.load(args, train=True))
    torch.manual_seed(args.seed)  # after the data, as in the script
    start = float64_model(classes)
    outer = torch.optim.SGD(start.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)
    ranks = [copy.deepcopy(start) for _ in range(workers)]
    before = None  # --overlap-round: the round before's mean pseudo-gradients and statistics, not yet stepped with
    inner = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
             for m in ranks]
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=args.epochs) for o in inner]
    for epoch in range(args.epochs):
        dealt = [batches_of(args, r, workers, epoch) for r in range(workers)]
        for step in range(1, len(dealt[0]) + 1):
            for r in range(workers):  # the workers take turns, each on its own batch of this step
                inner_step(ranks[r], inner[r], *dealt[r][step - 1])
            if step % args.sync_every and step != len(dealt[0]):
                continue
            with torch.no_grad():
                mean = ([sum(p - q for q in now) / workers for p, *now in zip(
                            start.parameters(), *[m.parameters() for m in ranks], strict=True)],
                        [sum(now) / workers for b, *now in zip(
                            start.buffers(), *[m.buffers() for m in ranks], strict=True) if b.is_floating_point()])
                means = [mean]
                if args.overlap_round:  # the round before's mean; this one's at the next round's end
                    means, before = [before], mean
                    if step == len(dealt[0]):  # the epoch's last round: its own too, nothing left over
                        means, before = [*means, mean], None
                for grads, statistics in filter(None, means):
                    for p, grad in zip(start.parameters(), grads, strict=True):
                        p.grad = grad
                    outer.step()
                    for b, value in zip([b for b in start.buffers() if b.is_floating_point()], statistics, strict=True):
                        b.copy_(value)
                for b, *now in zip(start.buffers(), *[m.buffers() for m in ranks], strict=True):
                    if not b.is_floating_point():
                        b.copy_(now[0])
            restart(ranks, inner, start)
        # the epoch's end: BatchNorm's statistics measured again at the round's start, on the first 512 training
        # images in the ranks' batches, and the next epoch starts from them
        train_set = data.load(args, train=True)
        train_set.set_epoch(epoch)  # the epoch's augmentation, as the script's sampler told its training set
        torch.optim.swa_utils.update_bn(DataLoader(train_set, batch_size=args.batch_size // workers,
                                                   sampler=range(min(len(train_set), 512))), start)
        restart(ranks, inner, start)
        for schedule in schedules:
            schedule.step()
    return start, outer


def restart(ranks: list[nn.Module], inner: list[torch.optim.Optimizer], start: nn.Module) -> None:
    """Every worker from the round's start, with no inner momentum."""
    for m, o in zip(ranks, inner, strict=True):
        m.load_state_dict(start.state_dict())
        o.state.clear()


def assert_close(got: dict, expected: dict, name: str, keys=None) -> None:
    for key in keys or expected:
        torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=ATOL,
                                   msg=lambda said, key=key: f"{name}: {key}: {said}")


@pytest.mark.timeout(300)
def test_any_h_is_one_process_of_workers_taking_turns(made):
    """H = 3 (rounds of 3, 1, 3, 1 steps: the epoch ends a round), inner momentum, outer SGD 0.7 with Nesterov 0.9:
    the round's start (weights, and BatchNorm statistics measured again at the epoch's end) and the outer momentum
    that the script saved are the one-process simulation's."""
    saved = made("H = 3")
    start, outer = simulate(RUNS["H = 3"][1])
    assert_close(saved["model"], start.state_dict(), "H = 3")
    expected = outer.state_dict()["state"]
    assert sorted(saved["outer_optimizer"]["state"]) == sorted(expected) and len(expected) == 62
    for index, state in expected.items():
        torch.testing.assert_close(saved["outer_optimizer"]["state"][index]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=RTOL, atol=ATOL, msg=f"outer momentum {index}")
    assert not saved["optimizer"]["state"], "the epoch's last round drops the inner momentum"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_overlapped_round_is_one_process_stepping_one_round_late(made):
    """--overlap-round at H = 2: the round's start and outer momentum the script saved are those of the one-process
    simulation of the delayed outer gradients, and not those of DiLoCo without the delay (the test can fail)."""
    saved = made("H = 2, overlapped")
    start, outer = simulate(RUNS["H = 2, overlapped"][1])
    assert_close(saved["model"], start.state_dict(), "H = 2, overlapped")
    for index, state in outer.state_dict()["state"].items():
        torch.testing.assert_close(saved["outer_optimizer"]["state"][index]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=RTOL, atol=ATOL, msg=f"outer momentum {index}")
    assert not saved["round_in_flight"], "the epoch's last round leaves no all-reduce in flight"
    undelayed, _ = simulate([flag for flag in RUNS["H = 2, overlapped"][1] if flag != "--overlap-round"])
    moved = (undelayed.state_dict()["conv1.weight"] - saved["model"]["conv1.weight"]).abs().max()
    assert float(moved) > 1e-4, "the delay changed nothing: the comparison above could not fail"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_h_1_with_plain_sgd_is_ddp(made):
    """H = 1, no inner momentum, outer lr 1, no outer momentum: averaging the weights after one plain SGD step is
    averaging the gradients, so every parameter is DDP's (without SyncBatchNorm) on the same batches. Their
    BatchNorm statistics and count differ by design: DDP keeps rank 0's (it broadcasts them), DiLoCo measures them
    again at the round's start at each epoch's end."""
    diloco, ddp = made("H = 1, plain"), made("DDP, no SyncBatchNorm, no momentum")
    parameters = [key for key in ddp["model"] if not key.endswith(STATISTICS)]
    assert_close(diloco["model"], ddp["model"], "H = 1 against DDP", parameters)
    torch.manual_seed(0)
    moved = diloco["model"]["conv1.weight"] - float64_model(100).state_dict()["conv1.weight"]
    assert float(moved.abs().max()) > 1e-3  # 8 steps moved the weights far beyond the tolerance: it can fail


class PlainAllReduce:
    """torchft's Manager as its DiLoCo calls it, on the test's process group: every replica in every quorum, every
    round committed, and allreduce the mean over the replicas (the Manager's)."""
    _use_async_quorum = False

    def __init__(self, world_size: int):
        self.world_size = world_size

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False):
        torch.distributed.all_reduce(tensor)
        tensor /= self.world_size
        return self  # its wait(): already done

    def wait(self) -> bool:
        return True

    def should_commit(self) -> bool:
        return True

    def current_step(self) -> int:
        return 0  # one fragment: always the first

    def start_quorum(self, *args, **kwargs): ...
    def register_state_dict_fn(self, *args, **kwargs): ...
    def allow_state_dict_read(self): ...
    def disallow_state_dict_read(self): ...


def torchft_diloco(rank: int, world_size: int, flags: list[str]) -> dict:
    """torchft's DiLoCo (torchft.local_sgd) around this rank's model and inner SGD, the outer SGD with Nesterov,
    on the script's batches and cosine schedule: its parameters at the end."""
    from torchft.local_sgd import DiLoCo
    args = script.parse_args(ARGS + flags)
    classes = data.num_classes(data.load(args, train=True))
    torch.manual_seed(args.seed)  # after the data, as in the script
    model = float64_model(classes)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.epochs)
    with DiLoCo(PlainAllReduce(world_size), [model], inner, outer, sync_every=args.sync_every, pin_memory=False):
        for epoch in range(args.epochs):
            for images, targets in batches_of(args, rank, world_size, epoch):
                inner_step(model, inner, images, targets)
            schedule.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchft_diloco_trains_the_same_parameters(made, tmp_path):
    """torchft's DiLoCo, the maintained implementation, on the same run (H = 2, no inner momentum: torchft keeps it
    across rounds where the script drops it; H divides the epoch's 4 steps: torchft counts rounds across epochs):
    the same parameters (torchft leaves BatchNorm's statistics to each replica)."""
    pytest.importorskip("torchft")
    flags = RUNS["H = 2, no inner momentum"][1]
    peer = on_ranks(WORKERS, torchft_diloco, flags, results_dir=tmp_path)
    assert_close(peer[1], peer[0], "torchft's two replicas")
    assert_close(made("H = 2, no inner momentum")["model"], peer[0], "against torchft's DiLoCo")


@pytest.mark.parametrize(("argv", "says"), [(["--sync-every", "0"], "--sync-every: must be a positive integer"),
                                            (["--outer-lr", "0"], "--outer-lr: must be a finite number above 0"),
                                            (["--outer-lr", "-1"], "--outer-lr: must be a finite number above 0"),
                                            (["--outer-momentum", "-0.5"], "--outer-momentum: must be a finite")])
def test_bad_flags_are_one_line_before_the_ranks_meet(argv, says, capsys):
    """main() itself, in this process: refused at its flags, before any process group or data."""
    result = run_main(script.main, ["--device", "cpu", "--dataset", "synthetic", *argv], capsys)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--sync-every", "--outer-lr", "--outer-momentum"])
def test_a_resume_that_changes_the_rounds_is_refused_before_the_ranks_meet(flag, tmp_path, capsys):
    """A checkpoint of H = 4, outer lr 0.5, outer momentum 0.8 continued with another value of one: one line, exit
    status 2, from the checks before any process group forms; the checkpoint untouched."""
    run_flags = {"sync_every": 4, "outer_lr": 0.5, "outer_momentum": 0.8}
    save_atomic({"arch": ARCH, "model": {}, "script": "distributed_diloco.py", "run": run_flags},
                str(tmp_path / "checkpoint.pt"))
    before = (tmp_path / "checkpoint.pt").read_bytes()
    result = run_main(script.main, ["--device", "cpu", "--dataset", "synthetic", "--output-dir", str(tmp_path),
                                    "--sync-every", "4", "--outer-lr", "0.5", "--outer-momentum", "0.8", flag, "1"],
                      capsys)
    saved = run_flags[flag[2:].replace("-", "_")]
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"is a run with {flag} {saved}, not 1" in result.stderr, result.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


def counted(rank: int, world_size: int) -> list[dict]:
    return [count(rank, world_size, sync_every, steps=8) for sync_every in (None, 1, 4)]


@pytest.mark.timeout(180)
def test_a_round_sends_one_all_reduce_of_ddps_bytes_so_h_steps_send_1_over_h(tmp_path):
    """Counted on 2 ranks over 8 steps of each script's train_one_epoch (benchmarks/diloco.py): DiLoCo's only
    collective is one all-reduce a round, of the pseudo-gradients (every parameter, as DDP's all-reduces of the
    gradients each step) and BatchNorm's running statistics; at H = 4 a quarter of DDP's bytes, in 2 calls."""
    ddp, every, fourth = on_ranks(WORKERS, counted, results_dir=tmp_path)[0]
    model = models.resnet18_cifar()
    parameters = 4 * sum(p.numel() for p in model.parameters())
    statistics = 4 * sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert ddp["bytes"] == 8 * parameters and ddp["all_reduces"] >= 8 * 2  # DDP: its buckets every step
    assert (every["all_reduces"], every["bytes"], every["other"]) == (8, 8 * (parameters + statistics), {})
    assert (fourth["all_reduces"], fourth["bytes"], fourth["other"]) == (2, 2 * (parameters + statistics), {})
    assert fourth["bytes"] / ddp["bytes"] == pytest.approx(1 / 4, rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("rounds", "stop_at", "before"), [(["--sync-every", "4"], 2, 4),
                                                           (["--sync-every", "2", "--overlap-round"], 3, 6)],
                         ids=["rounds of 4", "rounds of 2 overlapped"])
def test_ctrl_c_mid_round_then_the_same_command_continues_bit_for_bit(rounds, stop_at, before, tmp_path):
    """2 CPU ranks under torchrun, float32, an epoch of 6 steps: Ctrl-C at step 2 of a round of 4 stops both ranks
    mid-round with a checkpoint of the round's start; the same command replays the round's steps and ends on the
    weights, statistics and outer momentum of the run never stopped, bit for bit. So does Ctrl-C at step 3 of rounds of
    2 with --overlap-round, a round's all-reduce not yet stepped with (the checkpoint holds its mean). One
    process evaluates the checkpoint exactly, and continues the stopped one (at another world size: one worker)."""
    flags = TINY + ["--train-samples", "96", *rounds]
    cmd = launcher("torchrun", "distributed_diloco.py") + flags
    never = tmp_path / "never-stopped"
    check(run(cmd + ["--output-dir", str(never)]))
    stopped = tmp_path / "stopped"
    started = Run(cmd + ["--output-dir", str(stopped)])
    started.wait_for(f"epoch 1/1 step {stop_at}/6")
    os.kill(started.proc.pid, signal.SIGINT)
    status, seconds = started.finish()  # seconds from the signal: torchrun's SIGKILL comes 30 s after its SIGTERM
    assert status != 0 and seconds < 30 and "stopped by SIGINT at epoch 1, step" in started.text, started.output
    halfway = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert stop_at <= halfway["step"] < before, halfway["step"]  # within the first round; before the epoch's end
    assert bool(halfway.get("round_in_flight")) == ("--overlap-round" in rounds)  # a round's mean not yet stepped with
    shutil.copytree(stopped, tmp_path / "on-one-process", ignore=shutil.ignore_patterns("run.lock"))
    again = check(run(cmd + ["--output-dir", str(stopped)]))
    assert f"resuming from {stopped / 'checkpoint.pt'}: epoch 1, step {halfway['step']}" in again.stdout, again.stdout
    got, expected = (torch.load(folder / "checkpoint.pt", weights_only=True) for folder in (stopped, never))
    for part in ("model", "outer_optimizer", "optimizer", "scheduler"):
        assert_equal(got[part], expected[part], part)
    (epoch,) = read_metrics(never)
    assert read_metrics(stopped)[0]["top1"] == epoch["top1"]
    check(run(launcher("python", "distributed_diloco.py") + flags + ["--evaluate", "--output-dir", str(never)]))
    evaluated = json.loads((never / "eval.json").read_text())
    assert evaluated["samples"] == epoch["samples"] == 21 and evaluated["top1"] == pytest.approx(epoch["top1"])
    one = check(run(launcher("python", "distributed_diloco.py") + flags + ["--output-dir",
                                                                            str(tmp_path / "on-one-process")]))
    assert f"step {halfway['step']} (checkpoint of 2 process(es)" in one.stdout, one.stdout


def assert_equal(got, expected, where: str) -> None:
    """Bit for bit, through nested dicts and lists of tensors."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_equal(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_equal(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where



# One host's rank of the test below: a round of an 8 MB model started as --overlap-round starts it (the script's
# end_round, its InFlight on a group of its own as train() makes it), then the progress line's all-reduce on the
# default group timed while the round's bytes cross the link, then the round's mean taken.
ROUND_IN_FLIGHT = """
import copy, json, time, torch, torch.distributed as dist
from torch import nn
import distributed_diloco as script
from benchmarks import network
from utils import collectives
from utils.in_flight import InFlight
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{{network.ADDRESSES[0]}}:{port}", rank={host}, world_size=2)
late = InFlight(collectives.new_group_like_world())
collectives.all_reduce_sum(torch.zeros(3)); dist.all_reduce(torch.zeros(3), group=late.group)  # connections made
torch.manual_seed(0)
model = nn.Linear(2048, 1024, bias=False)
outer_model = copy.deepcopy(model)
outer = torch.optim.SGD(outer_model.parameters(), lr=1.0)
with torch.no_grad():
    model.weight.sub_({host} + 1)  # host 0 moved by -1, host 1 by -2: their mean pseudo-gradient is 1.5
started = time.perf_counter()
script.end_round(model, outer_model, outer, torch.optim.SGD(model.parameters(), lr=1.0), 2, late)
begun = time.perf_counter()
collectives.all_reduce_sum(torch.zeros(3))  # what a progress line sends (utils/collectives.py)
small_s = time.perf_counter() - begun
mean = late.take()
print(json.dumps({{"small_s": small_s, "round_s": time.perf_counter() - started,
                   "mean_ok": bool(torch.all(mean == 1.5))}}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_round_in_flight_leaves_the_default_groups_connections_free():
    """--overlap-round's all-reduce crosses a slow link for seconds; a progress line's all-reduce meanwhile (on the
    default group) goes over connections of its own, not behind the round's bytes: two hosts (network namespaces,
    skipped without root), the link at 10 Mbit/s."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "tc", "taskset")):
        pytest.skip("two hosts need root, iproute2 and taskset")
    with network.TwoHosts() as hosts:
        hosts.shape(network.parse_rates("10mbit")[0])
        commands = [hosts.prefix(host) + [sys.executable, "-c", ROUND_IN_FLIGHT.format(host=host, port=29561)]
                    for host in (0, 1)]
        procs = [subprocess.Popen(cmd, cwd=harness.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=hosts.env(host)) for host, cmd in enumerate(commands)]
        try:
            outputs = [proc.communicate(timeout=150) for proc in procs]
        finally:
            harness.stop(procs, grace_s=0)
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    for out, _ in outputs:
        found = json.loads(out.strip().splitlines()[-1])
        assert found["mean_ok"], found
        # 8 MB a host at 10 Mbit/s: the round takes 6.7 s or more; behind its bytes the small all-reduce would wait
        # for most of them (the first half at least: the ring's second half needs it), on its own connections only
        # for tc's queue (100 ms a way)
        assert found["round_s"] >= 0.8 * 8 * network.MB * 8 / 10e6, found
        assert found["small_s"] < found["round_s"] / 4, found
