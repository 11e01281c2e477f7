"""What the scripts' train() builds inline, built the same way for the tests that call its parts directly: the
loaders (distributed.py's DataLoaders, distributed_apex.py's --loader device) and SGD with its cosine schedule.
Keep each as the scripts write it."""
import sys

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.data import DataLoader

from speed import device_loader, techniques

CPU = torch.device("cpu")


def loading(workers: int, device: torch.device = CPU) -> dict:
    """The DataLoader options of the scripts' `loading`: forked workers kept for the whole run, pinned on a GPU."""
    return dict(num_workers=workers, persistent_workers=workers > 0, pin_memory=device.type == "cuda",
                multiprocessing_context="fork" if workers and sys.platform == "linux" else None)


def train_loader(dataset, sampler, batch: int, workers: int = 0, device: torch.device = CPU,
                 loader: str = "dataloader"):
    """This rank's training batches in the order of `sampler` (a data.ResumableDistributedSampler), as
    distributed_apex.py makes them: DataLoader workers, or with loader="device" the set held on `device`."""
    if loader == "device":
        return device_loader.DeviceLoader(dataset, batch, sampler, device, drop_last=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True, **loading(workers, device))


def evaluation_loader(dataset, batch: int, rank: int, world_size: int, workers: int = 0, device: torch.device = CPU,
                loader: str = "dataloader"):
    """This rank's share of the test set, images rank, rank + W, ..., as distributed_apex.py makes it."""
    shard = DataLoader(dataset, batch_size=batch, sampler=range(rank, len(dataset), world_size),
                       **loading(workers, device))
    if loader == "device":
        return device_loader.DeviceLoader(dataset, batch, shard.sampler, device)
    return shard


def sgd_with_cosine(model, args, cuda_graphs: bool = False):
    """The scripts' optimizer and schedule: SGD with momentum and weight decay (--optimizer-impl's kernel), the
    rate on a cosine from --lr to 0 after --warmup-epochs rising linearly from --lr/100."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay,
                                **techniques.sgd_kernel(args.optimizer_impl, cuda_graphs=cuda_graphs))
    scheduler = CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)
    if args.warmup_epochs:
        warmup = LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])
    return optimizer, scheduler
