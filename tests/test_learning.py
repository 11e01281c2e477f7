"""Training really learns, and evaluation is exact at any world size."""
import json

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
@pytest.mark.parametrize("nprocs", [3])  # 2: the training run's own; 1: tests/test_end_to_end.py counts its samples
def test_evaluation_is_exact_at_any_world_size(trained, nprocs):
    check(run(launcher("spawn", "distributed_mp.py", nprocs) + [
        "--dataset", "synthetic", "--test-samples", str(TEST_SAMPLES), "--batch-size", "12", "--workers", "0",
        "--evaluate", "--output-dir", str(trained)]))
    result = json.loads((trained / "eval.json").read_text())
    assert result["samples"] == TEST_SAMPLES  # no sample repeated to even the shards, none dropped
    assert round(result["top1"] * TEST_SAMPLES / 100) == direct_count(trained)
    two_ranks = read_metrics(trained)[-1]  # evaluated by the 2 training ranks, same weights
    assert result["top1"] == pytest.approx(two_ranks["top1"]) and result["top5"] == pytest.approx(two_ranks["top5"])
    assert result["test_loss"] == pytest.approx(two_ranks["test_loss"], rel=1e-5)


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
