"""Fully sharded data parallel (FSDP2's fully_shard) by torchrun, ResNet-18 on CIFAR-100: each of the N ranks holds
1/N of the weights, gradients and optimizer state, and trains distributed.py's weights (docs/sharding.md).

    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py                # 4 GPUs, bfloat16 where supported
    torchrun --standalone --nproc_per_node=2 distributed_fsdp.py --device cpu   # 2 CPU processes, gloo
    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py --no-reshard-after-forward  # ZeRO-2-like
    torchrun --nnodes=2 --nproc_per_node=8 ... distributed_fsdp.py --replicas 2  # HSDP: shard in each machine
"""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

from safety_net import SafetyNet
from safety_net.sharded_checkpoint import ShardedCheckpoint
from speed import techniques
from utils import data, flags, launch, metrics, models, precision, sharding
from utils.errors import UsageError
from utils.syncbn import CpuSyncBatchNorm


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    sharding.add_flags(parser)  # --units, --reshard-after-forward, --replicas: the layout of shard() below
    precision.add_flags(parser, float16=False)  # --opt-level, --amp-dtype: the mixed precision policy below
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser)  # --device, --backend, --dist-timeout, --no-sync-bn
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    SafetyNet.add_flags(parser, sharded=True)  # --output-dir, checkpoints (directories of shards), --evaluate
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


def train_one_epoch(model, criterion, optimizer, loader, device, safety, autocast_dtype, max_norm=None):
    """One pass over this rank's batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):  # --units model
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters the gradients, stage by stage: each rank gets the average of its shard
        # --clip-grad-norm: over DTensor gradients clip_grad_norm_ sums the shards' squares: the whole model's norm
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None
        optimizer.step()  # each rank updates its shard of the weights, with its shard of the momentum
        if safety.step_done(loss, grad_norm):  # every rank, each step: progress, checkpoints; True: all ranks stop
            return


def shard(model: nn.Module, amp_dtype: torch.dtype | None, reshard: bool, units: str = "stages", mesh=None):
    """The model with 1/world_size of each parameter on each rank, as DTensors (every rank built the same
    weights from the same seed; fully_shard keeps its share of dim 0); with HSDP's 2-D `mesh`, 1/(world/R)."""
    if units == "model":  # one unit: all weights gathered once a step, in float32 (the step's autocast casts them)
        return fully_shard(model, mesh=mesh)
    # Mixed precision the FSDP way: forward and backward run on amp_dtype copies of the weights (gathered in
    # amp_dtype, half the bytes of float32); gradients are reduced in float32 into the float32 shards that
    # the optimizer updates. No autocast: each sharded module's inputs are cast, the logits cast back.
    policy = dict(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None)
    if amp_dtype:  # BatchNorm stays float32, as under autocast (its statistics are float32): all of it one unit
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        fully_shard(norms, mesh=mesh, reshard_after_forward=False)  # float32 policy; 38 KB, one all-gather a step
    # each residual stage one unit: gathered for its forward, freed after it (reshard_after_forward) and
    # gathered again for its backward, its gradients then reduce-scattered
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy), reshard_after_forward=reshard)
    # the root unit holds the rest (stem, fc), and gives the logits back in float32 for the loss
    root = MixedPrecisionPolicy(**policy, output_dtype=torch.float32 if amp_dtype else None)
    return fully_shard(model, mesh=mesh, mp_policy=root, reshard_after_forward=reshard)


def train(args, env, safety):
    # None: float32; no float16, which would need loss scaling across the shards
    amp_dtype = precision.autocast_dtype(args, env.device, env.is_main, safety.recorded_precision(), float16=False)
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
    test_batches = sharding.PaddedShard(test_loader, env.device)  # every rank forwards as many (each all-gathers)
    if len(train_loader) == 0:  # drop_last: a training set smaller than one global batch gives no step at all
        raise UsageError(f"{len(train_set)} training images make no whole batch of --batch-size {args.batch_size}")

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if not args.no_sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
        sync_bn = nn.SyncBatchNorm if env.device.type == "cuda" else CpuSyncBatchNorm  # torch's is GPU-only
        model = sync_bn.convert_sync_batchnorm(model)
    mesh = sharding.hsdp_mesh(env, args.replicas)  # --replicas R: HSDP's R groups that each shard; 1: None
    model = shard(model, amp_dtype, args.reshard_after_forward, args.units, mesh)
    autocast_dtype = amp_dtype if args.units == "model" else None  # else shard()'s policy casts, no autocast
    if args.compile:  # fused kernels (the first steps pay for compilation); the state_dict keys stay the same
        model.compile()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(  # over the shards: each rank steps its own; --optimizer-impl: the kernel
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        **techniques.sgd_kernel(args.optimizer_impl))
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)  # --lr to 0, by epoch
    if args.warmup_epochs:  # first a linear rise from --lr/100 (large global batches need it)
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = lr_scheduler.SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])

    # every rank: continue from <output-dir>'s checkpoint if there is one (each rank reads its own shards)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=len(train_loader), precision=amp_dtype)
    if args.evaluate:  # the checkpoint's weights (all that resume read) on the test set, into eval.json
        safety.write_eval(metrics.evaluate(model, test_batches, env.device, autocast_dtype))
        return
    for epoch in range(start_epoch, args.epochs):
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what a checkpoint trained
        sampler.set_epoch(epoch, skip=start_step * batch)
        train_one_epoch(model, criterion, optimizer, train_loader, env.device, safety, autocast_dtype,
                        args.clip_grad_norm)
        if args.no_sync_bn:  # FSDP shards parameters, not buffers: rank 0's BatchNorm statistics for all, as DDP has
            sharding.broadcast_buffers_from_rank_0(model)
        results = metrics.evaluate(model, test_batches, env.device, autocast_dtype)  # ranks forward in step: no stop
        if safety.end_epoch(results, lr=scheduler.get_last_lr()[0]):  # metrics.jsonl's line; True: stopped, saved
            return
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>


def main(argv=None):
    args = parse_args(argv)
    # from here on Ctrl-C or SIGTERM: every rank stops with a checkpoint; an error: one line (bad input: exit
    # status 2; a crash: 1, its traceback in a file); first: no other run in <output-dir>, its checkpoint usable
    with SafetyNet.for_flags(args, __file__, sharded_checkpoint=ShardedCheckpoint) as safety:  # each rank its shards
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
