"""Pipeline parallelism started by torchrun: ResNet-18's layers split over the ranks, one stage each, every batch cut
into micro-batches that flow through the stages (torch.distributed.pipelining), ResNet-18 on CIFAR-100.

    torchrun --standalone --nproc_per_node=4 distributed_pipeline.py                  # 4 stages on 4 GPUs
    torchrun --standalone --nproc_per_node=2 distributed_pipeline.py --device cpu     # 2 stages, 2 CPU processes
    torchrun --standalone --nproc_per_node=4 distributed_pipeline.py --microbatches 8 --schedule gpipe
    torchrun --standalone --nproc_per_node=4 distributed_pipeline.py --replicas 2   # 2 replicas of a 2-stage pipeline

Each rank holds its stage's weights, gradients and optimizer state (dealt for equal compute, not equal memory: layer4,
on the last stage, holds 75% of the weights), sends activations forward and their gradients back to its neighbours,
and waits while the pipeline fills and drains (the bubble): docs/sharding.md, docs/timelines.md.
"""
import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

from safety_net import SafetyNet
from safety_net.sharded_checkpoint import PipelineCheckpoint
from speed import techniques
from utils import data, flags, launch, models, pipelining
from utils.errors import UsageError


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    pipelining.add_flags(parser)  # --schedule, --microbatches, --replicas
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser, sync_bn=False)  # --device, --backend, --dist-timeout (BatchNorm: per micro-batch)
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    SafetyNet.add_flags(parser, sharded=True)  # --output-dir, checkpoints (directories: each stage its part)
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


def train_one_epoch(stage, schedule, optimizer, loader, device, safety, max_norm, grid):
    """One pass over the batches, the same on every stage: the schedule runs each micro-batch's forward and backward
    through all stages (activations and their gradients sent between ranks), then each rank steps its own layers."""
    stage.submod.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        losses = []  # filled on the last stage: each micro-batch's loss
        # the gradients are the mean over the micro-batches (the schedule divides each by their number), as one
        # batch's would be; only the last stage compares with the targets (the schedule splits them on every stage)
        if stage.is_first:  # the first stage feeds the images in
            schedule.step(images, target=targets, losses=losses)
        else:  # the others take their inputs from the stage before
            schedule.step(target=targets, losses=losses)
        pipelining.average_over_replicas(stage.submod, grid.replicas)  # --replicas: each stage's gradients averaged
        grad_norm = None
        if max_norm:  # --clip-grad-norm: each stage holds its own layers' gradients, the model's norm is the root of
            # their squared norms summed over the stages (every stage: a collective), then each clips its own
            grad_norm = nn.utils.get_total_norm([p.grad for p in stage.submod.parameters()]) ** 2
            dist.all_reduce(grad_norm, group=grid.pipeline)  # this replica's stages (all replicas: the same gradients)
            grad_norm = grad_norm.sqrt()
            nn.utils.clip_grads_with_norm_(stage.submod.parameters(), max_norm, grad_norm)
        optimizer.step()
        loss = torch.stack(losses).mean() if losses else None  # the batch's loss: on the last stage alone
        if safety.step_done(loss, grad_norm):  # every rank, each step: progress, checkpoints; True: all ranks stop
            return


def split(model: nn.Module, stage: int, stages: int) -> nn.Sequential:
    """The layers stage `stage` of `stages` holds: ResNet-18's 8 residual blocks dealt in order as evenly as they go
    (each costs about the same: each layer halves the image and doubles the channels), the stem (conv1, bn1) with
    the first blocks, the pooling and fc with the last. Named as in the whole model ("layer2.1.conv1.weight"), so
    a checkpoint of any number of stages holds distributed.py's keys once. The layers of other stages are dropped."""
    blocks = [(layer, str(i)) for layer in ("layer1", "layer2", "layer3", "layer4") for i in range(2)]
    mine = blocks[stage * len(blocks) // stages:(stage + 1) * len(blocks) // stages]
    parts = [("conv1", model.conv1), ("bn1", model.bn1), ("relu", model.relu)] if stage == 0 else []
    for layer in dict.fromkeys(layer for layer, _ in mine):  # each layer once, with the blocks of it held here
        parts.append((layer, nn.Sequential(OrderedDict((i, getattr(model, layer)[int(i)]) for name, i in mine
                                                       if name == layer))))
    if stage == stages - 1:
        parts += [("avgpool", model.avgpool), ("flatten", nn.Flatten()), ("fc", model.fc)]
    return nn.Sequential(OrderedDict(parts))


def train(args, env, safety):
    grid = pipelining.layout(env, args.replicas)  # this rank's stage and replica of the pipeline, their groups
    batch = args.batch_size // args.replicas  # every stage of a replica works on its share, in --microbatches pieces
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle dealt to the replicas in turn (replica c: c, c+R, ...), the same batches on each of
    # its stages; DistributedSampler + set_epoch(skip)
    sampler = data.ResumableDistributedSampler(train_set, num_replicas=args.replicas, rank=grid.replica,
                                               seed=args.seed, drop_last=True)  # drop_last: no sample repeated
    # workers forked, not spawned (10-30 s each), kept for the whole run; pinned batches: copied without a host wait
    loading = dict(num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=env.device.type == "cuda",
                   multiprocessing_context="fork" if args.workers and sys.platform == "linux" else None)
    train_loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True, **loading)
    # each replica's share of the test set, images c, c+R, ...: each counted once, by the last stage of one replica
    test_loader = DataLoader(test_set, batch_size=batch, sampler=range(grid.replica, len(test_set), args.replicas),
                             **loading)
    if len(train_loader) == 0:  # drop_last: a training set smaller than one global batch gives no step at all
        raise UsageError(f"{len(train_set)} training images make no whole batch of --batch-size {args.batch_size}")

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    # every rank builds the whole model on the CPU from the seed (the other scripts' weights), then keeps its stage
    model = split(model, grid.stage, grid.stages)
    model = model.to(env.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if args.compile:  # fused kernels (the first steps pay for compilation); the state_dict keys stay the same
        model.compile()
    # the stage sends its output to the next stage's rank and receives its input from the one before (gradients back)
    stage = PipelineStage(model, stage_index=grid.stage, num_stages=grid.stages, device=env.device, group=grid.pipeline)
    # 1F1B: once full, each stage alternates a forward and a backward, so it holds the activations of at most S
    # micro-batches in flight, where GPipe's all-forwards-then-all-backwards holds all M; the same arithmetic
    schedule_kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_kind(stage, n_microbatches=args.microbatches, loss_fn=nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(  # over this stage's layers: each rank steps its own; --optimizer-impl: the kernel
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        **techniques.sgd_kernel(args.optimizer_impl))
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)  # --lr to 0, by epoch
    if args.warmup_epochs:  # first a linear rise from --lr/100 (large global batches need it)
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = lr_scheduler.SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])

    # every rank: continue from <output-dir>'s checkpoint if there is one (each stage reads its own layers' part)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=len(train_loader))
    if args.evaluate:  # the checkpoint's weights (all that resume read) on the test set, into eval.json
        safety.write_eval(pipelining.evaluate(stage, schedule, test_loader, env.device, batch))
        return
    for epoch in range(start_epoch, args.epochs):
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what a checkpoint trained
        sampler.set_epoch(epoch, skip=start_step * batch)
        train_one_epoch(stage, schedule, optimizer, train_loader, env.device, safety, args.clip_grad_norm, grid)
        pipelining.broadcast_buffers_from_the_first_replica(model, grid.replicas)  # one model to evaluate and save
        # through the pipeline, every test image once; every stage takes part, so a stop waits for its end
        results = pipelining.evaluate(stage, schedule, test_loader, env.device, batch)
        if safety.end_epoch(results, lr=scheduler.get_last_lr()[0]):  # metrics.jsonl's line; True: stopped, saved
            return
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>


def main(argv=None):
    args = parse_args(argv)
    # from here on Ctrl-C or SIGTERM: every rank stops with a checkpoint; an error: one line (bad input: exit
    # status 2; a crash: 1, its traceback in a file); first: no other run in <output-dir>, its checkpoint usable
    with SafetyNet.for_flags(args, __file__, sharded_checkpoint=PipelineCheckpoint) as safety:  # each stage its layers
        env = launch.read_and_fill_environment(args)  # RANK, WORLD_SIZE read; MASTER_ADDR/PORT set where unset
        pipelining.check_stages(env.world_size, args.replicas, args.microbatches)  # at most 8 stages, M >= S
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
