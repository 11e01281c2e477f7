"""DDP that trains on when a replica group dies, and heals its replacement from a live group (torchft).

The job is several replica groups, each a torchrun of its own (one or more processes); a lighthouse says at each step
which groups are alive (the quorum), and the gradients are averaged over those. A group that dies costs the others
one step; started again, it copies the state of a live group and trains on, no restart, no checkpoint read.

    torchft_lighthouse --min_replicas 1 &                                          # the job's coordinator, first
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc_per_node=2 distributed_live_recovery.py   # one group, 2 GPUs
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc_per_node=2 distributed_live_recovery.py   # another group
    python examples/live_recovery_demo.py                 # all of it on this machine's CPU: a group killed, healed
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

from safety_net.healing import HealingSafetyNet
from speed import techniques
from utils import data, flags, launch, live_recovery, metrics, models
from utils.errors import UsageError
from utils.syncbn import CpuSyncBatchNorm

torchft = live_recovery.import_torchft_with_quiet_logs()  # PyTorch's fault-tolerance library (pip install torchft)


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser)  # --device, --backend, --dist-timeout, --no-sync-bn
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    HealingSafetyNet.add_flags(parser)  # --output-dir, checkpoints, --evaluate, --print-freq
    live_recovery.add_flags(parser)  # --lighthouse, --replica-group, --replica-groups, --min-replica-groups
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    # each replica group writes only its own files: checkpoints, metrics and lock in a folder of its own
    args.output_dir = os.path.join(args.output_dir, f"replica_group_{args.replica_group}")
    return args


def train_one_epoch(model, criterion, optimizer, loader, device, safety, max_norm=None):
    """One pass over this rank's batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        loss.backward()  # averaged within the group, then over the quorum's groups (a dead one: not committed)
        # --clip-grad-norm: after the average, so its norm (returned: before clipping) is the same on every rank
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None
        optimizer.step()  # torchft: steps only if the step is committed (every group of the quorum sent its part)
        if safety.step_done(loss, grad_norm):  # every rank, each step: progress, checkpoints; True: all ranks stop
            return True
        optimizer.zero_grad(set_to_none=True)  # torchft: the next step's quorum, formed here: which groups live
    return False


def average_in_group_then_across_groups(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient hook: the bucket averaged over this group's processes, then over the quorum's groups (the
    manager's all-reduce). torchft's own DDP wrapper does only the second (groups of one process), and its 0.2.0
    hook fails an assertion when a group dies mid-step; here the manager keeps the error and skips the commit."""
    buffer = bucket.buffer()
    if dist.get_world_size() > 1:
        dist.all_reduce(buffer)  # within the group: a dead process of this group fails the whole group here
        buffer /= dist.get_world_size()
    manager.allreduce(buffer).wait()  # over the groups; a failure is kept by the manager: the step is not committed
    done = torch.futures.Future()  # as torch's own noop hook: the buffer, reduced in place
    done.set_result(buffer)
    return done


def average_batchnorm_statistics(manager, model: nn.Module) -> None:
    """Every group of the quorum, after its epoch's last step (a collective, the manager's all-reduce): BatchNorm's
    running statistics, which each group gathered from its own share, averaged, so all evaluate and save one model."""
    buffers = [buffer for buffer in model.buffers() if buffer.is_floating_point()]
    if not buffers:  # a model without BatchNorm (GroupNorm, say): nothing to average, on every group alike
        return
    flat = torch.cat([buffer.reshape(-1) for buffer in buffers])  # one all-reduce for all of them
    manager.allreduce(flat).wait()
    if manager.errored() is None:  # a failed all-reduce leaves them as they were (and the next step uncommitted)
        for buffer, averaged in zip(buffers, flat.split([buffer.numel() for buffer in buffers]), strict=True):
            buffer.copy_(averaged.view_as(buffer))


def train(args, env, safety):
    batch = flags.per_rank_batch(args.batch_size, env.world_size * args.replica_groups)  # all groups' processes
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle dealt to the processes of all groups in turn (process p of group g takes k, k+W,
    # ... with k = g * group size + p: torchft.DistributedSampler's deal); a down group's share is not trained
    sampler = data.ResumableDistributedSampler(train_set, num_replicas=env.world_size * args.replica_groups,
                                               rank=args.replica_group * env.world_size + env.rank, seed=args.seed,
                                               drop_last=True)  # set_epoch(skip): it can start an epoch part-way
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
    if not args.no_sync_bn:  # BatchNorm statistics over this replica group's batch (its own process group)
        sync_bn = nn.SyncBatchNorm if env.device.type == "cuda" else CpuSyncBatchNorm  # torch's is GPU-only
        model = sync_bn.convert_sync_batchnorm(model)
    if args.evaluate:  # the weights of <output-dir>'s checkpoint on the test set, into eval.json (no lighthouse)
        safety.resume(model=model, steps_per_epoch=len(train_loader))
        safety.write_eval(metrics.evaluate(model, test_loader, env.device))
        return
    # torchft: this group's manager. Each step it asks the lighthouse which groups are alive (the quorum),
    # averages over them, and hands a group that joins behind the others this one's state to heal it
    manager = torchft.Manager(
        # between groups; a collective waits --dist-timeout (torchft's own default, 60 s, held a group still as long)
        pg=(torchft.ProcessGroupNCCL if env.device.type == "cuda" else torchft.ProcessGroupGloo)(timeout=env.timeout),
        min_replica_size=args.min_replica_groups, replica_id=str(args.replica_group), lighthouse_addr=args.lighthouse,
        state_dict=safety.state_for_a_peer,  # the weights, optimizer, schedule and progress of resume() below
        load_state_dict=safety.take_state_from_a_peer,  # a group behind the live ones takes theirs
        use_async_quorum=False,  # heal before a step, never within one: the loop starts at the state's progress
        init_sync=False,  # every group builds the same weights from --seed: nothing to copy at the first step
        **live_recovery.store_of_this_group(), **live_recovery.timeouts(env))
    # DDP broadcasts rank 0's weights at start, then all-reduces gradients during backward, within this group;
    # find_unused_parameters keeps DDP's buckets as built (torchft's own setting), the same in every group
    model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, find_unused_parameters=True)
    # torchft: the gradients averaged within the group, then over the quorum's groups by the manager
    model.register_comm_hook(manager, average_in_group_then_across_groups)
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
    optimizer = torchft.Optimizer(manager, optimizer)  # torchft: zero_grad joins a quorum, step commits first
    # every rank: continue from <output-dir>'s checkpoint if there is one (with the manager's count of committed
    # steps, by which the quorum tells which group is behind), then wait for the groups its last step had (one trained
    # on alone could reach another's checkpointed step on other weights, and torchft heals only a group behind)
    safety.resume(model=model, optimizer=optimizer, scheduler=scheduler, manager=manager,
                  replica_groups=args.replica_groups, steps_per_epoch=len(train_loader),
                  lighthouse=args.lighthouse, wait_for_groups=args.wait_for_groups)
    # torchft: join the job's first quorum. A group behind the live ones heals here: it takes a live group's
    # state (state_dict above) and starts at that group's epoch and step
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(safety.epoch_to_start(), args.epochs):
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what a checkpoint trained
        sampler.set_epoch(epoch, skip=start_step * batch)
        stopped = train_one_epoch(model, criterion, optimizer, train_loader, env.device, safety, args.clip_grad_norm)
        if not stopped:  # every group of the quorum, after its last step (collective): all groups evaluate one model
            average_batchnorm_statistics(manager, model.module)
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
    with HealingSafetyNet.for_flags(args, __file__) as safety:
        live_recovery.check_lighthouse(args)  # the lighthouse answers, and no live group has this --replica-group
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
