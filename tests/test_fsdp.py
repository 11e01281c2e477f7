"""distributed_fsdp.py: FSDP trains the weights DDP trains, and its sharded checkpoints continue a run at
any world size.

The equality is proven in float64 with the real model, CpuSyncBatchNorm, the script's own shard() and
train_one_epoch, and its own lines for SGD and the cosine schedule; float32 cannot settle it
(tests/test_scripts_equal.py).
"""
import contextlib
import errno
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import LossesKept, on_ranks
from script_parts import optimizer_and_schedule
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed_fsdp as script
from benchmarks.ladder import optimizer_state_bytes
from safety_net import checkpoint
from safety_net.checkpoint import Options
from safety_net.sharded_checkpoint import ShardedCheckpoint
from safety_net.stop_errors import StorageError
from utils import models, sharding
from utils.errors import UsageError
from utils.launch import Env
from utils.syncbn import CpuSyncBatchNorm

STEPS, GLOBAL_BATCH = 3, 12
SIDE = 8  # 8x8 images: float64 convolutions are slow, and the question is the same at any size


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 3, SIDE, SIDE, generator=g, dtype=torch.float64),
             torch.randint(0, 100, (GLOBAL_BATCH,), generator=g)) for _ in range(steps)]


def run_args(output_dir="", **overrides):
    return SimpleNamespace(**{
        "print_freq": 100, "epochs": 2, "lr": 0.1, "warmup_epochs": 0, "momentum": 0.9, "weight_decay": 5e-4,
        "batch_size": GLOBAL_BATCH,
        "seed": 0, "output_dir": str(output_dir), "keep": 2, "resume": None, "restart": False, "init_from": None,
        "save_every_steps": 0, "evaluate": False, "dataset": "synthetic", "train_samples": None,
        "no_augment": False, "no_sync_bn": False, "optimizer_impl": "auto", **overrides})


def env_of(rank, world_size):
    return Env(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))


def full_state(model):
    """The unsharded weights and buffers, on every rank (an all-gather under FSDP)."""
    if isinstance(model, DDP):
        model = model.module
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def fresh_model():
    torch.manual_seed(0)
    return CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()).double()


def train_steps(model, optimizer, rank, world_size, steps: slice):
    """The script's train_one_epoch over the global batches batches()[steps], dealt rank::world_size as
    the sampler deals them."""
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches()[steps]]
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, shard, torch.device("cpu"), LossesKept(), None)


def continue_sharded(rank, world_size, output_dir, and_the_bfloat16_policy=False, replicas=1):
    """Resume the run in output_dir at this world size (a new run if none), train one step, save (and
    see what the bfloat16 policy computes in: one process start fewer). replicas > 1: HSDP, as --replicas."""
    mesh = sharding.hsdp_mesh(env_of(rank, world_size), replicas)
    model = script.shard(fresh_model(), None, reshard=True, mesh=mesh)
    args = run_args(output_dir)
    optimizer, scheduler = optimizer_and_schedule("distributed_fsdp.py", model, args)
    checkpoint = ShardedCheckpoint(Options.from_flags(args, sharded=True), env_of(rank, world_size),
                                   "distributed_fsdp.py", model=model, optimizer=optimizer, scheduler=scheduler)
    epoch, step = checkpoint.resume()
    train_steps(model, optimizer, rank, world_size, slice(step, step + 1))
    checkpoint.save(epoch=0, step=step + 1)
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]  # conv1's
    return {"resumed_at": (epoch, step), "state": full_state(model), "momentum_rows": momentum.to_local().shape[0],
            "momentum_bytes": optimizer_state_bytes(optimizer),
            "bfloat16_policy": mixed_precision_dtypes() if and_the_bfloat16_policy else None}


def on_every_world_size(rank, world_size, output_dir):
    """At this world size: three steps of DDP, then of FSDP in each layout (--units stages and model), from the same
    weights on the same batches; then one step of the run continued in output_dir."""
    results = {}
    for name in ("ddp", "fsdp", "fsdp, one unit"):
        units = "model" if name == "fsdp, one unit" else "stages"
        model = DDP(fresh_model()) if name == "ddp" else script.shard(fresh_model(), None, True, units)
        optimizer, _ = optimizer_and_schedule("distributed_fsdp.py", model, run_args())
        train_steps(model, optimizer, rank, world_size, slice(0, STEPS))
        results[name] = full_state(model)
        if name == "fsdp, one unit":  # one unit holds 1/N of each weight as the stages do
            results["one_unit_local_rows"] = model.conv1.weight.to_local().shape[0]
        if name == "fsdp":
            results["fsdp_local_rows"] = model.conv1.weight.to_local().shape[0]
            # buffers are not sharded: each rank's own running statistics, before any checkpoint broadcasts them
            results["fsdp_own_buffers"] = {k: v.clone() for k, v in model.named_buffers()}
    return {**results, "continued": continue_sharded(rank, world_size, output_dir)}


@pytest.fixture(scope="module")
def float64_runs(module_dir):
    """{world size: each rank's results}, the sharded run continued on 2 ranks, then 3, then 1."""
    out = module_dir("fsdp-float64")
    return {n: on_ranks(n, on_every_world_size, str(out / "run"), results_dir=out / str(n)) for n in (2, 3)} | {
        1: on_ranks(1, continue_sharded, str(out / "run"), True, results_dir=out / "1"), "dir": out / "run"}


def hsdp_against_ddp(rank, world_size, output_dir):
    """On 4 ranks: three steps of DDP, then of HSDP on a 2 x 2 mesh (--replicas 2); then one step of the run in
    output_dir continued as HSDP."""
    results = {}
    for name in ("ddp", "hsdp"):
        mesh = sharding.hsdp_mesh(env_of(rank, world_size), 2)
        model = DDP(fresh_model()) if name == "ddp" else script.shard(fresh_model(), None, True, mesh=mesh)
        optimizer, _ = optimizer_and_schedule("distributed_fsdp.py", model, run_args())
        train_steps(model, optimizer, rank, world_size, slice(0, STEPS))
        results[name] = full_state(model)
    return {**results, "continued": continue_sharded(rank, world_size, output_dir, replicas=2)}


@pytest.fixture(scope="module")
def hsdp_runs(module_dir):
    """{world size: each rank's results}: a run in one directory continued as FSDP on 2 ranks, HSDP on 4 (2 x 2),
    FSDP on 1; on the 4 ranks, HSDP against DDP first."""
    out = module_dir("hsdp")
    chain = ((2, continue_sharded), (4, hsdp_against_ddp), (1, continue_sharded))
    return {n: on_ranks(n, fn, str(out / "run"), results_dir=out / str(n)) for n, fn in chain}


@pytest.mark.slow  # processes on 1, 2 and 4 ranks, float64
def test_hsdp_trains_the_weights_of_ddp_and_each_rank_holds_half_the_state_on_a_2x2_mesh(hsdp_runs):
    """HSDP on 4 ranks in 2 groups of 2: every weight and buffer as DDP's; each rank holds the shard of its group's
    2 (conv1's 32 of 64 rows, half the momentum), the rank of the same place in the other group the same one."""
    ranks = hsdp_runs[4]
    for r in ranks:
        for key, expected in ranks[0]["ddp"].items():
            torch.testing.assert_close(r["hsdp"][key], expected, rtol=1e-12, atol=1e-14, msg=key)
    (alone,) = [r["momentum_bytes"] for r in hsdp_runs[1]]
    assert alone == 8 * sum(p.numel() for p in models.resnet18_cifar().parameters())  # float64 momentum
    assert [r["continued"]["momentum_rows"] for r in ranks] == [32] * 4
    assert [r["continued"]["momentum_bytes"] for r in ranks] == [alone // 2] * 4
    assert [r["momentum_bytes"] for r in hsdp_runs[2]] == [alone // 2] * 2  # FSDP on 2 ranks: the same halves


@pytest.mark.slow
def test_a_sharded_checkpoint_moves_between_fsdp_and_hsdp(hsdp_runs):
    """One step as FSDP on 2 ranks, the next as HSDP on 4 (2 x 2), the last as FSDP on 1, each resumed from the
    sharded checkpoint of the one before: the weights of DDP's three steps on 4 ranks."""
    assert [r["resumed_at"] for r in hsdp_runs[2]] == [(0, 0)] * 2
    assert [r["continued"]["resumed_at"] for r in hsdp_runs[4]] == [(0, 1)] * 4
    (one,) = hsdp_runs[1]
    assert one["resumed_at"] == (0, 2)
    for key, tensor in hsdp_runs[4][0]["ddp"].items():
        rtol = 1e-7 if key.endswith("running_var") else 1e-9  # SyncBatchNorm's E[x^2] - mean^2 against one pass
        torch.testing.assert_close(one["state"][key], tensor, rtol=rtol, atol=1e-12, msg=key)


def test_a_replica_count_that_does_not_divide_the_ranks_is_one_line():
    with pytest.raises(UsageError, match=r"--replicas 3 cannot split 4 ranks into equal groups"):
        sharding.hsdp_mesh(env_of(0, 4), 3)


@pytest.mark.slow  # processes on 2 and 3 ranks, float64
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_trains_the_weights_of_ddp(world_size, float64_runs):
    ranks = float64_runs[world_size]
    assert sum(r["fsdp_local_rows"] for r in ranks) == 64  # conv1's 64 output channels, split over the ranks
    assert all(r["fsdp_local_rows"] < 64 for r in ranks)
    assert [r["one_unit_local_rows"] for r in ranks] == [r["fsdp_local_rows"] for r in ranks]
    ddp = ranks[0]["ddp"]
    assert (ddp["conv1.weight"] - fresh_model().conv1.weight).abs().max() > 1e-3  # 3 steps at lr 0.1 moved it
    for r in ranks:
        for key, expected in ddp.items():
            torch.testing.assert_close(r["fsdp"][key], expected, rtol=1e-12, atol=1e-14, msg=key)
            torch.testing.assert_close(r["fsdp, one unit"][key], expected, rtol=1e-12, atol=1e-14, msg=key)
        # SyncBatchNorm keeps each rank's running statistics equal to the others' (and to DDP's)
        for key, buffer in r["fsdp_own_buffers"].items():
            torch.testing.assert_close(buffer, ranks[0]["fsdp_own_buffers"][key], rtol=0, atol=0, msg=key)
            torch.testing.assert_close(buffer, ddp[key], rtol=1e-12, atol=1e-14, msg=key)


@pytest.mark.slow  # processes on 2 and 3 ranks, float64
def test_a_sharded_checkpoint_continues_the_run_at_another_world_size(float64_runs):
    """One step on 2 ranks, the next on 3, the last on 1, each resumed from the sharded checkpoint of the
    one before, mid-epoch: the weights of the run on 2 ranks that was never interrupted."""
    two, three, (one,) = (r["continued"] for r in float64_runs[2]), (r["continued"] for r in float64_runs[3]), \
        float64_runs[1]
    assert [r["resumed_at"] for r in two] == [(0, 0)] * 2
    assert [(r["resumed_at"], r["momentum_rows"]) for r in three] == [((0, 1), 22), ((0, 1), 22), ((0, 1), 20)]
    assert one["resumed_at"] == (0, 2)  # conv1's momentum above: resharded as torch.chunk splits 64 rows
    out = float64_runs["dir"]
    assert sorted(os.listdir(out)) == ["checkpoint.1.dcp", "checkpoint.dcp", "run.lock"]  # --keep 2
    assert sorted(os.listdir(out / "checkpoint.dcp")) == [".metadata", "__0_0.distcp", "run.pt"]  # saved by 1 rank
    expected = float64_runs[2][0]["fsdp"]
    for key, tensor in expected.items():
        # running variances: SyncBatchNorm's E[x^2] - mean^2 on 2 and 3 ranks against BatchNorm's one pass on 1
        rtol = 1e-7 if key.endswith("running_var") else 1e-9
        torch.testing.assert_close(one["state"][key], tensor, rtol=rtol, atol=1e-12, msg=key)


def mixed_precision_dtypes():
    """What the bfloat16 policy computes in: a convolution's output, BatchNorm's weights, the logits, the
    gradients and the weights the optimizer updates."""
    model = script.shard(CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()), torch.bfloat16, True)
    seen = {}
    block = model.layer1[0]
    block.conv1.register_forward_hook(lambda m, i, out: seen.update(conv=out.dtype, conv_weight=m.weight.dtype))
    block.bn1.register_forward_hook(lambda m, i, out: seen.update(norm_weight=m.weight.dtype))
    logits = model(torch.randn(4, 3, SIDE, SIDE))
    logits.sum().backward()
    return {**seen, "logits": logits.dtype, "grad": model.layer1[0].conv1.weight.grad.dtype,
            "master": model.layer1[0].conv1.weight.dtype}


@pytest.mark.slow  # processes on 2 and 3 ranks, float64
def test_the_bfloat16_policy_computes_in_bfloat16_and_keeps_float32_weights_and_gradients(float64_runs):
    (one,) = float64_runs[1]
    assert one["bfloat16_policy"] == {"conv": torch.bfloat16, "conv_weight": torch.bfloat16,
                                      "norm_weight": torch.float32, "logits": torch.float32, "grad": torch.float32,
                                      "master": torch.float32}


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield env_of(0, 1)
    finally:
        dist.destroy_process_group()


def test_a_failed_sharded_save_is_one_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, world_of_one):
    model = fully_shard(nn.Linear(200, 100))
    optimizer, scheduler = optimizer_and_schedule("distributed_fsdp.py", model, run_args())
    saver = ShardedCheckpoint(Options.from_flags(run_args(tmp_path, keep=1), sharded=True), world_of_one,
                              "distributed_fsdp.py", model=model, optimizer=optimizer, scheduler=scheduler)
    saver.save(epoch=1)
    before = sorted(os.listdir(tmp_path / "checkpoint.dcp"))

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)  # the rename of the whole checkpoint into place
    with pytest.raises(StorageError) as failed:
        saver.save(epoch=2)
    monkeypatch.undo()
    message = str(failed.value)
    assert f"could not write {tmp_path / 'checkpoint.dcp'} (No space left on device;" in message, message
    assert "the previous checkpoint" in message and "is intact" in message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.dcp"]  # no unfinished checkpoint.dcp.tmp left
    assert sorted(os.listdir(tmp_path / "checkpoint.dcp")) == before
    assert checkpoint.load(str(tmp_path / "checkpoint.dcp"))["epoch"] == 1


def shard_with_a_unit_per_norm(model: nn.Module, amp_dtype: torch.dtype) -> nn.Module:
    """shard() as it was before 2026-11-24: 20 BatchNorm units of their own (float32), then the stages and root."""
    for norm in [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
        fully_shard(norm, reshard_after_forward=False)
    policy = dict(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mp_policy=MixedPrecisionPolicy(**policy))
    return fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))


def bfloat16_layouts(rank, world_size):
    """Three bfloat16 steps of the script's shard() and of the layout before it (a unit per BatchNorm layer), the
    same data on each: the collectives of the second step of each, and the weights each ends with."""
    from benchmarks.ladder import CountedCollectives
    out = {}
    for name, shard in (("shard", lambda m: script.shard(m, torch.bfloat16, True)),
                        ("unit per norm", lambda m: shard_with_a_unit_per_norm(m, torch.bfloat16))):
        torch.manual_seed(0)
        model = shard(CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        images, targets = torch.randn(4, 3, SIDE, SIDE, generator=g), torch.randint(0, 100, (4,), generator=g)
        counted = CountedCollectives()
        for step in range(3):
            with counted if step == 1 else contextlib.nullcontext():
                nn.functional.cross_entropy(model(images), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[name] = {"calls": counted.calls, "state": state}
    return out


@pytest.mark.slow  # 2 processes
def test_all_batchnorm_layers_are_one_float32_unit_with_the_arithmetic_of_one_unit_each(tmp_path):
    """The bfloat16 layout keeps BatchNorm in float32 as one FSDP unit: one all-gather and one reduce-scatter a
    step for its 20 layers instead of 20 each (fewer, larger collectives and hooks), and the same weights as
    with a unit per layer, bit for bit."""
    grouped, per_norm = (on_ranks(2, bfloat16_layouts, results_dir=tmp_path)[0][k] for k in ("shard", "unit per norm"))

    def count(kind: str) -> dict:  # all_gather_* / reduce_scatter_* calls of one step, each layout
        return {name: sum(n for c, n in run["calls"].items() if c.startswith(kind))
                for name, run in (("grouped", grouped), ("per norm", per_norm))}
    gathers, scatters = count("all_gather"), count("reduce_scatter")
    assert scatters == {"grouped": 6, "per norm": 25}  # 4 stages and the root, + 1 or + 20 for the norms
    assert gathers["per norm"] - gathers["grouped"] >= 18, gathers  # about one per BatchNorm unit fewer
    for key, tensor in per_norm["state"].items():
        assert torch.equal(grouped["state"][key], tensor), key
