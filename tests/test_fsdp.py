"""distributed_fsdp.py: FSDP trains the weights DDP trains, and its sharded checkpoints continue a run at
any world size.

The equality is proven in float64 with the real model, CpuSyncBatchNorm, the script's own shard() and
train_one_epoch, and SGD with its cosine schedule; float32 cannot settle it (tests/test_ddp_equivalence.py).
"""
import os
from types import SimpleNamespace

import torch
from distributed_helpers import NEVER_STOPPED, NO_CHECKPOINTS, on_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed_fsdp as script
from utils import models
from utils.launch import Env
from utils.progress import EpochProgress
from utils.sharded_checkpoint import ShardedCheckpoint
from utils.syncbn import CpuSyncBatchNorm

STEPS, GLOBAL_BATCH = 3, 12


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g, dtype=torch.float64),
             torch.randint(0, 100, (GLOBAL_BATCH,), generator=g)) for _ in range(steps)]


def run_args(output_dir="", **overrides):
    return SimpleNamespace(**{
        "print_freq": 100, "epochs": 2, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "batch_size": GLOBAL_BATCH,
        "seed": 0, "output_dir": str(output_dir), "keep": 2, "resume": None, "restart": False, "init_from": None,
        "save_every_steps": 0, "checkpoint_format": "sharded", "dataset": "synthetic", "train_samples": None,
        "no_augment": False, "no_sync_bn": False, **overrides})


def env_of(rank, world_size):
    return Env(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))


def full_state(model):
    """The unsharded weights and buffers, on every rank (an all-gather under FSDP)."""
    if isinstance(model, DDP):
        model = model.module
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def train_steps(model, data, rank, world_size, optimizer, scheduler, epoch=0):
    """The script's train_one_epoch over `data` (the global batches, dealt rank::world_size as the sampler
    deals), then the scheduler's epoch step."""
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in data]
    progress = EpochProgress(shard, steps=len(shard), epoch=epoch, env=env_of(rank, world_size), args=run_args())
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, progress, env_of(rank, world_size),
                           NEVER_STOPPED, NO_CHECKPOINTS)
    scheduler.step()


def fresh_model():
    torch.manual_seed(0)
    return CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()).double()


def ddp_and_fsdp(rank, world_size):
    """Three steps and a scheduler step of DDP, then of FSDP, from the same weights on the same batches."""
    results = {}
    for name in ("ddp", "fsdp"):
        model = DDP(fresh_model()) if name == "ddp" else script.shard(fresh_model(), None, reshard_after_forward=True)
        optimizer, scheduler = models.sgd_with_cosine(model, run_args())
        train_steps(model, batches(), rank, world_size, optimizer, scheduler)
        results[name] = full_state(model)
        if name == "fsdp":
            local = model.conv1.weight
            results["fsdp_local_rows"] = local.to_local().shape[0] if isinstance(local, DTensor) else None
            # buffers are not sharded: each rank's own running statistics, before any checkpoint broadcasts them
            results["fsdp_own_buffers"] = {k: v.clone() for k, v in model.named_buffers()}
    return results


def test_fsdp_trains_the_weights_of_ddp_on_2_and_3_ranks(tmp_path):
    for world_size in (2, 3):
        ranks = on_ranks(world_size, ddp_and_fsdp, results_dir=tmp_path / str(world_size))
        assert sum(r["fsdp_local_rows"] for r in ranks) == 64  # conv1's 64 output channels, split over the ranks
        assert all(r["fsdp_local_rows"] < 64 for r in ranks)
        ddp = ranks[0]["ddp"]
        moved = (ddp["conv1.weight"] - fresh_model().conv1.weight).abs().max()
        assert moved > 1e-3  # three steps at lr 0.1 are not a no-op
        for r in ranks:
            for key, expected in ddp.items():
                torch.testing.assert_close(r["fsdp"][key], expected, rtol=1e-12, atol=1e-14, msg=f"{world_size}: {key}")
            # SyncBatchNorm keeps each rank's running statistics equal to the others' (and to DDP's)
            for key, buffer in r["fsdp_own_buffers"].items():
                torch.testing.assert_close(buffer, ranks[0]["fsdp_own_buffers"][key], rtol=0, atol=0, msg=key)
                torch.testing.assert_close(buffer, ddp[key], rtol=1e-12, atol=1e-14, msg=key)


def continue_sharded(rank, world_size, output_dir, data_slice):
    """Resume the run in output_dir at this world size (a new run if none), train the global batches
    data[data_slice] as the rest of epoch 0, and save the sharded checkpoint."""
    model = script.shard(fresh_model(), None, reshard_after_forward=True)
    args = run_args(output_dir)
    optimizer, scheduler = models.sgd_with_cosine(model, args)
    checkpoint = ShardedCheckpoint(args, env_of(rank, world_size), "distributed_fsdp.py", model=model,
                                   optimizer=optimizer, scheduler=scheduler)
    epoch, step = checkpoint.resume()
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches(6)[data_slice]]
    progress = EpochProgress(shard, steps=6, epoch=0, start_step=step, env=env_of(rank, world_size),
                             args=run_args())
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, progress, env_of(rank, world_size),
                           NEVER_STOPPED, NO_CHECKPOINTS)
    checkpoint.save(epoch=0, step=data_slice.stop)
    return {"resumed_at": (epoch, step), "state": full_state(model),
            "momentum": optimizer.state_dict()["state"][0]["momentum_buffer"].to_local().shape}


def uninterrupted(rank, world_size):
    model = script.shard(fresh_model(), None, reshard_after_forward=True)
    optimizer, scheduler = models.sgd_with_cosine(model, run_args())
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches(6)]
    progress = EpochProgress(shard, steps=6, epoch=0, env=env_of(rank, world_size), args=run_args())
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, progress, env_of(rank, world_size),
                           NEVER_STOPPED, NO_CHECKPOINTS)
    return full_state(model)


def test_a_sharded_checkpoint_continues_the_run_at_another_world_size(tmp_path):
    out = tmp_path / "run"
    first = on_ranks(2, continue_sharded, str(out), slice(0, 2), results_dir=tmp_path / "a")
    assert first[0]["resumed_at"] == (0, 0)
    assert sorted(p.name for p in (out / "checkpoint.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"]  # one file per rank, DCP's index, the header
    second = on_ranks(3, continue_sharded, str(out), slice(2, 4), results_dir=tmp_path / "b")
    assert [r["resumed_at"] for r in second] == [(0, 2)] * 3
    assert [r["momentum"][0] for r in second] == [22, 22, 20]  # conv1's momentum, resharded (torch.chunk of 64 rows)
    third = on_ranks(1, continue_sharded, str(out), slice(4, 6), results_dir=tmp_path / "c")
    assert third[0]["resumed_at"] == (0, 4)
    assert sorted(os.listdir(out)) == ["checkpoint.1.dcp", "checkpoint.dcp", "run.lock"]  # --keep 2
    (expected,) = on_ranks(1, uninterrupted, results_dir=tmp_path / "d")
    for key, tensor in expected.items():
        # running variances: SyncBatchNorm's E[x^2] - mean^2 at 2 and 3 ranks against BatchNorm's one pass at 1
        rtol = 1e-7 if key.endswith("running_var") else 1e-9
        torch.testing.assert_close(third[0]["state"][key], tensor, rtol=rtol, atol=1e-12, msg=key)


def mixed_precision_dtypes(rank, world_size):
    """What the bfloat16 policy computes in: a convolution's output, BatchNorm's weights, the logits, the
    gradients and the weights the optimizer updates."""
    model = script.shard(CpuSyncBatchNorm.convert_sync_batchnorm(models.resnet18_cifar()), torch.bfloat16, True)
    seen = {}
    block = model.layer1[0]
    block.conv1.register_forward_hook(lambda m, i, out: seen.update(conv=out.dtype, conv_weight=m.weight.dtype))
    block.bn1.register_forward_hook(lambda m, i, out: seen.update(norm_weight=m.weight.dtype))
    logits = model(torch.randn(4, 3, 32, 32))
    logits.sum().backward()
    return {**seen, "logits": logits.dtype, "grad": model.layer1[0].conv1.weight.grad.dtype,
            "master": model.layer1[0].conv1.weight.dtype}


def test_the_bfloat16_policy_computes_in_bfloat16_and_keeps_float32_weights_and_gradients(tmp_path):
    (seen,) = on_ranks(1, mixed_precision_dtypes, results_dir=tmp_path)
    assert seen == {"conv": torch.bfloat16, "conv_weight": torch.bfloat16, "norm_weight": torch.float32,
                    "logits": torch.float32, "grad": torch.float32, "master": torch.float32}
