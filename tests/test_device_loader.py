"""--loader device (speed/device_loader.py): the same batches as the DataLoader path, bit for bit, and the
augmentation draws."""
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from script_parts import evaluation_loader, train_loader
from script_runs import TINY, run_main
from torch.overrides import TorchFunctionMode

from speed import device_loader
from speed.device_loader import DeviceLoader
from utils import data

CPU = torch.device("cpu")


def sampler(dataset, rank, world_size, seed):
    """The scripts' training sampler."""
    return data.ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed, drop_last=True)


def both_train_loaders(dataset, batch, rank, world_size, seed):
    """The DataLoader and the device loader over one sampler, as distributed_apex.py makes them."""
    shared = sampler(dataset, rank, world_size, seed)
    return shared, [train_loader(dataset, shared, batch, loader=loader) for loader in ("dataloader", "device")]


@pytest.mark.parametrize("world_size", [1, 2])
def test_device_train_batches_equal_the_dataloader_batches(world_size):
    dataset = data.Images(*data.synthetic(50, train=True), augment=True, seed=3)
    steps = 50 // world_size // 4
    for rank in range(world_size):
        shared, (reference, device) = both_train_loaders(dataset, 4, rank, world_size, seed=3)
        assert isinstance(device, DeviceLoader) and len(device) == len(reference) == steps
        for epoch, start_step in ((0, 0), (1, 0), (1, 2)):
            shared.set_epoch(epoch, skip=start_step * 4)  # as the scripts call it
            expected = list(reference)
            shared.set_epoch(epoch, skip=start_step * 4)  # a second pass over the epoch: set_epoch again
            got = list(device)
            assert len(got) == len(expected) == len(device) == len(reference) == steps - start_step
            for (want_x, want_y), (x, y) in zip(expected, got, strict=True):
                assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_device_test_batches_equal_the_dataloader_shard():
    dataset = data.Images(*data.synthetic(10, train=False), augment=False, seed=0)
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            reference, device = [evaluation_loader(dataset, 3, rank, world_size, loader=loader)
                                 for loader in ("dataloader", "device")]
            assert isinstance(device, DeviceLoader)
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
    train = train_loader(train_set, shared, 4, device=meta, loader="device")
    test_set = data.Images(*data.synthetic(10, train=False), augment=False, seed=0)
    test = evaluation_loader(test_set, 4, rank=0, world_size=1, device=meta, loader="device")
    shared.set_epoch(0)
    made, calls = [], []
    for loader in (train, test):
        batches = iter(loader)
        while True:
            with HostData() as seen:
                batch = next(batches, None)
            if batch is None:
                break
            made.append(batch)
            calls.append(seen.calls)
    # the order of an epoch (or of the test shard) comes from the host once, at its first batch; no batch after it
    assert calls == [["tensor", "to"], [], [], []] + [["tensor", "to"], [], []]
    assert [len(y) for _, y in made] == [4, 4, 4, 4, 4, 4, 2]
    assert all(x.device == meta and x.shape[1:] == (3, 32, 32) for x, _ in made)


@pytest.mark.parametrize("script, flags", [("distributed", []),
                                           ("distributed_apex", ["--opt-level", "O0", "--loader", "device"])])
def test_a_training_set_without_a_whole_batch_is_a_usage_error(script, flags, tmp_path, capsys, monkeypatch):
    """5 images and a global batch of 8 give no step with either loader: one line, exit status 2 (a world of one in
    pytest's process, as torchrun would start it)."""
    import importlib
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    argv = TINY + ["--train-samples", "5", "--batch-size", "8", "--device", "cpu", "--output-dir",
                   str(tmp_path / "out"), *flags]
    said = run_main(importlib.import_module(script).main, argv, capsys)
    assert said.returncode == 2, said
    (line,) = said.stderr.strip().splitlines()
    assert "5 training images make no whole batch of --batch-size 8" in line, line


def test_loader_flag():
    """--loader is the fast GPU path's, distributed_apex.py's alone: the other scripts refuse it."""
    import distributed
    import distributed_apex
    assert distributed_apex.parse_args([]).loader == "dataloader"
    assert distributed_apex.parse_args(["--loader", "device"]).loader == "device"
    with pytest.raises(SystemExit):
        distributed.parse_args(["--loader", "device"])


def test_draws_are_uniform_and_depend_on_seed_epoch_and_index():
    indices, streams = torch.arange(20_000), torch.tensor(data.STREAMS)
    top, left, flip = device_loader.augment_draws(0, 0, indices, streams)
    for values in (top, left):
        counts = torch.bincount(values, minlength=9)
        assert len(counts) == 9 and ((counts / len(indices) - 1 / 9).abs() < 0.1 / 9).all()
    assert flip.min() == 0 and flip.max() == 1 and abs(flip.float().mean() - 0.5) < 0.02 * 0.5
    for seed, epoch in ((0, 1), (1, 0)):
        other = device_loader.augment_draws(seed, epoch, indices, streams)
        for mine, theirs in zip((top, left, flip), other, strict=True):
            assert (mine != theirs).float().mean() > 0.4  # independent draws differ 8/9 or 1/2 of the time
    for i in (0, 7, 19_999):  # alone, as a Python int (a DataLoader worker) or in a batch: the same draw
        alone = device_loader.augment_draws(0, 0, torch.tensor([i]), streams)
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
