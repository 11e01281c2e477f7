"""Accumulating k micro-batches under no_sync() == one step on the whole batch, with one all-reduce.

On a model without BatchNorm (whose batch statistics would differ per micro-batch), the training
loop of distributed_gradient_accumulation.py is run on 2 gloo ranks with k = 1 and k = 4."""
import torch
from distributed_helpers import LossesKept, on_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed_gradient_accumulation as script

STEPS, PER_RANK_BATCH = 3, 8


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, 10))


def train_on_rank(rank, world_size, accu_steps):
    g = torch.Generator().manual_seed(123)
    data = [(torch.randn(world_size * PER_RANK_BATCH, 3, 8, 8, generator=g),
             torch.randint(0, 10, (world_size * PER_RANK_BATCH,), generator=g)) for _ in range(STEPS)]
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in data]  # as DistributedSampler deals
    model = DDP(small_model())
    all_reduces = []

    def counting_hook(state, bucket):  # DDP calls this once per bucket per gradient all-reduce
        all_reduces.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    safety = LossesKept()
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, shard, torch.device("cpu"), safety, accu_steps)
    return {"weights": [p.detach().clone() for p in model.parameters()], "all_reduces": len(all_reduces),
            "loss": sum(safety.losses) / len(safety.losses)}


def test_accumulated_update_equals_the_whole_batch_update(tmp_path):
    whole = on_ranks(2, train_on_rank, 1, results_dir=tmp_path / "k1")
    accumulated = on_ranks(2, train_on_rank, 4, results_dir=tmp_path / "k4")
    for a, b in zip(whole[0]["weights"], accumulated[0]["weights"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for rank in accumulated:  # the ranks stay in step
        for a, b in zip(accumulated[0]["weights"], rank["weights"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    # one all-reduce per optimizer step (the model fits one bucket), with or without accumulation
    assert whole[0]["all_reduces"] == accumulated[0]["all_reduces"] == STEPS
    # the logged loss is the mean over all micro-batches, equal to the whole batch's mean loss
    assert abs(accumulated[0]["loss"] - whole[0]["loss"]) < 1e-5
