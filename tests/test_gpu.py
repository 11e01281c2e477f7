"""On GPUs only (skipped without): the NCCL path, and torch's SyncBatchNorm against ours."""
import pytest
import torch
from conftest import TINY, check, launcher, read_metrics, run
from distributed_helpers import on_ranks
from torch import nn

from utils.syncbn import CpuSyncBatchNorm

GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


@needs_gpu
@pytest.mark.parametrize("script", ["distributed.py", "distributed_apex.py"])
def test_nccl_run_under_torchrun(script, tmp_path):
    nprocs = min(GPUS, 2)
    check(run(launcher("torchrun", script, nprocs) + TINY + ["--device", "cuda", "--output-dir", str(tmp_path)],
              CUDA_VISIBLE_DEVICES=",".join(map(str, range(nprocs)))))
    (record,) = read_metrics(tmp_path)
    assert record["world_size"] == nprocs and record["samples"] == 21


def both_layers_on_rank(rank, world_size):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 4, 5, 5, generator=g) * 2 + 1)[rank::world_size].cuda()
    results = {}
    for name, cls in (("torch", nn.SyncBatchNorm), ("ours", CpuSyncBatchNorm)):
        torch.manual_seed(1)
        layer = cls(4).cuda()
        x_local = x.clone().requires_grad_()
        y = layer(x_local)
        (y * y).sum().backward()
        results[name] = [t.cpu() for t in (y, x_local.grad, layer.weight.grad, layer.running_mean,
                                           layer.running_var)]
    return results


@needs_2_gpus
def test_torch_syncbatchnorm_matches_ours(tmp_path):
    for rank in on_ranks(2, both_layers_on_rank, results_dir=tmp_path, backend="nccl"):
        for theirs, ours in zip(rank["torch"], rank["ours"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
