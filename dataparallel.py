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

from safety_net import SafetyNet
from utils import data, flags, launch, loaders, metrics, models, precision, techniques
from utils.errors import exit_on_error
from utils.gpus import gpus_for_dataparallel


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    parser.group("processes and devices").add_argument(
        "--gpu", default=None, metavar="0,1,...",
        help="GPUs to use, as indices among CUDA_VISIBLE_DEVICES; default: all visible")
    precision.add_flags(parser, opt_level_default="O0")  # --opt-level O1 and --amp-dtype: mixed precision
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser, process_group=False)  # --device (the GPUs: --gpu above)
    techniques.add_flags(parser)  # --channels-last, --compile, --loader, --optimizer-impl
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


def train_one_epoch(model, criterion, optimizer, loader, device, safety, scaler):
    """One pass over the batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)  # autocast, if any, is inside: AutocastInForward
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the replicas' (scaled) gradients are summed onto the first GPU's weights
        scaler.step(optimizer)  # unscales; skips the step if a gradient overflowed to inf/NaN
        scaler.update()  # lowers the scale after an overflow, raises it after a run of good steps
        if safety.step_done(loss):  # every step: progress, checkpoints; True once a stop signal came
            return


def train(args, env, safety, gpus) -> int:
    amp_dtype = precision.autocast_dtype(args, env.device, env.is_main, safety.recorded_precision())  # None: float32
    batch = flags.per_rank_batch(args.batch_size, env.world_size)  # one process loads the whole batch
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle of the training set: DDP's order, dealt to one process (W = 1)
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed, drop_last=True)
    train_loader = loaders.train_loader(train_set, sampler, per_rank_batch=batch, env=env, args=args)
    test_loader = loaders.test_loader(test_set, per_rank_batch=batch, env=env, args=args)

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=techniques.memory_format(args))
    techniques.compile_if_asked(model, args.compile)  # the module: DataParallel's replicas are copies (utils/gpus.py)
    model = AutocastInForward(model, amp_dtype)  # mixed precision inside each replica (a no-op for float32)
    # DataParallel splits each batch over the GPUs; BatchNorm statistics stay per GPU (SyncBatchNorm
    # needs DDP). Without GPUs there is nothing to split: the CPU trains the bare model.
    model = nn.DataParallel(model, device_ids=gpus) if gpus else model
    criterion = nn.CrossEntropyLoss()
    optimizer, scheduler = models.sgd_with_cosine(model, args)
    # float16 gradients underflow to 0 below 6e-8, so the loss is scaled up; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(env.device.type, enabled=amp_dtype == torch.float16)  # else a pass-through

    if args.evaluate:  # the weights of <output-dir>'s checkpoint on the test set, into eval.json
        safety.load_weights(model)
        safety.write_eval(metrics.evaluate(model, test_loader, env.device))
        return safety.finish()
    # continue from <output-dir>'s checkpoint if there is one (model, optimizer, schedule, scaler, step)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=train_loader.steps, scaler=scaler, precision=amp_dtype)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (else every epoch repeats)
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        batches = train_loader.epoch(epoch, start_step)  # the batches, from start_step on
        train_one_epoch(model, criterion, optimizer, batches, env.device, safety, scaler)
        # split over the GPUs too; a stop signal cuts it short
        results = metrics.evaluate(model, test_loader, env.device, stop=safety.stop_received_here)
        if safety.ask_all_ranks_whether_to_stop():  # a stop signal came: a checkpoint of this step, then exit
            return safety.save_stopped_run()
        safety.end_epoch(results, lr=scheduler.get_last_lr()[0])  # metrics.jsonl, and the epoch's line
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>
    return safety.finish()


def main(argv=None):
    args = parse_args(argv)
    safety = SafetyNet.for_flags(args, __file__)  # catches Ctrl-C and SIGTERM: stop at the next step with a checkpoint
    with exit_on_error():
        SafetyNet.check_flags_before_start(args, __file__)  # no other run in <output-dir>, its checkpoint usable
        gpus = gpus_for_dataparallel(args.gpu, args.device, args.compile)  # --gpu, or all visible; [] on the CPU
        device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")  # the replicas gather here
        env = launch.Env(rank=0, local_rank=0, world_size=1, device=device)  # one process: no process group
        safety.arm(env)
        status = train(args, env, safety, gpus)
    sys.exit(status)


if __name__ == "__main__":
    main()
