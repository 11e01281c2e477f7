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
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

from safety_net import SafetyNet
from speed import techniques
from utils import data, flags, launch, metrics, models, precision
from utils.errors import UsageError
from utils.gpus import gpus_for_dataparallel


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    flags.group(parser, "processes and devices").add_argument(
        "--gpu", default=None, metavar="0,1,...",
        help="GPUs to use, as indices among CUDA_VISIBLE_DEVICES; default: all visible")
    precision.add_flags(parser, opt_level_default="O0")  # --opt-level O1 and --amp-dtype: mixed precision
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser, process_group=False)  # --device (the GPUs: --gpu above)
    techniques.add_flags(parser)  # --channels-last, --compile, --optimizer-impl
    SafetyNet.add_flags(parser)  # --output-dir, checkpoints, --evaluate, --print-freq
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


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


def train_one_epoch(model, criterion, optimizer, loader, device, safety, scaler, max_norm=None):
    """One pass over the batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)  # autocast, if any, is inside: AutocastInForward
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the replicas' (scaled) gradients are summed onto the first GPU's weights
        grad_norm = precision.clip_unscaled(model.parameters(), optimizer, scaler, max_norm)  # --clip-grad-norm
        scaler.step(optimizer)  # unscales; skips the step if a gradient overflowed to inf/NaN
        scaler.update()  # lowers the scale after an overflow, raises it after a run of good steps
        if safety.step_done(loss, grad_norm):  # every step: progress, checkpoints; True once a stop signal came
            return


def train(args, env, safety, gpus):
    amp_dtype = precision.autocast_dtype(args, env.device, env.is_main, safety.recorded_precision())  # None: float32
    batch = flags.per_rank_batch(args.batch_size, env.world_size)  # one process loads the whole batch
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle: DDP's order, dealt to one process (W = 1); DistributedSampler + set_epoch(skip)
    sampler = data.ResumableDistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed,
                                               drop_last=True)  # drop_last: the same steps as DDP's
    # workers forked, not spawned (10-30 s each), kept for the whole run; pinned batches: copied without a host wait
    loading = dict(num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=env.device.type == "cuda",
                   multiprocessing_context="fork" if args.workers and sys.platform == "linux" else None)
    train_loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True, **loading)
    test_loader = DataLoader(test_set, batch_size=batch, **loading)  # the whole test set, in order
    if len(train_loader) == 0:  # drop_last: a training set smaller than one batch gives no step at all
        raise UsageError(f"{len(train_set)} training images make no whole batch of --batch-size {args.batch_size}")

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if args.compile:  # fused kernels; the module itself, as DataParallel's replicas are copies (one GPU only)
        model.compile()
    model = AutocastInForward(model, amp_dtype)  # mixed precision inside each replica (a no-op for float32)
    # DataParallel splits each batch over the GPUs; BatchNorm statistics stay per GPU (SyncBatchNorm
    # needs DDP). Without GPUs there is nothing to split: the CPU trains the bare model.
    model = nn.DataParallel(model, device_ids=gpus) if gpus else model
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(  # --optimizer-impl: torch's for-loop, foreach or fused kernel
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        **techniques.sgd_kernel(args.optimizer_impl))
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)  # --lr to 0, by epoch
    if args.warmup_epochs:  # first a linear rise from --lr/100 (large global batches need it)
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = lr_scheduler.SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])
    # float16 gradients underflow to 0 below 6e-8, so the loss is scaled up; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(env.device.type, enabled=amp_dtype == torch.float16)  # else a pass-through

    # continue from <output-dir>'s checkpoint if there is one (model, optimizer, schedule, scaler, step)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=len(train_loader), scaler=scaler, precision=amp_dtype)
    if args.evaluate:  # the checkpoint's weights (all that resume read) on the test set, into eval.json
        safety.write_eval(metrics.evaluate(model, test_loader, env.device))
        return
    for epoch in range(start_epoch, args.epochs):
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        # a new shuffle and augmentation each epoch (else each repeats the first); skip: what a checkpoint trained
        sampler.set_epoch(epoch, skip=start_step * batch)
        train_one_epoch(model, criterion, optimizer, train_loader, env.device, safety, scaler, args.clip_grad_norm)
        # split over the GPUs too; a stop signal cuts it short
        results = metrics.evaluate(model, test_loader, env.device, stop=safety.stop_received_here)
        if safety.end_epoch(results, lr=scheduler.get_last_lr()[0]):  # metrics.jsonl's line; True: stopped, saved
            return
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>


def main(argv=None):
    args = parse_args(argv)
    # from here on Ctrl-C or SIGTERM: a stop with a checkpoint; an error: one line (bad input: exit status 2; a
    # crash: 1, its traceback in a file); first: no other run in <output-dir>, its checkpoint usable
    with SafetyNet.for_flags(args, __file__) as safety:
        gpus = gpus_for_dataparallel(args.gpu, args.device, args.compile)  # --gpu, or all visible; [] on the CPU
        device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")  # the replicas gather here
        env = launch.Env(rank=0, local_rank=0, world_size=1, device=device)  # one process: no process group
        with safety.running(env):  # the stop signals' handling starts here; a stop's exit status at the end
            train(args, env, safety, gpus)


if __name__ == "__main__":
    main()
