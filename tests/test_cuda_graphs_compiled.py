"""--compile --cuda-graphs (speed/cuda_graphs.py; distributed_apex.py's plain model.compile()): the model compiled in
torch.compile's default mode during the graph path's eager warm-up steps, and the step with its compiled kernels
captured once. On the CPU, where each replay calls the step directly, the compiled step through CapturedSteps' static
buffers against the compiled eager loop; on a GPU (skipped without one) a short run of distributed_apex.py with both
flags (it passed on an H200: benchmarks/results/gpu-h200). ResNet-18 itself is not compiled on the CPU here: 45 s of
compiling on a fast 2-core machine, in bfloat16, which the slower development CPU emulates some 18x slower."""
import math
import sys

import pytest
import torch
from markers import gpu_test
from script_runs import ROOT, check, read_metrics, run
from torch import nn

from speed import cuda_graphs

STEPS = cuda_graphs.WARMUP_STEPS + 3  # 11 eager steps, the capture (step 12) and 2 replays
needs_gpu = gpu_test(torch.cuda.device_count() < 1, "needs a GPU")


class SmallNet(nn.Module):
    """Two convolutions with BatchNorm and a linear head: compiled in seconds on a CPU, where ResNet-18 takes minutes.
    A class of its own, as torchvision's ResNet is: dynamo skips torch.nn's own forward (an nn.Sequential would run
    eagerly under DDP). The second convolution's 1.3 MB of weights passes DDP's 1 MB first bucket, so DDP's graph
    splitter compiles the model as more than one graph, one per bucket, as it does ResNet-18."""

    def __init__(self, width: int = 192, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def compiled_runs(rank, world_size, steps: int) -> list:
    """On one rank over gloo: `steps` steps of distributed_apex.py's step in bfloat16 autocast, the model built as the
    scripts build it (CpuSyncBatchNorm, DDP, then model.compile()), three ways: the eager loop compiled,
    the graph path compiled, the eager loop uncompiled. Each gives its losses, its final weights, and dynamo's
    counters (compilations of dynamo, AOTAutograd and inductor) after each step."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distributed_apex as script
    from utils.syncbn import CpuSyncBatchNorm

    class Kept:  # stands in for the safety net: each step's loss and the counters then
        def __init__(self):
            self.losses, self.counts = [], []

        def step_done(self, loss, grad_norm=None):
            self.losses.append(float(loss.detach()))
            self.counts.append({name: dict(counted) for name, counted in counters.items()})
            return False

    def one(graphed: bool, compiled: bool):
        torch._dynamo.reset()  # each run compiles anew, as a script's process does
        counters.clear()
        device = torch.device("cpu")
        torch.manual_seed(0)
        model = CpuSyncBatchNorm.convert_sync_batchnorm(SmallNet())
        run_epoch = cuda_graphs.CapturedSteps(script.train_one_epoch, device) if graphed else script.train_one_epoch
        model = DDP(model, bucket_cap_mb=1)
        if compiled:  # as the script compiles it (CapturedSteps has turned inductor's own CUDA graphs off)
            model.compile()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, fused=True)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))
                   for _ in range(steps)]
        safety = Kept()
        run_epoch(model, nn.CrossEntropyLoss(), optimizer, batches, device, safety, torch.bfloat16,
                  torch.amp.GradScaler("cpu", enabled=False))
        return safety.losses, {key: tensor.clone() for key, tensor in model.module.state_dict().items()}, safety.counts

    return [one(graphed=False, compiled=True), one(graphed=True, compiled=True), one(graphed=False, compiled=False)]


@pytest.mark.slow  # inductor compiles a forward and a backward per DDP bucket: 20-25 s with a cold cache
def test_the_compiled_step_is_compiled_in_the_warm_up_and_captured_without_recompiling(tmp_path):
    """The graph path with a compiled model ends bit for bit on the weights of the compiled eager loop (the same
    kernels on the same batches: inductor's CPU code is deterministic at one thread), which the uncompiled loop does
    not reach; and nothing is compiled at the capture (step 12) or after it: every counter of dynamo, AOTAutograd and
    inductor stays as the eager warm-up steps left it."""
    from distributed_helpers import on_ranks
    ((eager, graphed, uncompiled),) = on_ranks(1, compiled_runs, STEPS, results_dir=tmp_path)
    (losses, weights, counts), (eager_losses, eager_weights, eager_counts) = graphed, eager
    assert len(losses) == STEPS and losses == eager_losses
    for key, tensor in eager_weights.items():
        assert torch.equal(weights[key], tensor), key
    # the kernels were inductor's: the uncompiled loop ends on other weights (fused arithmetic rounds differently)
    assert any(not torch.equal(tensor, uncompiled[1][key]) for key, tensor in weights.items())
    # compiled at the first step, one graph per DDP bucket (DDP's graph splitter), forward and backward
    warm = counts[cuda_graphs.WARMUP_STEPS - 1]
    assert warm["stats"]["unique_graphs"] >= 1 and warm["aot_autograd"]["total"] >= 2, warm
    assert counts[0]["aot_autograd"] == warm["aot_autograd"]
    # the capture and the replays after it compiled nothing, and the graph path compiled the graphs the eager loop did
    assert counts[cuda_graphs.WARMUP_STEPS:] == [warm] * (STEPS - cuda_graphs.WARMUP_STEPS)
    assert (warm["stats"], warm["aot_autograd"]["total"]) == (eager_counts[-1]["stats"],
                                                              eager_counts[-1]["aot_autograd"]["total"])


def test_the_graph_path_turns_inductors_own_cuda_graphs_off(monkeypatch):
    """The script compiles with plain model.compile(); CapturedSteps, made before it, turns inductor's CUDA graphs
    (cudagraph trees) off even where TORCHINDUCTOR_CUDAGRAPHS=1 turned them on: the compiled kernels go into the
    graph of the whole step, and a replay of it would skip the trees' memory bookkeeping."""
    import torch._inductor.config
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraphs", True)  # what TORCHINDUCTOR_CUDAGRAPHS=1 sets
    cuda_graphs.CapturedSteps(lambda *args: None, torch.device("cpu"))
    assert torch._inductor.config.triton.cudagraphs is False


# On a GPU (skipped without one): the capture itself


@needs_gpu
def test_compile_and_cuda_graphs_train_on_a_gpu(tmp_path):
    """The headline command on a small synthetic run: 2 epochs of 16 steps, the compiled step captured at step 12 of
    the first and replayed to the end of the second. torch refuses to compile during a capture, so a recompilation
    there would end the run with an error."""
    flags = ["--dataset", "synthetic", "--train-samples", "1024", "--test-samples", "64", "--batch-size", "64",
             "--epochs", "2", "--workers", "0", "--print-freq", "4", "--loader", "device", "--amp-dtype",
             "bfloat16", "--cuda-graphs", "--compile", "--device", "cuda"]
    out = tmp_path / "run"
    check(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               str(ROOT / "distributed_apex.py"), *flags, "--output-dir", str(out)], timeout=400,
              CUDA_VISIBLE_DEVICES="0"))
    metrics = read_metrics(out)
    assert [r["epoch"] for r in metrics] == [1, 2], metrics
    assert all(math.isfinite(r["train_loss"]) for r in metrics), metrics
