"""The loaders a script trains and evaluates with, chosen by --loader (utils/techniques.py): DataLoader workers
(utils/data.py's TrainLoader and test_dataloader) or the data set held on the training device
(utils/device_loader.py). Both give the same batches (the data-order contract in utils/data.py), so a run may
resume with the other loader. This module imports both; neither imports it."""
from torch.utils.data import Dataset, DistributedSampler

from utils import data
from utils.device_loader import DeviceTestLoader, DeviceTrainLoader


def train_loader(dataset: Dataset, sampler: DistributedSampler, *, per_rank_batch: int, env, args):
    """This rank's training batches in the order of `sampler`, by --loader: DataLoader workers with --workers
    processes (dataloader) or made on env.device (device). Each epoch: sampler.set_epoch(epoch), then
    loader.epoch(epoch, start_step)."""
    if args.loader == "device":
        return DeviceTrainLoader(dataset, sampler, per_rank_batch, env.device)
    return data.TrainLoader(dataset, sampler, per_rank_batch, args.workers, pin=env.device.type == "cuda")


def test_loader(dataset: Dataset, *, per_rank_batch: int, env, args):
    """This rank's share of the test set, unpadded (so every image counts once), by --loader."""
    if args.loader == "device":
        return DeviceTestLoader(dataset, per_rank_batch, env)
    return data.test_dataloader(dataset, per_rank_batch, env.rank, env.world_size, args.workers,
                                pin=env.device.type == "cuda")
