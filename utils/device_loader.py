"""--loader device: the data set held on the training device and each batch made there in a few kernels, with
no DataLoader workers (a speed technique: docs/speed.md). The batches are TrainLoader's, bit for bit."""
import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import DistributedSampler

from utils.data import MEAN, STD, Images, SkipFirst, augment_draws, draw_streams, whole_batches
from utils.errors import UsageError


def _statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MEAN and STD as float32 (3, 1, 1) tensors on `device`, made once per loader: TF.normalize makes them
    from the lists at each call, a blocking copy from host memory (on a GPU, a wait for the step before)."""
    return tuple(torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1) for values in (MEAN, STD))


def _normalised(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 images (..., 3, H, W) as normalised floats: Images.__getitem__'s functions, in its order, with
    TF.normalize's arithmetic (subtract, then divide) on the statistics the loader holds."""
    return TF.to_dtype(images, torch.float32, scale=True).sub(mean).div_(std)


class DeviceTrainLoader:
    """TrainLoader's batches, made on the training device: the whole set is held there as uint8, and each
    batch is gathered, cropped, flipped and normalised there in a few kernels, with no worker processes.
    Bit for bit the batches of TrainLoader: the same sampler, draws and elementwise float functions."""

    def __init__(self, dataset: Images, sampler: DistributedSampler, per_rank_batch: int, device: torch.device):
        _check_device_loadable(dataset)
        self.per_rank_batch, self.seed, self.augment = per_rank_batch, dataset.seed, dataset.augment
        self.images, self.targets = dataset.images.to(device), dataset.targets.to(device)
        self.mean, self.std, self.streams = *_statistics(device), draw_streams(device)  # made once, not per batch
        self.sampler = SkipFirst(sampler)
        self.steps = whole_batches(sampler, per_rank_batch)

    def epoch(self, epoch: int, start_step: int = 0):
        """The batches of `epoch` from `start_step` on; sampler.set_epoch(epoch) must come first."""
        self.sampler.start(epoch, start_step, self.per_rank_batch)
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        if self.images.is_cuda:  # from pinned memory the copy is queued, not waited for (the host runs ahead)
            order = order.pin_memory()
        order = order.to(self.images.device, non_blocking=True)
        b = self.per_rank_batch  # the last partial batch is dropped, as TrainLoader's drop_last does
        return (self.batch(order[k:k + b], epoch) for k in range(0, len(order) - b + 1, b))

    def batch(self, indices: torch.Tensor, epoch: int):
        images = self.images[indices]
        if self.augment:  # RandomCrop(32, padding=4) and RandomHorizontalFlip(0.5) as one gather
            top, left, flip = augment_draws(self.seed, epoch, indices, self.streams)
            span = torch.arange(32, device=indices.device)
            rows = top[:, None] + span  # (B, 32) rows of the padded image
            cols = left[:, None] + torch.where(flip[:, None].bool(), 31 - span, span)  # flip: columns reversed
            n, c = images.shape[:2]
            images = TF.pad(images, [4])[torch.arange(n, device=indices.device)[:, None, None, None],
                                         torch.arange(c, device=indices.device)[:, None, None],
                                         rows[:, None, :, None], cols[:, None, None, :]]
        return _normalised(images, self.mean, self.std), self.targets[indices]


class DeviceTestLoader:
    """test_dataloader's batches, made on the device: the strided shard rank, rank + W, ... held there,
    unaugmented, in order, the last batch partial."""

    def __init__(self, dataset: Images, per_rank_batch: int, env):
        _check_device_loadable(dataset)
        shard = torch.arange(env.rank, len(dataset), env.world_size)
        self.images, self.targets = dataset.images[shard].to(env.device), dataset.targets[shard].to(env.device)
        self.mean, self.std = _statistics(env.device)
        self.per_rank_batch = per_rank_batch

    def __len__(self) -> int:
        return -(-len(self.targets) // self.per_rank_batch)

    def __iter__(self):
        for k in range(0, len(self.targets), self.per_rank_batch):
            yield (_normalised(self.images[k:k + self.per_rank_batch], self.mean, self.std),
                   self.targets[k:k + self.per_rank_batch])


def _check_device_loadable(dataset) -> None:
    if not isinstance(dataset, Images):
        raise UsageError(f"--loader device needs a data.Images set (uint8 tensors it can hold on the device), "
                         f"not a {type(dataset).__name__}; use --loader dataloader")
