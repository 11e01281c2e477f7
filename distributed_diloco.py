"""DiLoCo: each rank trains alone for --sync-every H steps, then a round averages how far they moved, ResNet-18 on
CIFAR-100. No gradient crosses the network between rounds: 1/H of DDP's all-reduces (arXiv 2311.08105; docs/diloco.md).

    torchrun --standalone --nproc_per_node=4 distributed_diloco.py                  # 4 GPUs of this machine
    torchrun --standalone --nproc_per_node=2 distributed_diloco.py --device cpu     # 2 CPU processes, gloo
    python distributed_diloco.py                                                    # a world of one: rounds of one
"""
import copy
import functools
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import lr_scheduler, swa_utils
from torch.utils.data import DataLoader

from safety_net import SafetyNet
from speed import techniques
from utils import collectives, data, flags, launch, metrics, models
from utils.errors import UsageError
from utils.in_flight import InFlight


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    diloco = parser.add_argument_group("DiLoCo")  # each a flag of the run: a resume refuses another value
    diloco.add_argument("--sync-every", type=flags.positive_int, default=16, metavar="H",
                        help="inner steps each rank takes alone between two rounds (and a round at each epoch's end)")
    diloco.add_argument("--outer-lr", type=flags.positive_float, default=0.7, help="the outer SGD's rate (paper: 0.7)")
    diloco.add_argument("--outer-momentum", type=flags.non_negative_float, default=0.9,
                        help="the outer SGD's Nesterov momentum (paper: 0.9; 0: plain SGD)")
    diloco.add_argument("--overlap-round", action="store_true",
                        help="leave a round's all-reduce running through the next round's steps, its outer step one "
                             "round late (arXiv 2502.12996; each epoch's last round waits). It learned far less with "
                             "the outer momentum than with --outer-momentum 0 in the run measured: docs/diloco.md")
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser, sync_bn=False)  # --device, --backend, --dist-timeout (BatchNorm per rank, below)
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    SafetyNet.add_flags(parser)  # --output-dir, checkpoints, --evaluate, --print-freq
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


def train_one_epoch(model, criterion, optimizer, loader, device, safety, max_norm=None, *, end_round, sync_every,
                    steps, first=0, replayed=0):
    """One pass over this rank's batches: forward, loss, backward and the inner step for each; a round every sync_every
    steps and at the epoch's last (steps). The loader starts after step `first`; steps up to `replayed` redo the
    round a mid-round checkpoint left (it holds the round's start), and were counted before it."""
    model.train()
    for step, (images, targets) in enumerate(loader, start=first + 1):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # this rank's gradients alone: no DDP wrap, no all-reduce between rounds
        # --clip-grad-norm: this rank's own gradients (their norm, returned: before clipping, is rank 0's in the log)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None
        optimizer.step()  # the inner step: this rank's weights move on alone
        if step % sync_every == 0 or step == steps:  # the epoch ends a round: its evaluation sees the agreed weights
            end_round(epoch_ends=step == steps)
        if step > replayed and safety.step_done(loss, grad_norm):  # every rank, each step; True: all ranks stop
            return


@torch.no_grad()
def end_round(model, outer_model, outer_optimizer, inner_optimizer, world_size, late=None, epoch_ends=False):
    """Every rank (collective: one all-reduce): the round's pseudo-gradients and BatchNorm's running statistics
    averaged, the outer step from the round's start, which every rank continues from. late (--overlap-round, an
    InFlight): the all-reduce runs on late.group through the next round's steps, the outer step one round late."""
    starts, weights = list(outer_model.parameters()), list(model.parameters())
    # BatchNorm's running statistics, each rank's own: averaged too, for a checkpoint mid-epoch (torchft's DiLoCo: not)
    statistics = [buffer for buffer in model.buffers() if buffer.is_floating_point()]
    # the pseudo-gradient: how far this rank's inner steps moved each weight from the round's start (a step's
    # direction, as a gradient is), all of it and the statistics in one message: the round's one all-reduce
    message = torch.cat([(start - now).flatten() for start, now in zip(starts, weights, strict=True)] +
                        [buffer.flatten() for buffer in statistics])
    if late is None:
        dist.all_reduce(message)  # summed over the ranks (gloo has no average), then divided: their mean
        means = [message / world_size]
    else:  # --overlap-round: the round before's mean now; this round's all-reduce runs on through the next round
        means = [late.take()]
        late.put(dist.all_reduce(message, group=late.group, async_op=True), message, world_size)
        if epoch_ends:  # the epoch's last round waits for its own too: the evaluation and checkpoint see every round
            means.append(late.take())
    outer_statistics = [buffer for buffer in outer_model.buffers() if buffer.is_floating_point()]
    for mean in [mean for mean in means if mean is not None]:  # (an epoch's first round has no round before)
        averaged = mean.split([t.numel() for t in starts + statistics])
        for start, grad in zip(starts, averaged, strict=False):
            start.grad = grad.view_as(start)
        outer_optimizer.step()  # the round's start moves: SGD with Nesterov momentum on the averaged pseudo-gradient
        for buffer, value in zip(outer_statistics, averaged[len(starts):], strict=True):
            buffer.copy_(value.view_as(buffer))  # the round's start holds the averaged statistics
    for start, buffer in zip(outer_model.buffers(), model.buffers(), strict=True):
        if not buffer.is_floating_point():
            start.copy_(buffer)  # and the count of batches (the same on every rank)
    start_round(model, outer_model, inner_optimizer)


@torch.no_grad()
def start_round(model, outer_model, inner_optimizer):
    """Every rank from the round's start, the weights every rank agrees on, with no inner momentum: a round is then
    set by the round's start, the outer momentum and the batches, so a checkpoint holds no state of any one rank (it
    resumes at any world size) and a stop mid-round replays the round's steps (the paper keeps it: a small change)."""
    model.load_state_dict(outer_model.state_dict())
    inner_optimizer.state.clear()


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
    # no SyncBatchNorm: between rounds each rank trains alone, BatchNorm normalises its own share (averaged at a round);
    # no DDP: it would all-reduce every step's gradients; every rank built the same weights from --seed
    outer_model = copy.deepcopy(model)  # the round's start, which every rank agrees on: stepped, evaluated, saved
    outer_optimizer = torch.optim.SGD(outer_model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                                      nesterov=args.outer_momentum > 0)  # Nesterov (torch: only with a momentum)
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

    # every rank: continue from <output-dir>'s checkpoint if there is one (the round's start and the outer momentum as
    # model and outer_optimizer; the inner optimizer for its rate: its momentum is dropped at each round's start)
    # --overlap-round: the round whose all-reduce runs, on a group of its own: on the default group's connections a
    # progress line's loss would wait behind its 43 MB (1.2-1.4 s a step at 30 Mbit/s, a line a step: 86e7c39)
    late = InFlight(collectives.new_group_like_world()) if args.overlap_round else None
    start_epoch = safety.resume(model=outer_model, optimizer=optimizer, outer_optimizer=outer_optimizer,
                                scheduler=scheduler, round_in_flight=late, steps_per_epoch=len(train_loader))
    if args.evaluate:  # the checkpoint's weights (all that resume read) on the test set, into eval.json
        safety.write_eval(metrics.evaluate(outer_model, test_loader, env.device))
        return
    steps, end = len(train_loader), functools.partial(end_round, model, outer_model, outer_optimizer, optimizer,
                                                      env.world_size, late)
    for epoch in range(start_epoch, args.epochs):
        start_round(model, outer_model, optimizer)  # every epoch from the round's start, its statistics measured below
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        first = start_step if start_step == steps else start_step - start_step % args.sync_every  # its round's start
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what the checkpoint's round had
        sampler.set_epoch(epoch, skip=first * batch)
        train_one_epoch(model, criterion, optimizer, train_loader, env.device, safety, args.clip_grad_norm,
                        end_round=end, sync_every=args.sync_every, steps=steps, first=first, replayed=start_step)
        # the round's start, to evaluate: its outer steps moved it past where the ranks measured BatchNorm's statistics
        # (the first 1.33x the mean step at the paper's rates): measured again, as SWA's averaged weights need them
        if not safety.stop_received_here():  # the same 512 training images on every rank (a stop: evaluation cut short)
            swa_utils.update_bn(DataLoader(train_set, batch_size=batch, sampler=range(min(len(train_set), 512))),
                                outer_model, env.device)
        results = metrics.evaluate(outer_model, test_loader, env.device, stop=safety.stop_received_here)
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
