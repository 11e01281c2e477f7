"""CIFAR-100 and a synthetic stand-in, augmentation, and the loaders that keep the data-order contract.

Data order: DistributedSampler deals a seeded permutation of the training set to the ranks in turn
(rank r takes positions r, r+W, r+2W, ...), so global step k trains on permutation[k*B:(k+1)*B] at
every world size W; one process uses the same sampler with W=1 and draws the same permutation.
Augmentation is drawn per sample from (seed, epoch, index), not from a process's RNG, so a sample
is cropped and flipped the same way whichever rank or DataLoader worker loads it, and on resume.
"""
import os

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2.functional as TF
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from utils import dist
from utils.errors import UsageError

NUM_CLASSES = 100
MEAN = (0.5071, 0.4865, 0.4409)  # per-channel statistics of the CIFAR-100 training set
STD = (0.2673, 0.2564, 0.2762)
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"


class Images(Dataset):
    """uint8 images (N, 3, 32, 32) and labels; yields normalised float tensors, optionally augmented."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, augment: bool, seed: int):
        self.images, self.targets, self.augment, self.seed = images, targets, augment, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # DataLoader workers are made anew each epoch and copy this value

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.augment:  # torchvision's random transforms would draw from the worker's RNG: see above
            g = torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) & 0x7FFF_FFFF_FFFF_FFFF)
            top, left = torch.randint(0, 9, (2,), generator=g).tolist()
            image = TF.crop(TF.pad(image, [4]), top, left, 32, 32)  # RandomCrop(32, padding=4)
            if torch.randint(0, 2, (1,), generator=g).item():  # RandomHorizontalFlip(0.5)
                image = TF.horizontal_flip(image)
        image = TF.to_dtype(image, torch.float32, scale=True)
        return TF.normalize(image, MEAN, STD), self.targets[index]


def prepare(args, env) -> None:
    """Make sure CIFAR-100 is on disk: local rank 0 downloads it if absent, the others wait for it."""
    if args.dataset != "cifar100":
        return
    error = None
    if env is None or env.local_rank == 0:
        try:
            ensure_cifar100(args.data_dir)
        except UsageError as e:
            error = e
    if env is not None and not dist.all_ok(error is None, env.device):
        raise error or UsageError("CIFAR-100 is missing on another machine of this job (see its error)")
    if error:
        raise error


def ensure_cifar100(data_dir: str) -> None:
    cifar = torchvision.datasets.CIFAR100
    folder = os.path.join(data_dir, cifar.base_folder)
    if os.path.isdir(folder):
        return  # torchvision checks the files' md5 when it loads them
    try:
        cifar(data_dir, download=True)
    except Exception as e:  # no network, a proxy, a full disk: the user's next step is the same
        reason = str(getattr(e, "reason", e)).splitlines()[0]
        raise UsageError(
            f"CIFAR-100 not found in {os.path.abspath(folder)} and the download failed ({reason}); "
            f"fetch {CIFAR_URL} and unpack it into {os.path.abspath(data_dir)}, "
            "or train on --dataset synthetic") from None


def load(args, train: bool) -> Images:
    """The training or test set of --dataset, cut to --train-samples / --test-samples."""
    limit = args.train_samples if train else args.test_samples
    if args.dataset == "synthetic":
        images, targets = synthetic(limit or (50_000 if train else 10_000), train)
    else:
        try:
            raw = torchvision.datasets.CIFAR100(args.data_dir, train=train, download=False)
        except RuntimeError as e:
            raise UsageError(f"cannot read CIFAR-100 in {os.path.abspath(args.data_dir)} ({e}); "
                             "delete the folder to download it again") from None
        images = torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous()[:limit]
        targets = torch.tensor(raw.targets)[:limit]
    return Images(images, targets, augment=train and not args.no_augment, seed=args.seed)


def synthetic(n: int, train: bool, chunk: int = 1000):
    """A learnable CIFAR-shaped set: each class is a smooth colour pattern of its own, under noise.

    The same for every seed and world size; sample i does not depend on n (made in chunks of fixed
    seeds), so --train-samples N takes a prefix. Train and test share the patterns, not the noise."""
    patterns = torch.rand(NUM_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(1234)) * 255
    patterns = F.interpolate(patterns, size=32, mode="bilinear", align_corners=False)
    images, targets = [], []
    for start in range(0, n, chunk):  # whole chunks only, so a chunk's draws never depend on n
        g = torch.Generator().manual_seed(2 * (start // chunk) + int(train))
        labels = torch.randint(0, NUM_CLASSES, (chunk,), generator=g)
        noise = torch.randn(chunk, 3, 32, 32, generator=g) * 48
        images.append((patterns[labels] + noise).clamp(0, 255).to(torch.uint8))
        targets.append(labels)
    return torch.cat(images)[:n], torch.cat(targets)[:n]


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch after the batches a snapshot already trained."""

    skip = 0  # samples of this rank to leave out at the start of the epoch

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return super().__len__() - self.skip


class TrainLoader:
    """This rank's batches of an epoch; global step k is permutation[k*B:(k+1)*B] at any world size."""

    def __init__(self, dataset: Images, per_rank_batch: int, rank: int, world_size: int, args, pin: bool):
        self.dataset, self.per_rank_batch = dataset, per_rank_batch
        # drop_last: every global batch is whole, so the step count is len // B at every world size
        self.sampler = ResumableSampler(dataset, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(dataset, per_rank_batch, sampler=self.sampler, num_workers=args.workers,
                                 pin_memory=pin, drop_last=True)
        self.steps = len(self.sampler) // per_rank_batch
        if self.steps == 0:
            raise UsageError(f"{len(dataset)} training images make no whole batch of --batch-size "
                             f"{per_rank_batch * world_size}")

    def epoch(self, epoch: int, start_step: int = 0):
        self.dataset.set_epoch(epoch)
        self.sampler.set_epoch(epoch)
        self.sampler.skip = start_step * self.per_rank_batch
        return self.loader


def test_loader(dataset: Images, per_rank_batch: int, rank: int, world_size: int, args, pin: bool):
    """This rank's share of the test set, with no padding: DistributedSampler would repeat samples
    to even the shards, and the repeats would be counted in the accuracy. Shards may differ by one."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    return DataLoader(shard, per_rank_batch, shuffle=False, num_workers=args.workers, pin_memory=pin)
