"""The real CIFAR-100 loading code on fake files in the real format; shards, order and augmentation."""
import hashlib
import multiprocessing
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torchvision
from script_parts import SHARDING, loaders, train_loader

from utils import data
from utils.errors import UsageError


def write_fake_cifar100(root, n_train=30, n_test=11):
    """cifar-100-python/{train,test,meta} as in the real archive: pickled dicts that load (with
    encoding="latin1", as torchvision reads the Python 2 pickles) to str keys and uint8 rows."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 "fine_labels": rng.integers(0, 100, n).tolist(), "coarse_labels": [0] * n,
                 "filenames": [f"{i}.png" for i in range(n)], "batch_label": name}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i}" for i in range(100)],
                                                "coarse_label_names": ["x"] * 20}, protocol=2))
    return folder


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def args_for(root, **overrides):
    return SimpleNamespace(**{"dataset": "cifar100", "data_dir": str(root), "train_samples": None,
                              "test_samples": None, "no_augment": False, "seed": 0, **overrides})


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch):
    folder = write_fake_cifar100(tmp_path)
    # torchvision checks each file's md5 against the real archive's; swap in the fake files' sums only
    cifar = torchvision.datasets.CIFAR100
    monkeypatch.setattr(cifar, "train_list", [["train", md5(folder / "train")]])
    monkeypatch.setattr(cifar, "test_list", [["test", md5(folder / "test")]])
    monkeypatch.setattr(cifar, "meta", {**cifar.meta, "md5": md5(folder / "meta")})
    return tmp_path, folder


def test_cifar100_files_load_as_normalised_images(fake_cifar):
    root, folder = fake_cifar
    raw = pickle.loads((folder / "train").read_bytes())
    train = data.load(args_for(root, no_augment=True), train=True)
    test = data.load(args_for(root, test_samples=7), train=False)
    assert len(train) == 30 and len(test) == 7
    image, label = train[4]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert label == raw["fine_labels"][4]
    pixels = torch.from_numpy(raw["data"][4].reshape(3, 32, 32)).float() / 255  # rows are R, G, B planes
    expected = (pixels - torch.tensor(data.MEAN)[:, None, None]) / torch.tensor(data.STD)[:, None, None]
    torch.testing.assert_close(image, expected)


def test_corrupt_cifar100_is_a_usage_error(tmp_path):
    write_fake_cifar100(tmp_path)  # the real md5 sums do not match these files
    with pytest.raises(UsageError, match="cannot read CIFAR-100"):
        data.load(args_for(tmp_path), train=True)


def test_augmentation_depends_on_seed_epoch_and_index_only():
    images, targets = data.synthetic(8, train=True)
    a = data.Images(images, targets, augment=True, seed=0)
    b = data.Images(images.clone(), targets, augment=True, seed=0)
    epochs = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        epochs.append(torch.stack([a[i][0] for i in range(8)]))
        assert torch.equal(epochs[-1], torch.stack([b[i][0] for i in reversed(range(8))]).flip(0))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    plain = data.Images(images, targets, augment=False, seed=0)
    assert not torch.equal(epochs[0], torch.stack([plain[i][0] for i in range(8)]))


def test_synthetic_set_is_a_prefix_and_differs_between_train_and_test():
    small, small_y = data.synthetic(1500, train=True)
    large, large_y = data.synthetic(2500, train=True)
    assert torch.equal(small, large[:1500]) and torch.equal(small_y, large_y[:1500])
    test, _ = data.synthetic(1500, train=False)
    assert not torch.equal(small, test)


def sampler_of(dataset, rank, world_size, seed=7):
    """The scripts' training sampler."""
    return data.ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed, drop_last=True)


@pytest.mark.parametrize("script", SHARDING)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_batches_are_the_same_at_every_world_size(world_size, script):
    dataset = data.Images(*data.synthetic(50, train=True), augment=False, seed=0)
    samplers = [sampler_of(dataset, r, world_size) for r in range(world_size)]
    one = sampler_of(dataset, 0, 1)
    reference = train_loader(dataset, one, 6, script="distributed.py")
    loaders = [train_loader(dataset, s, 6 // world_size, script=script) for s in samplers]
    for epoch in (0, 1):
        for sampler in [one, *samplers]:
            sampler.set_epoch(epoch)
        expected = [set(batch) for batch in _indices(reference, dataset)]
        ranks = [list(_indices(loader, dataset)) for loader in loaders]
        assert all(len(loader) == len(reference) == 50 // 6 for loader in loaders)
        assert [set().union(*(r[k] for r in ranks)) for k in range(len(reference))] == expected


def test_set_epoch_gives_each_epoch_its_order_and_augmentation_and_skip_starts_it_part_way():
    """ResumableDistributedSampler.set_epoch(epoch, skip): a new seeded order each epoch (the same on every call),
    the dataset told the epoch (its augmentation's), and the first `skip` samples of this rank left out, as a
    mid-epoch resume needs; the loader's length follows. A second pass over an epoch without a set_epoch between
    is an error, not a repeat of that epoch's order (failures/set_epoch_forgotten.py shows the repeat that torch's
    own DistributedSampler gives)."""
    dataset = data.Images(*data.synthetic(50, train=True), augment=True, seed=0)
    sampler = sampler_of(dataset, rank=1, world_size=2)
    loader = train_loader(dataset, sampler, 6)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        assert dataset.epoch == epoch and len(orders[-1]) == 25 and len(loader) == 25 // 6
    assert orders[0] != orders[1] and sorted(orders[0]) != sorted(orders[1])  # another order and another share
    sampler.set_epoch(0)
    assert list(sampler) == orders[0] and dataset.epoch == 0  # the same order again: it depends on the epoch alone
    sampler.set_epoch(1, skip=12)  # 2 steps of 6 trained before a checkpoint
    assert list(sampler) == orders[1][12:] and len(sampler) == 13 and len(loader) == 2 and dataset.epoch == 1
    with pytest.raises(RuntimeError, match=r"epoch 1 was iterated already: call sampler.set_epoch\(epoch\)"):
        list(loader)  # the epoch's second pass, set_epoch forgotten
    sampler.set_epoch(1, skip=12)
    batches = [[int(i) for i in batch] for batch in _indices(loader, dataset)]
    assert batches == [orders[1][12:18], orders[1][18:24]]
    sampler.set_epoch(1, skip=25)  # a checkpoint of the epoch's last step: nothing left of it
    assert len(loader) == 0 and list(loader) == []


SET_IN_THE_RANK = False  # made True at run time in the rank: a forked worker inherits it, a spawned one re-imports


class _WhoLoads(data.Images):
    """Images whose targets also say which process loaded each sample and whether it was forked from the rank."""

    def __getitem__(self, index):
        image, target = super().__getitem__(index)
        return image, torch.tensor([int(target), os.getpid(), int(SET_IN_THE_RANK)])


def _three_epochs_in_a_spawned_rank(_local_rank, results: str) -> None:
    global SET_IN_THE_RANK
    SET_IN_THE_RANK = True
    dataset = _WhoLoads(*data.synthetic(40, train=True), augment=True, seed=3)
    sampler = sampler_of(dataset, rank=0, world_size=1)
    without_workers = train_loader(dataset, sampler, 8, workers=0)
    with_workers = train_loader(dataset, sampler, 8, workers=2)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)  # the scripts' call: the order's epoch and the augmentation's
        expected = list(without_workers)
        sampler.set_epoch(epoch)  # the same epoch's second pass, through the other loader
        got = list(with_workers)
        epochs.append({"same batches": all(torch.equal(a[0], b[0]) and torch.equal(a[1][:, 0], b[1][:, 0])
                                           for a, b in zip(expected, got, strict=True)),
                       "worker pids": {int(pid) for _, who in got for pid in who[:, 1]},
                       "forked": all(bool(f) for _, who in got for f in who[:, 2])})
    torch.save({"start method": multiprocessing.get_start_method(), "epochs": epochs}, results)


def test_a_spawned_rank_forks_its_workers_once_per_run(tmp_path):
    """In a rank started by mp.spawn (the start method there is spawn, whose workers import torch again:
    10-30 s per epoch), the training workers are forked, started once and kept for every epoch, and
    still give each epoch's augmentation, bit for bit the batches of a loader without workers."""
    mp.spawn(_three_epochs_in_a_spawned_rank, args=(str(tmp_path / "r.pt"),), nprocs=1)
    seen = torch.load(tmp_path / "r.pt", weights_only=False)
    assert seen["start method"] == "spawn"  # what the workers would have got without multiprocessing_context="fork"
    epochs = seen["epochs"]
    assert all(e["same batches"] and e["forked"] for e in epochs), epochs
    assert len(epochs[0]["worker pids"]) == 2 and epochs[0]["worker pids"] == epochs[1]["worker pids"] \
        == epochs[2]["worker pids"], epochs
    assert os.getpid() not in epochs[0]["worker pids"]


def _indices(loader, dataset):
    """Each batch as the dataset indices of its images, found by matching pixels."""
    flat = torch.stack([dataset[i][0] for i in range(len(dataset))]).flatten(1)
    for images, _ in loader:
        yield [int((flat == img.flatten()).all(1).nonzero()[0]) for img in images]


@pytest.mark.parametrize("script", [*SHARDING, "dataparallel.py"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_test_shards_cover_the_test_set_exactly_once(world_size, script):
    """Each script's own test loader: its ranks' shards hold every test image once (10 images: 3 and 4 ranks do not
    divide them, where torch's DistributedSampler would pad the shards with repeats)."""
    if script == "dataparallel.py" and world_size > 1:
        pytest.skip("one process")
    dataset = data.Images(*data.synthetic(10, train=False), augment=False, seed=0)
    shards = [loaders(script, dataset, dataset, sampler_of(dataset, rank, world_size), 4, rank, world_size)[1]
              for rank in range(world_size)]
    seen = [i for shard in shards for i in (shard.sampler if shard.sampler is not None else range(len(dataset)))]
    assert sorted(seen) == list(range(10)), script
    # and the batches are those images, each once
    batches = [targets for shard in shards for _, targets in shard]
    assert sorted(torch.cat(batches).tolist()) == sorted(dataset.targets.tolist()), script


def test_the_class_count_comes_from_the_data(tmp_path):
    images, targets = data.synthetic(20, train=True)
    assert data.num_classes(data.Images(images, targets, augment=False, seed=0, classes=["a"] * 100)) == 100
    assert data.num_classes(data.Images(images, targets, augment=False, seed=0)) == int(targets.max()) + 1
    assert data.num_classes(data.load(args_for(tmp_path, dataset="synthetic", train_samples=10), train=True)) == 100
    with pytest.raises(UsageError, match="give it a `classes` list"):
        data.num_classes(torch.utils.data.TensorDataset(images, targets))
