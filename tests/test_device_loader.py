"""--loader device: the same batches as the DataLoader path, bit for bit, and the augmentation draws."""
from types import SimpleNamespace

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from torch.overrides import TorchFunctionMode
from torch.utils.data import DistributedSampler

from utils import data, device_loader, loaders
from utils.device_loader import DeviceTestLoader, DeviceTrainLoader
from utils.errors import UsageError

CPU = torch.device("cpu")


def env(rank, world_size):
    return SimpleNamespace(rank=rank, world_size=world_size, device=CPU)


def sampler(dataset, rank, world_size, seed):
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed, drop_last=True)


def both_train_loaders(dataset, batch, rank, world_size, seed):
    """The DataLoader and the device loader over one sampler."""
    shared = sampler(dataset, rank, world_size, seed)
    return shared, [loaders.train_loader(dataset, shared, per_rank_batch=batch, env=env(rank, world_size),
                                      args=SimpleNamespace(workers=0, loader=loader))
                    for loader in ("dataloader", "device")]


@pytest.mark.parametrize("world_size", [1, 2])
def test_device_train_batches_equal_the_dataloader_batches(world_size):
    dataset = data.Images(*data.synthetic(50, train=True), augment=True, seed=3)
    for rank in range(world_size):
        shared, (reference, device) = both_train_loaders(dataset, 4, rank, world_size, seed=3)
        assert isinstance(device, DeviceTrainLoader) and device.steps == reference.steps == 50 // world_size // 4
        for epoch, start_step in ((0, 0), (1, 0), (1, 2)):
            shared.set_epoch(epoch)
            expected = list(reference.epoch(epoch, start_step))
            got = list(device.epoch(epoch, start_step))
            assert len(got) == len(expected) == reference.steps - start_step
            for (want_x, want_y), (x, y) in zip(expected, got, strict=True):
                assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_device_test_batches_equal_the_dataloader_shard():
    dataset = data.Images(*data.synthetic(10, train=False), augment=False, seed=0)
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            reference, device = [loaders.test_loader(dataset, per_rank_batch=3, env=env(rank, world_size),
                                                  args=SimpleNamespace(workers=0, loader=loader))
                                  for loader in ("dataloader", "device")]
            expected, got = list(reference), list(device)
            assert len(got) == len(expected) == len(device)
            for (want_x, want_y), (x, y) in zip(expected, got, strict=True):
                assert torch.equal(x, want_x) and torch.equal(y, want_y)


class HostData(TorchFunctionMode):
    """Records each tensor made from host data while on: torch.tensor and its kin, and a CPU tensor moved or
    copied to another device. On a GPU each is a blocking copy from pageable memory: the host waits for the
    work queued before it. (A TorchDispatchMode would miss torch.tensor's copy: it comes before dispatch.)"""

    MAKERS = (torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.Tensor.new_tensor)
    MOVERS = (torch.Tensor.to, torch.Tensor.cuda)

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if (func in self.MAKERS
                or func in self.MOVERS and args[0].device.type == "cpu" and result.device.type != "cpu"
                or func is torch.Tensor.copy_ and args[1].device.type == "cpu" and args[0].device.type != "cpu"):
            self.calls.append(func.__name__)
        return result


def test_device_batches_make_no_tensor_from_host_data():
    """Each batch is made from tensors already on the device, so the host never waits for the device's
    queue (before a CUDA-graph replay, for the step before). On the meta device: the same calls, no data."""
    meta = torch.device("meta")
    with HostData() as seen:  # the counter sees what it must
        torch.tensor([1], device=meta), torch.zeros(1).to(meta), torch.empty(1, device=meta).copy_(torch.zeros(1))
    assert seen.calls == ["tensor", "to", "copy_"]
    train_set = data.Images(*data.synthetic(16, train=True), augment=True, seed=0)
    shared = sampler(train_set, rank=0, world_size=1, seed=0)
    train = DeviceTrainLoader(train_set, shared, per_rank_batch=4, device=meta)
    test = DeviceTestLoader(data.Images(*data.synthetic(10, train=False), augment=False, seed=0), 4,
                            SimpleNamespace(rank=0, world_size=1, device=meta))
    shared.set_epoch(0)
    batches = train.epoch(0)  # the epoch's order comes from the host once, here
    with HostData() as seen:
        made = [next(batches) for _ in range(3)] + list(test)
    assert seen.calls == []
    assert [len(y) for _, y in made] == [4, 4, 4, 4, 4, 2]
    assert all(x.device == meta and x.shape[1:] == (3, 32, 32) for x, _ in made)


def test_device_loader_without_a_whole_batch_is_a_usage_error():
    dataset = data.Images(*data.synthetic(5, train=True), augment=True, seed=0)
    with pytest.raises(UsageError, match="make no whole batch of --batch-size 8"):
        both_train_loaders(dataset, 4, rank=0, world_size=2, seed=0)


def test_loader_flag():
    import distributed
    assert distributed.parse_args([]).loader == "dataloader"
    assert distributed.parse_args(["--loader", "device"]).loader == "device"


def test_draws_are_uniform_and_depend_on_seed_epoch_and_index():
    indices = torch.arange(20_000)
    top, left, flip = data.augment_draws(0, 0, indices)
    for values in (top, left):
        counts = torch.bincount(values, minlength=9)
        assert len(counts) == 9 and ((counts / len(indices) - 1 / 9).abs() < 0.1 / 9).all()
    assert flip.min() == 0 and flip.max() == 1 and abs(flip.float().mean() - 0.5) < 0.02 * 0.5
    for other in (data.augment_draws(0, 1, indices), data.augment_draws(1, 0, indices)):
        for mine, theirs in zip((top, left, flip), other, strict=True):
            assert (mine != theirs).float().mean() > 0.4  # independent draws differ 8/9 or 1/2 of the time
    for i in (0, 7, 19_999):  # alone, as a Python int (a DataLoader worker) or in a batch: the same draw
        alone = data.augment_draws(0, 0, torch.tensor([i]))
        assert [int(d) for d in alone] == [int(top[i]), int(left[i]), int(flip[i])]
        assert list(data.augment_draws(0, 0, i)) == [int(top[i]), int(left[i]), int(flip[i])]


@pytest.mark.parametrize(("top", "left", "flip"), [(0, 0, 0), (8, 8, 1), (0, 8, 1), (8, 0, 0), (3, 5, 1)])
def test_a_padded_crop_matches_torchvision(monkeypatch, top, left, flip):
    dataset = data.Images(*data.synthetic(8, train=True), augment=True, seed=0)
    _, (_, loader) = both_train_loaders(dataset, 4, rank=0, world_size=1, seed=0)
    monkeypatch.setattr(device_loader, "augment_draws", lambda seed, epoch, indices, streams: tuple(
        torch.full_like(indices, v) for v in (top, left, flip)))
    images, _ = loader.batch(torch.tensor([5, 2]), epoch=0)
    for got, index in zip(images, (5, 2), strict=True):
        expected = TF.crop(TF.pad(dataset.images[index], [4]), top, left, 32, 32)
        if flip:
            expected = TF.horizontal_flip(expected)
        expected = TF.normalize(TF.to_dtype(expected, torch.float32, scale=True), data.MEAN, data.STD)
        assert torch.equal(got, expected)
