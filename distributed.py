"""DistributedDataParallel started by torchrun: one process per GPU (or CPU process), ResNet-18 on CIFAR-100.

    torchrun --standalone --nproc_per_node=4 distributed.py                  # 4 GPUs of this machine
    torchrun --standalone --nproc_per_node=2 distributed.py --device cpu     # 2 CPU processes, gloo
    python -m torch.distributed.launch --nproc_per_node=2 distributed.py     # the deprecated launcher
    python distributed.py                                                    # a world of one process
"""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from utils import data, flags, launch, metrics, models, stopping, techniques
from utils.checkpoint import Checkpoint
from utils.errors import exit_on_error
from utils.progress import EpochProgress
from utils.syncbn import CpuSyncBatchNorm


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    flags.add_shared_flags(parser)
    return flags.parse(parser, argv)


def train_one_epoch(model, criterion, optimizer, progress, env, stop, checkpoint):
    """From progress.step to the epoch's end, or to the step at which every rank knows of a stop signal."""
    model.train()
    for images, targets in progress:
        images = images.to(env.device, non_blocking=True)
        targets = targets.to(env.device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over all ranks, bucket by bucket, during backward
        optimizer.step()
        progress.record(loss)  # summed on the device; every --print-freq steps printed and checked finite
        if stop.agreed():  # a stop signal reached some rank: every rank leaves at this same step
            return
        if checkpoint.due(progress.step, progress.total):  # --save-every-steps
            checkpoint.save(epoch=progress.epoch, step=progress.step, epoch_loss=progress.loss_so_far())


def train(args, env, stop) -> int:
    batch = flags.per_rank_batch(args.batch_size, env.world_size)
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle of the training set, dealt to the ranks in turn: rank r takes r, r+W, ...
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed, drop_last=True)
    train_loader = data.train_loader(train_set, sampler, per_rank_batch=batch, env=env, args=args)
    test_loader = data.test_loader(test_set, per_rank_batch=batch, env=env, args=args)

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=techniques.memory_format(args))
    if not args.no_sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
        sync_bn = nn.SyncBatchNorm if env.device.type == "cuda" else CpuSyncBatchNorm  # torch's is GPU-only
        model = sync_bn.convert_sync_batchnorm(model)
    # DDP broadcasts rank 0's weights at start, then all-reduces gradients during backward.
    model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                **techniques.ddp_options(args))
    techniques.register_comm_hook(model, args.comm_hook, train_loader.steps)  # float32 all-reduce, or compressed
    techniques.compile_if_asked(model, args)
    criterion = nn.CrossEntropyLoss()
    optimizer, scheduler = models.sgd_with_cosine(model, args)
    checkpoint = Checkpoint(args, env, __file__, model=model, optimizer=optimizer, scheduler=scheduler)

    if args.evaluate:
        checkpoint.load_weights()
        results = metrics.evaluate(model.module, test_loader, env.device)
        metrics.write_eval(args.output_dir, results, env.is_main)
        stop.finish()
        return 0
    start_epoch, start_step = checkpoint.resume()
    log = metrics.MetricsLog(args, is_main=env.is_main, done_epochs=start_epoch, done_steps=start_step,
                             steps_per_epoch=train_loader.steps)  # metrics.jsonl, and TensorBoard's events
    if start_epoch == args.epochs and env.is_main:
        print(f"nothing left to train: the checkpoint has all {args.epochs} epochs (--evaluate tests it)")
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank (else every epoch repeats)
        progress = EpochProgress(train_loader.epoch(epoch, start_step), steps=train_loader.steps, epoch=epoch,
                                 start_step=start_step, epoch_loss=checkpoint.epoch_loss, env=env, args=args, log=log)
        train_one_epoch(model, criterion, optimizer, progress, env, stop, checkpoint)
        # the unwrapped module (see metrics.evaluate); None if a stop signal comes during it
        results = None if stop.agreed() else metrics.evaluate(model.module, test_loader, env.device, stop=stop)
        if results is None:  # stopped by a signal: a checkpoint of the step every rank reached, then exit
            checkpoint.save(epoch=epoch, step=progress.step, epoch_loss=progress.loss_so_far())
            return stop.finish_stopped_run(epoch=epoch, step=progress.step, steps=progress.total,
                                           path=checkpoint.path, is_main=env.is_main)
        log.write({"epoch": epoch + 1, "lr": scheduler.get_last_lr()[0], **progress.summary(), **results,
                   "world_size": env.world_size})
        scheduler.step()
        checkpoint.save(epoch=epoch + 1)
        start_step = 0
    stop.finish()
    return 0


def main(argv=None):
    args = parse_args(argv)
    stop = stopping.StopSignals(watch_launcher=launch.has_torchrun_agent())  # SIGTERM, Ctrl-C, SIGUSR1
    with exit_on_error():
        flags.check_before_start(args)
        env = launch.this_process(args)  # rank, world size, device and meeting point, from torchrun's environment
        # join the process group: every rank waits here until all env.world_size processes have joined
        dist.init_process_group(env.backend, store=env.store, rank=env.rank, world_size=env.world_size,
                                timeout=env.timeout)
        stop.arm(env.world_size)
        try:
            status = train(args, env, stop)
        finally:
            dist.destroy_process_group()  # frees the backend's threads and sockets before the process ends
    sys.exit(status)


if __name__ == "__main__":
    main()
