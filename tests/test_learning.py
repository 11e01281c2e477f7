"""Training really learns, and its evaluation counts every test image once, as one process does."""

import pytest
import torch
from script_runs import check, launcher, read_metrics, run

from utils import data, metrics
from utils.models import resnet18_cifar

TEST_SAMPLES = 101  # divisible by neither 2 nor 3


@pytest.fixture(scope="module")
def trained(module_dir):
    """2 DDP ranks, 2 epochs of 768 synthetic images: about a minute on 2 cores."""
    out = module_dir("learn")
    check(run(launcher("spawn", "distributed_mp.py") + [
        "--dataset", "synthetic", "--train-samples", "768", "--test-samples", str(TEST_SAMPLES),
        "--batch-size", "32", "--lr", "0.05", "--epochs", "2", "--no-augment", "--workers", "0",
        "--output-dir", str(out)]))
    return out


@pytest.mark.slow
def test_short_ddp_run_learns_far_above_chance(trained):
    first, last = read_metrics(trained)
    assert last["top1"] >= 20, last  # chance is 1%
    assert last["train_loss"] < first["train_loss"]


def direct_count(output_dir):
    """The reference: the whole test set through the model in one process, counted by hand."""
    from types import SimpleNamespace
    model = resnet18_cifar()
    model.load_state_dict(torch.load(output_dir / "checkpoint.pt", weights_only=True)["model"])
    model.eval()
    args = SimpleNamespace(dataset="synthetic", test_samples=TEST_SAMPLES, no_augment=True, seed=0)
    test_set = data.load(args, train=False)
    images = torch.stack([test_set[i][0] for i in range(len(test_set))])
    with torch.no_grad():
        predicted = model(images).argmax(1)
    return int((predicted == test_set.targets).sum())


@pytest.mark.slow
def test_the_training_ranks_evaluation_is_exact(trained):
    """The 2 training ranks' last evaluation of the 101 test images (no shard padded, none repeated) is the count of
    one process. At 3 ranks, and for every script at 2, tests/test_scripts_equal.py compares each epoch's evaluation
    with one process's; --evaluate at another world size: tests/test_zero.py, tests/test_fsdp_runs.py,
    tests/test_pipeline.py."""
    two_ranks = read_metrics(trained)[-1]
    assert two_ranks["samples"] == TEST_SAMPLES
    assert round(two_ranks["top1"] * TEST_SAMPLES / 100) == direct_count(trained)


def test_evaluate_counts_samples_not_batches():
    """Shards of 3 and 2 samples: averaging the two per-rank accuracies would give 50%, not 40%."""
    class Oracle(torch.nn.Module):  # right on the first two samples of the set only
        def forward(self, x):
            logits = torch.zeros(len(x), 100)
            logits[:, 0] = (x[:, 0, 0, 0] < 2).float() * 10
            return logits
    images = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 3, 2, 2)
    loader = [(images, torch.zeros(5, dtype=torch.long))]
    result = metrics.evaluate(Oracle(), loader, torch.device("cpu"))
    assert result["samples"] == 5 and result["top1"] == pytest.approx(40.0)
