"""On GPUs only (skipped without): the NCCL path, and torch's SyncBatchNorm against ours."""
import pytest
import torch
from distributed_helpers import on_ranks
from script_runs import TINY, check, launcher, load_checkpoint, read_metrics, run
from torch import nn

from utils.syncbn import CpuSyncBatchNorm

pytestmark = pytest.mark.gpu
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


@needs_gpu
def test_fsdp_under_torchrun_trains_in_its_bfloat16_policy_and_its_shards_evaluate(tmp_path):
    from safety_net import checkpoint
    nprocs = min(GPUS, 2)
    gpus = ",".join(map(str, range(nprocs)))
    check(run(launcher("torchrun", "distributed_fsdp.py", nprocs) + TINY + ["--device", "cuda", "--output-dir",
                                                                             str(tmp_path)], CUDA_VISIBLE_DEVICES=gpus))
    (record,) = read_metrics(tmp_path)
    assert record["world_size"] == nprocs and record["samples"] == 21
    header = checkpoint.load(str(tmp_path / "checkpoint.dcp"))
    assert header["resolved"]["precision"] == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
    check(run(launcher("torchrun", "distributed_fsdp.py", 1) + TINY + ["--device", "cuda", "--evaluate",
                                                                        "--output-dir", str(tmp_path)],
              CUDA_VISIBLE_DEVICES="0"))


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


@needs_gpu
def test_device_loader_on_cuda_gives_the_cpu_batches():
    """The draws are exact integer arithmetic and the rest is element-wise: CUDA batches equal the CPU's, the
    training set's (from a step part-way, as a resume starts) and the test shard's."""
    from script_parts import evaluation_loader, train_loader

    from utils import data
    dataset = data.Images(*data.synthetic(40, train=True), augment=True, seed=5)
    sampler = data.ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=5, drop_last=True)
    test_set = data.Images(*data.synthetic(20, train=False), augment=False, seed=5)

    def batches(device: str, skip: int) -> list:
        sampler.set_epoch(1, skip=skip)  # each pass over the epoch after its own set_epoch, as the scripts do
        return [*train_loader(dataset, sampler, 8, device=torch.device(device), loader="device"),
                *evaluation_loader(test_set, 8, rank=0, world_size=2, device=torch.device(device), loader="device")]

    for skip in (0, 8):
        cpu, gpu = batches("cpu", skip), batches("cuda", skip)
        assert len(gpu) == len(cpu) == 5 - skip // 8 + 2
        for (cpu_images, cpu_targets), (gpu_images, gpu_targets) in zip(cpu, gpu, strict=True):
            assert gpu_images.is_cuda
            torch.testing.assert_close(gpu_images.cpu(), cpu_images, rtol=0, atol=1e-6)
            assert torch.equal(gpu_targets.cpu(), cpu_targets)


@needs_gpu
def test_benchmark_on_the_gpu(tmp_path):
    """The benchmark's GPU path: NCCL rows, the bfloat16 ideal and peak (one row, few steps)."""
    import json
    import sys
    check(run([sys.executable, "-m", "benchmarks.run", "--only", "DDP + bfloat16 autocast", "--steps", "4",
               "--batch-size", "64", "--nprocs", "1", "--output-dir", str(tmp_path)], CUDA_VISIBLE_DEVICES="0"))
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert results["meta"]["device"] == "cuda" and results["rows"][0]["images_per_s"] > 0


@needs_2_gpus
def test_dataparallel_replicas_autocast_in_the_dtype_asked():
    """An autocast around the DataParallel call reaches its replica threads as float16 whatever dtype was
    asked; dataparallel.AutocastInForward enters the asked one inside each replica."""
    import dataparallel
    from utils import models
    model = models.resnet18_cifar().cuda()
    images = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outside = nn.DataParallel(model, device_ids=[0, 1])(images)
    inside = nn.DataParallel(dataparallel.AutocastInForward(model, torch.bfloat16), device_ids=[0, 1])(images)
    assert outside.dtype == torch.float16  # torch's behaviour this class exists for
    assert inside.dtype == torch.bfloat16


@needs_gpu
def test_dataparallel_float16_with_its_grad_scaler(tmp_path):
    check(run([*launcher("python", "dataparallel.py"), *TINY, "--device", "cuda", "--opt-level", "O1",
               "--amp-dtype", "float16", "--output-dir", str(tmp_path)], CUDA_VISIBLE_DEVICES="0"))
    assert read_metrics(tmp_path)[0]["samples"] == 21
    assert load_checkpoint(tmp_path)["scaler"]["scale"] > 0
