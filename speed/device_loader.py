"""--loader device: the data set held on the training device and each batch made there in a few kernels, with
no DataLoader workers (the fast GPU path of distributed_apex.py: docs/speed.md). DeviceLoader is iterated like
the DataLoader it stands in for, and gives its batches bit for bit."""
import torch
import torchvision.transforms.v2.functional as TF

from utils import data
from utils.data import MEAN, STD, Images
from utils.errors import UsageError


def augment_draws(seed: int, epoch: int, indices: torch.Tensor, streams: torch.Tensor):
    """data.augment_draws for a batch of sample indices on their device: the same integer hash in int64 tensor
    arithmetic, so the same (top, left, flip) as a DataLoader worker's. `streams`: data.STREAMS on that device."""
    h = data.mix((data.epoch_key(seed, epoch) + (indices.long() & data.MASK)) & data.MASK)
    top, left, flip = data.mix((h[..., None] + streams) & data.MASK).unbind(-1)  # three separate hash outputs
    return top % 9, left % 9, flip >> 30


class DeviceLoader:
    """DataLoader(dataset, batch_size, sampler=sampler, drop_last=drop_last)'s batches, made on `device`: the
    dataset's images are held there as uint8, and each batch is gathered, cropped, flipped (when the
    dataset augments, at the epoch of its set_epoch) and normalised there, with no worker processes. Bit for bit
    the DataLoader's batches: the same sampler, draws and elementwise float functions. The sampler is iterated
    on the host once per epoch, as a DataLoader does; a sampler with a `skip` (data.ResumableDistributedSampler)
    starts the epoch part-way, as it does for the DataLoader."""

    def __init__(self, dataset: Images, batch_size: int, sampler, device: torch.device, drop_last: bool = False):
        if not isinstance(dataset, Images):
            raise UsageError(f"--loader device needs a data.Images set (uint8 tensors it can hold on the device), "
                             f"not a {type(dataset).__name__}; use --loader dataloader")
        self.dataset, self.batch_size, self.sampler, self.drop_last = dataset, batch_size, sampler, drop_last
        self.images, self.targets = dataset.images.to(device), dataset.targets.to(device)
        # made once, not per batch: made from a list at each batch, each is a blocking copy from host memory
        self.mean, self.std = (torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1) for v in (MEAN, STD))
        self.streams = torch.tensor(data.STREAMS, device=device)  # the offsets of augment_draws's three draws

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        if self.images.is_cuda:  # from pinned memory the copy is queued, not waited for (the host runs ahead)
            order = order.pin_memory()
        order = order.to(self.images.device, non_blocking=True)
        epoch = self.dataset.epoch  # the augmentation's, as the DataLoader's workers read it
        for k in range(0, len(self) * self.batch_size, self.batch_size):
            yield self.batch(order[k:k + self.batch_size], epoch)

    def batch(self, indices: torch.Tensor, epoch: int):
        images = self.images[indices]
        if self.dataset.augment:  # RandomCrop(32, padding=4) and RandomHorizontalFlip(0.5) as one gather
            top, left, flip = augment_draws(self.dataset.seed, epoch, indices, self.streams)
            span = torch.arange(32, device=indices.device)
            rows = top[:, None] + span  # (B, 32) rows of the padded image
            cols = left[:, None] + torch.where(flip[:, None].bool(), 31 - span, span)  # flip: columns reversed
            n, c = images.shape[:2]
            images = TF.pad(images, [4])[torch.arange(n, device=indices.device)[:, None, None, None],
                                         torch.arange(c, device=indices.device)[:, None, None],
                                         rows[:, None, :, None], cols[:, None, None, :]]
        # Images.__getitem__'s functions in its order, with TF.normalize's arithmetic (subtract, then divide)
        return TF.to_dtype(images, torch.float32, scale=True).sub(self.mean).div_(self.std), self.targets[indices]
