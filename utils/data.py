"""CIFAR-100 and a synthetic stand-in, their augmentation, and the sampler that keeps the data-order contract.

Data order: DistributedSampler deals a seeded permutation of the training set to the ranks in turn
(rank r takes positions r, r+W, r+2W, ...), so global step k trains on permutation[k*B:(k+1)*B] at
every world size W; one process uses the same sampler with W=1 and draws the same permutation.
Augmentation is drawn per sample from (seed, epoch, index) by `augment_draws`, a counter-based
integer hash, not from a process's RNG, so a sample is cropped and flipped the same way whichever rank
or DataLoader worker loads it, on resume, and by either loader (the DataLoader or --loader device's): the
device loader hashes a whole batch of indices on the GPU and gets the same draws as the CPU.
"""
import itertools
import os

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2.functional as TF
from torch.utils.data import Dataset, DistributedSampler

from utils import collectives, flags
from utils.errors import UsageError

NUM_CLASSES = 100
MEAN = (0.5071, 0.4865, 0.4409)  # per-channel statistics of the CIFAR-100 training set
STD = (0.2673, 0.2564, 0.2762)
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"


MASK = 0x7FFF_FFFF  # the hash keeps every value below 2**31: times a constant below 2**31, int64 never overflows


def mix(x):
    """A bijection of 31-bit integers (Python ints or int64 tensors) that scatters nearby inputs."""
    x = ((x ^ (x >> 16)) * 0x5BD1_E995) & MASK
    x = ((x ^ (x >> 15)) * 0x27D4_EB2D) & MASK
    return x ^ (x >> 16)


STREAMS = [k * 0x3C6E_F372 & MASK for k in (1, 2, 3)]  # offsets of the three draws of one sample


def epoch_key(seed: int, epoch: int) -> int:
    """The hash's key for one epoch of one run: every draw of the epoch is mix(key + index), then its stream."""
    return mix((mix(seed & MASK) + (epoch & MASK)) & MASK)


# Hand-written: torchvision's random transforms draw from the process RNG, different in each worker and rank.
def augment_draws(seed: int, epoch: int, index: int) -> tuple[int, int, int]:
    """(top, left, flip) of RandomCrop(32, padding=4) and RandomHorizontalFlip(0.5) for sample `index`: top and
    left in 0..8, flip in {0, 1}. Python ints, 20x faster than tensors for one sample in a DataLoader worker; the
    device loader draws a whole batch with the same exact integer hash on int64 tensors (speed/device_loader.py)."""
    h = mix((epoch_key(seed, epoch) + (index & MASK)) & MASK)
    top, left, flip = (mix((h + s) & MASK) for s in STREAMS)
    return top % 9, left % 9, flip >> 30  # 2**31 % 9 == 2: a bias of 1e-9


class Images(Dataset):
    """uint8 images (N, 3, 32, 32) and labels; yields normalised float tensors, optionally augmented.
    `classes`: the class names, as torchvision's datasets have them (None: inferred from the labels)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, augment: bool, seed: int,
                 classes: list[str] | None = None):
        self.images, self.targets, self.augment, self.seed = images, targets, augment, seed
        if classes is not None:
            self.classes = classes
        # in shared memory: DataLoader workers kept across epochs hold a copy of this object, not a reference
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Call before the epoch's batches are asked for; persistent workers read it from shared memory."""
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.augment:  # torchvision's random transforms would draw from the worker's RNG: see above
            top, left, flip = augment_draws(self.seed, int(self._epoch), int(index))
            image = TF.crop(TF.pad(image, [4]), top, left, 32, 32)  # RandomCrop(32, padding=4)
            if flip:  # RandomHorizontalFlip(0.5)
                image = TF.horizontal_flip(image)
        image = TF.to_dtype(image, torch.float32, scale=True)
        return TF.normalize(image, MEAN, STD), self.targets[index]


def num_classes(dataset: Dataset) -> int:
    """How many classes the model must tell apart: the length of the dataset's `classes` (torchvision's
    datasets and Images name them), else one more than its largest label in `targets`."""
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    if hasattr(dataset, "targets"):
        return int(max(int(t) for t in dataset.targets)) + 1
    raise UsageError(f"cannot tell how many classes the {type(dataset).__name__} training set has: give it "
                     "a `classes` list of class names, as torchvision's datasets have")


def add_flags(parser) -> None:
    """The data flags, read by datasets() and the scripts' DataLoaders. With data of your own, edit them beside your
    datasets(): a flag your data ignores is better deleted (a checkpoint records --dataset, --train-samples and
    --test-samples, and refuses a resume that changes one)."""
    group = parser.add_argument_group("data")
    group.add_argument("--data-dir", default="./data",
                       help="where CIFAR-100 is (cifar-100-python/) or will be downloaded")
    group.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
                       help="cifar100, or a learnable CIFAR-shaped synthetic set that needs no download")
    group.add_argument("--train-samples", type=flags.positive_int, default=None, metavar="N",
                       help="use the first N training images")
    group.add_argument("--test-samples", type=flags.positive_int, default=None, metavar="N",
                       help="use the first N test images")
    group.add_argument("--no-augment", action="store_true", help="turn off random crop and horizontal flip")
    group.add_argument("--workers", type=flags.non_negative_int, default=4, help="DataLoader worker processes per rank")


def datasets(args, env) -> tuple[Dataset, Dataset]:
    """Every rank (collective, for CIFAR-100: an all-reduce agrees it is on disk everywhere): the training and
    test sets of --dataset, CIFAR-100 (downloaded by each machine's local rank 0 if absent, the other ranks
    waiting) or the synthetic set, cut to --train-samples / --test-samples.
    For your own data, replace this function: return any two map-style Datasets of (image tensor, class
    index) pairs (docs/template.md)."""
    prepare(args, env)
    return load(args, train=True), load(args, train=False)


def prepare(args, env) -> None:
    """Every rank (collective: an all-reduce of whether it worked): CIFAR-100 on disk, downloaded by local
    rank 0 if absent while the others wait for it."""
    if args.dataset != "cifar100":
        return
    error = None
    if env is None or env.local_rank == 0:
        try:
            ensure_cifar100(args.data_dir)
        except UsageError as e:
            error = e
    if env is not None and not collectives.all_ok(error is None, env.device):
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
    classes = [f"pattern {c}" for c in range(NUM_CLASSES)] if args.dataset == "synthetic" else raw.classes
    return Images(images, targets, augment=train and not args.no_augment, seed=args.seed, classes=classes)


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


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler that can also start an epoch part-way: set_epoch(epoch, skip=n) leaves out this
    rank's first n samples of that epoch, the batches a mid-epoch checkpoint already trained (DistributedSampler
    itself always starts at the epoch's beginning). set_epoch also tells the dataset the epoch, where it has a
    set_epoch of its own (Images: the augmentation's draws depend on it). And a forgotten set_epoch is an error,
    not a silent repeat of the first epoch's order: each set_epoch allows one pass over the samples."""

    skip = 0
    _passed = False  # this epoch's samples were iterated already: the next pass needs a set_epoch first

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip, self._passed = skip, False
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        if self._passed:  # DistributedSampler would deal the same order again, every epoch
            raise RuntimeError(f"the sampler's epoch {self.epoch} was iterated already: call "
                               "sampler.set_epoch(epoch) before each epoch's batches")
        self._passed = True
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip, 0)
