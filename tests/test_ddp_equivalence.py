"""DDP + SyncBatchNorm on 2 ranks x B/2 == one process on batch B, after several SGD steps.

Run in float64 with the real model, the real DDP wrapper, CpuSyncBatchNorm and distributed.py's own
train_one_epoch. float64 because float32 cannot settle the question: on a freshly initialised
ResNet-18 with 8 images, one process's float32 gradients are already up to 7% away from its float64
gradients (layer4, small-batch BatchNorm), so any two float32 summation orders disagree that much.
"""

import torch
from distributed_helpers import LossesKept, on_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed as script
from utils.models import resnet18_cifar
from utils.syncbn import CpuSyncBatchNorm

STEPS, GLOBAL_BATCH = 3, 8


def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g, dtype=torch.float64),
             torch.randint(0, 100, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def train(model, data, rank, world_size):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    script.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, data, torch.device("cpu"), LossesKept())
    inner = model.module if isinstance(model, DDP) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def ddp_rank(rank, world_size):
    torch.manual_seed(0)
    model = DDP(CpuSyncBatchNorm.convert(resnet18_cifar()).double())
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches()]  # as DistributedSampler deals
    return train(model, shard, rank, world_size)


def test_two_ranks_with_syncbn_equal_one_process_on_the_whole_batch(tmp_path):
    torch.manual_seed(0)
    reference = train(resnet18_cifar().double(), batches(), 0, 1)
    ranks = on_ranks(2, ddp_rank, results_dir=tmp_path)
    for key, expected in reference.items():
        # running variances come from E[x^2] - mean^2 of all-reduced sums (one collective), which
        # loses a few digits to cancellation where BatchNorm's one-process Welford pass does not
        rtol = 1e-7 if key.endswith("running_var") else 1e-9
        for state in ranks:
            torch.testing.assert_close(state[key], expected, rtol=rtol, atol=1e-11, msg=key)
    # and the weights moved: three steps at lr 0.1 are not a no-op
    assert (reference["conv1.weight"] - resnet18_cifar().double().conv1.weight).abs().max() > 1e-3
