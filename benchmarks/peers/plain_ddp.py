"""A plain tutorial DDP loop on the benchmark's workload: the yardstick that distributed.py must at least match.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.peers.plain_ddp --device cpu --batch-size 16 --steps 4

Written in the shape of the DDP tutorial series of pytorch/examples (multigpu_torchrun.py): torchrun's
environment, init_process_group, DDP, a DistributedSampler told the epoch, a DataLoader whose workers
apply torchvision's transforms to one image at a time and are kept across epochs, and SGD. Nothing else:
no checkpoints, no stop signals, no evaluation. The model is ResNet-18 for 32x32 images
(utils.models.resnet18_cifar) with SyncBatchNorm on GPUs; on the CPU plain per-rank BatchNorm, since
torch's SyncBatchNorm refuses CPU tensors. The data is the synthetic CIFAR-shaped set (utils.data.synthetic).
`--precision bfloat16` runs the forward pass under torch.autocast in bfloat16, the tutorials' mixed precision.
`--tuned` is the same loop as a careful user tunes it, with the three changes any speed guide names first:
torch.compile of the DDP model, channels-last weights and inputs, and SGD's fused kernel (each also a flag of its
own). `--seed` and `--no-augment` make a run comparable step by step with the collection's scripts (the same
weights from the same seed, the same order, the same images: tests/test_peers.py).
Rank 0 prints one JSON line per epoch: the images/s of all processes together, the epoch's seconds
(from asking for its first batch to its last optimizer step), rank 0's mean loss and the dtype its
model's outputs had (what benchmarks.run checks the precision by).
"""
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.transforms import v2

from utils import flags
from utils.data import MEAN, STD, synthetic
from utils.models import resnet18_cifar


class AugmentedImages(Dataset):
    """n synthetic uint8 images, each cropped, flipped and normalised by torchvision's transforms when asked for
    (augment=False: only normalised)."""

    def __init__(self, n: int, augment: bool = True):
        self.images, self.targets = synthetic(n, train=True)
        crop_and_flip = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if augment else []
        self.transform = v2.Compose([*crop_and_flip, v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), self.targets[index]


def parse_args(argv=None, prog: str = "benchmarks.peers.plain_ddp", doc: str = __doc__):
    """The workload's flags, which lightning_ddp.py shares; either program must be started by torchrun."""
    parser = flags.Parser(prog=prog, description=doc.splitlines()[0], formatter_class=flags.HelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: one GPU per process (NCCL); cpu: gloo (default: cuda when a GPU is visible)")
    parser.add_argument("--batch-size", type=flags.positive_int, default=32, help="images per process per step")
    parser.add_argument("--steps", type=flags.positive_int, default=10,
                        help="steps per epoch: the set holds steps x batch size x processes images")
    parser.add_argument("--epochs", type=flags.positive_int, default=3, help="epochs to train")
    parser.add_argument("--workers", type=flags.non_negative_int, default=4, help="DataLoader workers per process")
    parser.add_argument("--lr", type=flags.non_negative_float, default=0.1, help="SGD learning rate")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: the forward pass under torch.autocast in bfloat16 (Lightning: bf16-mixed)")
    if prog == "benchmarks.peers.plain_ddp":  # the tuning a careful user adds, and what compares it with ours
        parser.add_argument("--seed", type=int, default=None, help="seed of the weights (default: unseeded)")
        parser.add_argument("--no-augment", action="store_true", help="no random crop and flip: normalised images")
        parser.add_argument("--tuned", action="store_true",
                            help="all three below: what a careful user adds to the plain loop")
        parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
        parser.add_argument("--channels-last", action="store_true", help="channels-last weights and inputs")
        parser.add_argument("--fused-sgd", action="store_true", help="SGD's fused kernel (fused=True)")
    args = parser.parse_args(argv)
    if getattr(args, "tuned", False):
        args.compile = args.channels_last = args.fused_sgd = True
    if "LOCAL_RANK" not in os.environ:
        parser.error("start it with torchrun, which tells each process its rank")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    return args


def train_epoch(model, loader, optimizer, criterion, device, amp_dtype=None,
                memory_format=torch.contiguous_format) -> tuple[float, float, str]:
    """One pass over this rank's share of the set, the forward under autocast in amp_dtype unless None:
    (seconds, mean loss, the dtype of the model's outputs)."""
    model.train()
    start, loss_sum = time.perf_counter(), torch.zeros((), device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            outputs = model(images)
            loss = criterion(outputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients while backward runs
        optimizer.step()
        loss_sum += loss.detach()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, loss_sum.item() / len(loader), str(outputs.dtype).removeprefix("torch.")


def main(argv=None):
    args = parse_args(argv)
    local_rank, cuda = int(os.environ["LOCAL_RANK"]), args.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's environment says where the ranks meet
    world_size = dist.get_world_size()
    dataset = AugmentedImages(args.steps * args.batch_size * world_size, augment=not args.no_augment)
    sampler = DistributedSampler(dataset)  # a shuffled share of the set for each rank
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0, pin_memory=cuda)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = resnet18_cifar()
    if cuda:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device, memory_format=memory_format), device_ids=[local_rank] if cuda else None)
    if args.compile:
        model.compile()
    fused = {"fused": True} if args.fused_sgd else {}
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, **fused)
    criterion = nn.CrossEntropyLoss()
    amp_dtype = torch.bfloat16 if args.precision == "bfloat16" else None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # else every epoch repeats the first one's order
        seconds, loss, outputs = train_epoch(model, loader, optimizer, criterion, device, amp_dtype, memory_format)
        if dist.get_rank() == 0:
            print(json.dumps({"epoch": epoch + 1, "images_per_s": len(dataset) / seconds, "epoch_time_s": seconds,
                              "train_loss": loss, "world_size": world_size, "outputs": outputs}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
