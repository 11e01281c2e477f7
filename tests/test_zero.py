"""distributed_zero.py: ZeRO-1 (ZeroRedundancyOptimizer) trains the weights DDP trains, each rank holds about 1/N
of the optimizer state, and its checkpoints (the state gathered on rank 0) continue a run at any world size.

The equality is proven in float64 with the real model, CpuSyncBatchNorm and the script's own train_one_epoch, as
tests/test_fsdp.py proves FSDP's; the optimizer and schedule are the script's own lines.
"""
import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from distributed_helpers import LossesKept, on_ranks
from processes import Run
from script_parts import optimizer_and_schedule
from script_runs import TINY, check, launcher, read_metrics, run
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed_zero as script
from benchmarks.ladder import optimizer_state_bytes
from safety_net.checkpoint import Checkpoint, Options
from utils import models
from utils.launch import Env
from utils.syncbn import CpuSyncBatchNorm

STEPS, GLOBAL_BATCH = 3, 12
SIDE = 8  # 8x8 images: float64 convolutions are slow, and the question is the same at any size


def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 3, SIDE, SIDE, generator=g, dtype=torch.float64),
             torch.randint(0, 100, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def run_args(output_dir=""):
    return SimpleNamespace(
        print_freq=100, epochs=2, lr=0.1, warmup_epochs=0, momentum=0.9, weight_decay=5e-4, batch_size=GLOBAL_BATCH,
        seed=0, output_dir=str(output_dir), keep=2, resume=None, restart=False, init_from=None, save_every_steps=0,
        evaluate=False, dataset="synthetic", train_samples=None, no_augment=False, no_sync_bn=False)


def fresh_model():
    torch.manual_seed(0)
    return CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()).double()


def fresh_ddp():
    return DDP(fresh_model())


def zero_with_cosine(model, args):
    """distributed_zero.py's optimizer and schedule: its train()'s own lines (tests/script_parts.py)."""
    optimizer, scheduler = optimizer_and_schedule("distributed_zero.py", model, args)
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer, scheduler


def train_steps(model, optimizer, rank, world_size, steps: slice):
    """The script's train_one_epoch over the global batches batches()[steps], dealt rank::world_size as the
    sampler deals them."""
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches()[steps]]
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, shard, torch.device("cpu"), LossesKept())


def weights(model):
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def continued(rank, world_size, output_dir):
    """Resume the run in output_dir at this world size (a new run if none), train one step, save: a checkpoint
    whose optimizer state every rank first sends to rank 0."""
    model = fresh_ddp()
    optimizer, scheduler = zero_with_cosine(model, run_args(output_dir))
    env = Env(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
    checkpoint = Checkpoint(Options.from_flags(run_args(output_dir)), env, "distributed_zero.py", model=model,
                            optimizer=optimizer, scheduler=scheduler, before_save=optimizer.consolidate_state_dict)
    epoch, step = checkpoint.resume()
    train_steps(model, optimizer, rank, world_size, slice(step, step + 1))
    checkpoint.save(epoch=0, step=step + 1)
    return {"resumed_at": (epoch, step), "weights": weights(model), "state_bytes": optimizer_state_bytes(optimizer)}


def momentum_held(model, optimizer) -> set[str]:
    """The names of the parameters whose momentum_buffer this rank's own SGD holds (ZeroRedundancyOptimizer.optim: the
    optimizer over its share, the state a rank keeps)."""
    name_of = {id(p): name for name, p in model.module.named_parameters()}
    return {name_of[id(p)] for p, state in optimizer.optim.state.items() if state.get("momentum_buffer") is not None}


def at_world_size(rank, world_size, output_dir):
    """At this world size: STEPS steps of DDP with torch's SGD, then with ZeRO-1, from the same weights on the same
    batches (and the parameters ZeRO-1's momentum is held for here); then one step of the run continued in
    output_dir."""
    results = {}
    for name in ("ddp", "zero"):
        model = fresh_ddp()
        optimizer = zero_with_cosine(model, run_args())[0] if name == "zero" else torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        train_steps(model, optimizer, rank, world_size, slice(0, STEPS))
        results[name] = weights(model)
        if name == "zero":
            results["momentum_held"] = momentum_held(model, optimizer)
    return {**results, "continued": continued(rank, world_size, output_dir)}


@pytest.fixture(scope="module")
def ranks(module_dir):
    """{world size: each rank's results}: the run in one directory continued on 2 ranks, then 4, then 1."""
    out = module_dir("zero")
    return {n: on_ranks(n, at_world_size, str(out / "run"), results_dir=out / str(n)) for n in (2, 4, 1)}


@pytest.mark.slow  # processes on 1, 2 and 4 ranks, float64
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_trains_the_weights_of_ddp(world_size, ranks):
    for r in ranks[world_size]:
        ddp = r["ddp"]
        assert (ddp["conv1.weight"] - fresh_model().conv1.weight).abs().max() > 1e-3  # 3 steps moved it
        for key, expected in ddp.items():
            torch.testing.assert_close(r["zero"][key], expected, rtol=1e-12, atol=1e-14, msg=key)


@pytest.mark.slow
def test_each_rank_holds_about_a_world_size_share_of_the_optimizer_state(ranks):
    """Momentum of each parameter on exactly one rank: the ranks' bytes add up to one process's, and no rank holds
    more than 1.25/N of them (ZeroRedundancyOptimizer deals whole parameters, the largest first)."""
    (alone,) = [r["continued"]["state_bytes"] for r in ranks[1]]
    assert alone == 8 * sum(p.numel() for p in models.resnet18_cifar().parameters())  # float64 momentum
    for n in (2, 4):
        held = [r["continued"]["state_bytes"] for r in ranks[n]]
        assert sum(held) == alone and max(held) <= 1.25 * alone / n, (n, held)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_parameters_momentum_is_held_on_exactly_one_rank(world_size, ranks):
    """distributed_zero.py's ZeroRedundancyOptimizer over ResNet-18 after 3 steps: each parameter's momentum_buffer in
    exactly one rank's own optimizer state, every parameter's in one of them, and every rank holding some."""
    every = {name for name, _ in models.resnet18_cifar().named_parameters()}
    held = [r["momentum_held"] for r in ranks[world_size]]
    assert all(held), [len(mine) for mine in held]
    for name in every:
        assert [name in mine for mine in held].count(True) == 1, (name, [len(mine) for mine in held])
    assert set().union(*held) == every


@pytest.mark.slow
def test_a_checkpoint_continues_the_run_at_another_world_size(ranks):
    """One step on 2 ranks, the next on 4, the last on 1, each resumed from the checkpoint of the one before (its
    optimizer state gathered on rank 0 at the save, dealt again at the load): the weights of ZeRO-1 on 2 ranks that
    was never interrupted, and of DDP."""
    assert [r["continued"]["resumed_at"] for r in ranks[2]] == [(0, 0)] * 2
    assert [r["continued"]["resumed_at"] for r in ranks[4]] == [(0, 1)] * 4
    (one,) = ranks[1]
    assert one["continued"]["resumed_at"] == (0, 2)
    for key, expected in ranks[2][0]["zero"].items():
        # running variances: SyncBatchNorm's E[x^2] - mean^2 on 2 and 4 ranks against BatchNorm's one pass on 1
        rtol = 1e-7 if key.endswith("running_var") else 1e-9
        torch.testing.assert_close(one["continued"]["weights"][key], expected, rtol=rtol, atol=1e-12, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_saves_the_whole_state_the_same_command_continues_and_one_process_evaluates(tmp_path):
    """distributed_zero.py as a user runs it, 2 CPU ranks under torchrun: Ctrl-C (SIGINT to torchrun) stops both
    ranks at one step with a checkpoint holding every parameter's momentum (each rank sent rank 0 its part); the
    same command continues from that step to the end, and --evaluate in one process counts every test image once."""
    cmd = launcher("torchrun", "distributed_zero.py") + TINY + ["--train-samples", "96", "--output-dir",
                                                                  str(tmp_path)]
    started = Run(cmd)
    started.wait_for("epoch 1/1 step 2/6")
    os.kill(started.proc.pid, signal.SIGINT)
    status, seconds = started.finish()
    # from the signal to the last process gone: within torchrun's 30 s before its SIGKILL
    assert status != 0 and seconds < 30 and "stopped by SIGINT at epoch 1, step" in started.text, started.output
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["script"] == "distributed_zero.py" and saved["world_size"] == 2 and 2 <= saved["step"] < 6
    assert len(saved["optimizer"]["state"]) == len(list(models.resnet18_cifar().parameters()))  # every momentum
    again = check(run(cmd))
    assert f"resuming from {tmp_path / 'checkpoint.pt'}: epoch 1, step {saved['step']}" in again.stdout, again.stdout
    (epoch,) = read_metrics(tmp_path)
    check(run(launcher("python", "distributed_zero.py") + TINY + ["--evaluate", "--output-dir", str(tmp_path)]))
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["samples"] == epoch["samples"] == 21 and evaluated["top1"] == pytest.approx(epoch["top1"])


@pytest.mark.parametrize(("argv", "says"), [(["--epochs", "0"], "must be a positive integer"),
                                            (["--optimizer-impl", "adam"], "invalid choice: 'adam'")])
def test_bad_flags_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exited:
        script.parse_args(argv)
    said = capsys.readouterr().err
    assert exited.value.code == 2 and said.count("\n") == 1 and says in said, said
