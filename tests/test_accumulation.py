"""Accumulating k micro-batches under no_sync() == one step on the whole batch, with one all-reduce.

On a model without BatchNorm (whose batch statistics would differ per micro-batch), the training
loop of distributed_gradient_accumulation.py is run on 2 gloo ranks with k = 1 and k = 4. On the script's own
ResNet-18 and DDP wrap, the gradient all-reduces of each micro-batch are counted: none under no_sync(), one per DDP
bucket after the last micro-batch."""
import math
from types import SimpleNamespace

import pytest
import torch
from distributed_helpers import LossesKept, on_ranks
from script_parts import run
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed_gradient_accumulation as script
from utils import flags
from utils.launch import Env

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


# ResNet-18 as the script builds and wraps it, 3 optimizer steps of k = 4: DDP all-reduces its first iteration's
# gradients in one bucket of all of them (it has not yet seen the order backward makes them in), then rebuilds its
# buckets to --bucket-cap-mb (default 25 MB, the first 1 MB), in that order, once; so steps 2 and 3 show the rule
ACCU_STEPS, RESNET_STEPS, MICRO_BATCH = 4, 3, "micro-batch"
ARGV = ["--grad-accu-steps", str(ACCU_STEPS), "--batch-size", "16", "--no-sync-bn"]  # micro-batches of 2 images
BUCKETINGS = {"default": [], "one bucket": ["--bucket-cap-mb", "64"]}  # 64 MB > ResNet-18's 44.9 MB of gradients


def marked_loss(output, target):
    """The script's criterion (nn.CrossEntropyLoss), with a mark on the profiler's timeline: a micro-batch's forward."""
    with torch.profiler.record_function(MICRO_BATCH):
        return nn.CrossEntropyLoss()(output, target)


def all_reduces_on_rank(rank, world_size):
    """For each of BUCKETINGS: the element count of each gradient all-reduce, listed per micro-batch (the first list:
    before the first micro-batch), and DDP's own logging data on its buckets. --no-sync-bn: BatchNorm's per rank, so
    the only all-reduces are DDP's (CpuSyncBatchNorm all-reduces statistics in each forward and backward)."""
    out = {}
    for bucketing, flags_given in BUCKETINGS.items():
        args = script.parse_args(ARGV + flags_given)
        env = Env(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
        # the model and its DDP wrap: the script's train() lines that assign `model`, with its parsed flags
        model = run("distributed_gradient_accumulation.py", ("model",), args=args, env=env,
                    train_set=SimpleNamespace(classes=range(100)))["model"]
        assert isinstance(model, DDP)
        batch = flags.per_rank_batch(args.batch_size, world_size, args.grad_accu_steps)
        g = torch.Generator().manual_seed(rank)
        loader = [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 100, (batch,), generator=g))
                  for _ in range(RESNET_STEPS)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # counted at the backend: the profiler's "gloo:all_reduce", one event per all-reduce gloo runs, with its
        # tensor's size; DDP's own C++ path as the script runs it (no comm hook put in its place)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            script.train_one_epoch(model, marked_loss, optimizer, loader, env.device, LossesKept(),
                                   args.grad_accu_steps)
        per_micro_batch = [[]]
        # kineto's own events, in order of their start: prof.events() builds their tree first, 2 CPU seconds a rank
        for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if event.name() == MICRO_BATCH:
                per_micro_batch.append([])
            elif event.name() == "gloo:all_reduce":
                per_micro_batch[-1].append(math.prod(event.shapes()[0]))
        out[bucketing] = {"all_reduces": per_micro_batch, "ddp": model._get_ddp_logging_data(),
                          "parameters": sum(p.numel() for p in model.parameters())}
    return out


@pytest.fixture(scope="module")
def all_reduces(module_dir):
    return on_ranks(2, all_reduces_on_rank, results_dir=module_dir("all-reduces"))


def steps(counted):
    """[[step 1's micro-batches' all-reduces], ...], nothing before the first micro-batch."""
    before, *micro_batches = counted["all_reduces"]
    assert before == [] and len(micro_batches) == RESNET_STEPS * ACCU_STEPS, counted["all_reduces"]
    return [micro_batches[i:i + ACCU_STEPS] for i in range(0, len(micro_batches), ACCU_STEPS)]


@pytest.mark.parametrize("bucketing", BUCKETINGS)
def test_resnet18_all_reduces_once_per_bucket_after_the_last_micro_batch_only(bucketing, all_reduces):
    """distributed_gradient_accumulation.py's train_one_epoch, model and DDP wrap on 2 ranks, --grad-accu-steps 4: no
    all-reduce in the 3 micro-batches under no_sync(); after the 4th, one per bucket DDP made (its logging data's
    rebuilt buckets, in order, each of its size), every gradient once: several at DDP's default 25 MB (3 with torch
    2.14: 9.6, 26.5 and 8.7 MB), 1 at --bucket-cap-mb 64. Step 1 all-reduces everything in one bucket, as DDP does
    before it has seen the order backward makes the gradients in."""
    for rank in all_reduces:
        counted = rank[bucketing]
        ddp, everything = counted["ddp"], counted["parameters"]
        buckets = [int(size) // 4 for size in ddp["rebuilt_bucket_sizes"].split(", ")]  # bytes of float32
        assert sum(buckets) == everything and ddp["num_buckets_reduced"] == len(buckets), ddp
        if bucketing == "default":  # 44.9 MB of gradients in 25 MB buckets, a tensor never split: at least 2
            assert len(buckets) >= math.ceil(4 * everything / ddp["bucket_cap_bytes"]) == 2, ddp
        else:
            assert buckets == [everything], ddp
        no_sync = [[]] * (ACCU_STEPS - 1)  # the micro-batches under no_sync(): no all-reduce
        first, *rest = steps(counted)
        assert first == no_sync + [[everything]]
        assert rest == [no_sync + [buckets]] * (RESNET_STEPS - 1), (bucketing, buckets)
