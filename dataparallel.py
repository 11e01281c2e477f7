"""DataParallel: one process drives every chosen GPU, ResNet-18 on CIFAR-100.

    python dataparallel.py                      # all visible GPUs
    python dataparallel.py --gpu 0,1            # GPUs 0 and 1 (indices among CUDA_VISIBLE_DEVICES)
    python dataparallel.py --device cpu         # no GPU: the CPU, as a single replica
    python dataparallel.py --opt-level O1       # mixed precision: float16 autocast + GradScaler on GPUs

Each step, DataParallel copies the weights from the first GPU to the others, splits the batch
between them, runs the replicas in threads and gathers outputs and gradients back on the first
GPU. Simple, but one Python process and one GPU do the gathering: DDP is faster (see README).
"""
import sys

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from utils import data, flags, launch, metrics, models, precision, stopping, techniques
from utils.checkpoint import Checkpoint
from utils.errors import UsageError, exit_on_error
from utils.progress import EpochProgress


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    parser.group("processes and devices").add_argument(
        "--gpu", default=None, metavar="0,1,...",
        help="GPUs to use, as indices among CUDA_VISIBLE_DEVICES; default: all visible")
    precision.add_flags(parser, opt_level_default="O0")  # --opt-level O1 and --amp-dtype: mixed precision
    flags.add_shared_flags(parser, distributed=False)
    return flags.parse(parser, argv)


class AutocastInForward(nn.Module):
    """Runs the model's forward under autocast inside each DataParallel replica's thread. An autocast
    entered around the DataParallel call reaches those threads only as on or off, with the device's
    default dtype (float16 on CUDA) whatever dtype was asked (torch/nn/parallel/parallel_apply.py), so
    torch's AMP notes advise entering it in the forward itself, as here."""
    wraps_module = True  # checkpoint.unwrap looks through it: the checkpoint holds the bare model's weights

    def __init__(self, module: nn.Module, dtype: torch.dtype | None):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, images):
        # autocast runs matrix products and convolutions in dtype, reductions in float32
        with torch.autocast(images.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(images)


def train_one_epoch(model, criterion, optimizer, progress, env, stop, checkpoint, scaler):
    """From progress.step to the epoch's end, or to the step at which every rank knows of a stop signal."""
    model.train()
    for images, targets in progress:
        images = images.to(env.device, non_blocking=True)
        targets = targets.to(env.device, non_blocking=True)
        loss = criterion(model(images), targets)  # autocast, if any, is inside: AutocastInForward
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the replicas' (scaled) gradients are summed onto the first GPU's weights
        scaler.step(optimizer)  # unscales; skips the step if a gradient overflowed to inf/NaN
        scaler.update()  # lowers the scale after an overflow, raises it after a run of good steps
        progress.record(loss)  # summed on the device; every --print-freq steps printed and checked finite
        if stop.agreed():  # a stop signal reached some rank: every rank leaves at this same step
            return
        if checkpoint.due(progress.step, progress.total):  # --save-every-steps
            checkpoint.save(epoch=progress.epoch, step=progress.step, epoch_loss=progress.loss_so_far())


def train(args, env, stop, gpus) -> int:
    amp_dtype = precision.autocast_dtype(args, env.device, env.is_main)  # None: float32 (--opt-level O0)
    batch = flags.per_rank_batch(args.batch_size, env.world_size)  # one process loads the whole batch
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle of the training set: DDP's order, dealt to one process (W = 1)
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed, drop_last=True)
    train_loader = data.train_loader(train_set, sampler, per_rank_batch=batch, env=env, args=args)
    test_loader = data.test_loader(test_set, per_rank_batch=batch, env=env, args=args)

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=techniques.memory_format(args))
    techniques.compile_if_asked(model, args)  # the module itself: DataParallel's replicas are copies (see choose_gpus)
    model = AutocastInForward(model, amp_dtype)  # mixed precision inside each replica (a no-op for float32)
    # DataParallel splits each batch over the GPUs; BatchNorm statistics stay per GPU (SyncBatchNorm
    # needs DDP). Without GPUs there is nothing to split: the CPU trains the bare model.
    model = nn.DataParallel(model, device_ids=gpus) if gpus else model
    criterion = nn.CrossEntropyLoss()
    optimizer, scheduler = models.sgd_with_cosine(model, args)
    # float16 gradients underflow to 0 below 6e-8, so the loss is scaled up; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(env.device.type, enabled=amp_dtype == torch.float16)  # else a pass-through
    checkpoint = Checkpoint(args, env, __file__, precision=amp_dtype, model=model, optimizer=optimizer,
                            scheduler=scheduler, scaler=scaler)

    if args.evaluate:
        checkpoint.load_weights()
        results = metrics.evaluate(model, test_loader, env.device)
        metrics.write_eval(args.output_dir, results, env.is_main)
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
        train_one_epoch(model, criterion, optimizer, progress, env, stop, checkpoint, scaler)
        # split over the GPUs too; None if a stop signal comes during it
        results = None if stop.agreed() else metrics.evaluate(model, test_loader, env.device, stop=stop)
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


def choose_gpus(args) -> list[int]:
    """The GPU indices named by --gpu (all visible ones by default); [] to run on the CPU."""
    visible = torch.cuda.device_count()
    if launch.resolve_device(args.device) == "cpu":
        if args.gpu:
            why = "--device cpu was asked for" if visible else "no GPU is visible (check CUDA_VISIBLE_DEVICES)"
            raise UsageError(f"--gpu {args.gpu} names GPUs, but {why}; drop --gpu to train on the CPU")
        print("no GPU in use: DataParallel trains on the CPU as a single replica", file=sys.stderr)
        return []
    if args.gpu is None:
        gpus = list(range(visible))
    else:
        gpus = parse_gpus(args.gpu, visible)
    if args.compile and len(gpus) > 1:  # a compiled module runs its own weights, not a replica's
        raise UsageError(f"--compile with DataParallel on {len(gpus)} GPUs: torch.compile does not follow "
                         "DataParallel's replicas; use DDP (distributed.py) or one GPU")
    return gpus


def parse_gpus(text: str, visible: int) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu {text}: expected GPU indices like 0,1,2,3") from None
    missing = [g for g in gpus if not 0 <= g < visible]
    if missing or len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpu {text}: GPU {missing[0] if missing else 'index repeated'} is not usable; "
                         f"visible GPUs are 0..{visible - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return gpus


def main(argv=None):
    args = parse_args(argv)
    stop = stopping.StopSignals()  # SIGTERM, Ctrl-C, SIGUSR1: stop at the next step with a checkpoint
    with exit_on_error():
        flags.check_before_start(args)
        gpus = choose_gpus(args)
        device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")  # the replicas gather here
        stop.arm(world_size=1)
        status = train(args, launch.Env(rank=0, local_rank=0, world_size=1, device=device), stop, gpus)
    sys.exit(status)


if __name__ == "__main__":
    main()
