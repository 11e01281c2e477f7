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
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

from safety_net import SafetyNet
from speed import techniques
from utils import data, flags, launch, metrics, models
from utils.errors import UsageError
from utils.syncbn import CpuSyncBatchNorm


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser)  # --device, --backend, --dist-timeout, --no-sync-bn
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    techniques.add_ddp_flags(parser)  # --bucket-cap-mb, --gradient-as-bucket-view, --static-graph, --comm-hook
    SafetyNet.add_flags(parser)  # --output-dir, checkpoints, --evaluate, --print-freq
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


def train_one_epoch(model, criterion, optimizer, loader, device, safety, max_norm=None):
    """One pass over this rank's batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over all ranks, bucket by bucket, during backward
        # --clip-grad-norm: after the average, so its norm (returned: before clipping) is the same on every rank
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None
        optimizer.step()
        if safety.step_done(loss, grad_norm):  # every rank, each step: progress, checkpoints; True: all ranks stop
            return


def train(args, env, safety):
    batch = flags.per_rank_batch(args.batch_size, env.world_size)  # the global batch split evenly over the ranks
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle dealt to the ranks in turn (rank r: r, r+W, ...); DistributedSampler + set_epoch(skip)
    sampler = data.ResumableDistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed,
                                               drop_last=True)  # drop_last: equal shares, no sample repeated
    # workers forked, not spawned (10-30 s each), kept for the whole run; pinned batches: copied without a host wait
    loading = dict(num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=env.device.type == "cuda",
                   multiprocessing_context="fork" if args.workers and sys.platform == "linux" else None)
    train_loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True, **loading)
    # this rank's share of the test set, images r, r+W, ...: not padded as DistributedSampler's, so each counts once
    test_loader = DataLoader(test_set, batch_size=batch, sampler=range(env.rank, len(test_set), env.world_size),
                             **loading)
    if len(train_loader) == 0:  # drop_last: a training set smaller than one global batch gives no step at all
        raise UsageError(f"{len(train_set)} training images make no whole batch of --batch-size {args.batch_size}")

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if not args.no_sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
        sync_bn = nn.SyncBatchNorm if env.device.type == "cuda" else CpuSyncBatchNorm  # torch's is GPU-only
        model = sync_bn.convert_sync_batchnorm(model)
    # DDP broadcasts rank 0's weights at start, then all-reduces gradients during backward, bucket by bucket
    model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view,
                static_graph=args.static_graph)  # DDP's own speed settings, each a flag (docs/speed.md)
    techniques.register_comm_hook(model, args.comm_hook, len(train_loader))  # --comm-hook: compressed gradients
    if args.compile:  # fused kernels (the first steps pay for compilation); the state_dict keys stay the same
        model.compile()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(  # --optimizer-impl: torch's for-loop, foreach or fused kernel
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        **techniques.sgd_kernel(args.optimizer_impl))
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)  # --lr to 0, by epoch
    if args.warmup_epochs:  # first a linear rise from --lr/100 (large global batches need it)
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = lr_scheduler.SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])

    # every rank: continue from <output-dir>'s checkpoint if there is one (model, optimizer, schedule, step)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=len(train_loader))
    if args.evaluate:  # the checkpoint's weights (all that resume read) on the test set, into eval.json
        safety.write_eval(metrics.evaluate(model.module, test_loader, env.device))
        return
    for epoch in range(start_epoch, args.epochs):
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what a checkpoint trained
        sampler.set_epoch(epoch, skip=start_step * batch)
        train_one_epoch(model, criterion, optimizer, train_loader, env.device, safety, args.clip_grad_norm)
        # the unwrapped module: DDP's forward would wait at a batch a shorter shard lacks; a stop signal cuts it short
        results = metrics.evaluate(model.module, test_loader, env.device, stop=safety.stop_received_here)
        if safety.end_epoch(results, lr=scheduler.get_last_lr()[0]):  # metrics.jsonl's line; True: stopped, saved
            return
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>


def main(argv=None):
    args = parse_args(argv)
    # from here on Ctrl-C or SIGTERM: every rank stops with a checkpoint; an error: one line (bad input: exit
    # status 2; a crash: 1, its traceback in a file); first: no other run in <output-dir>, its checkpoint usable
    with SafetyNet.for_flags(args, __file__) as safety:
        env = launch.read_and_fill_environment(args)  # RANK, WORLD_SIZE read; MASTER_ADDR/PORT set where unset
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)  # this process's GPU: NCCL and every .cuda() without an index use it
        # join the process group at MASTER_ADDR:MASTER_PORT: every rank waits here until all have joined (store:
        # None, but in a rank torchrun restarted, a prefix per restart: not the addresses the dead ranks left there)
        dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, timeout=env.timeout,
                                store=launch.torchrun_restart_store(env.timeout))
        try:
            with safety.running(env):  # every rank: the stop agreement's own gloo group; a barrier at the end
                train(args, env, safety)
        finally:
            dist.destroy_process_group()  # frees the backend's threads and sockets before the process ends


if __name__ == "__main__":
    main()
