"""Fully sharded data parallel (FSDP2's fully_shard) started by torchrun, ResNet-18 on CIFAR-100: each of the
N ranks holds 1/N of the weights, gradients and optimizer state. It trains distributed.py's model to the same
weights (tests/test_fsdp.py); what changes is what a rank holds and communicates: docs/sharding.md.

    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py                # 4 GPUs, bfloat16 where supported
    torchrun --standalone --nproc_per_node=2 distributed_fsdp.py --device cpu   # 2 CPU processes, gloo
    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py --no-reshard-after-forward  # ZeRO-2-like
    python -m safety_net.sharded_checkpoint runs/distributed_fsdp/checkpoint.dcp   # the checkpoint as one file
"""
import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from safety_net import SafetyNet
from utils import data, flags, launch, loaders, metrics, models, precision, techniques
from utils.errors import exit_on_error
from utils.syncbn import CpuSyncBatchNorm


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, __file__)
    parser.group("sharding").add_argument(  # shard() below
        "--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
        help="free each stage's gathered weights after its forward and gather them again for backward (least memory, "
             "like ZeRO-3); --no-reshard-after-forward keeps them until backward (one all-gather fewer per stage and "
             "step, like ZeRO-2)")
    precision.add_flags(parser, float16=False)  # --opt-level, --amp-dtype: the mixed precision policy below
    flags.add_torchrun_flags(parser)  # --local-rank, --ip, --port: for launchers that set no environment
    data.add_flags(parser)  # the flags your datasets() reads: --data-dir, --dataset, ... (docs/template.md)
    flags.add_training_flags(parser)  # --epochs --batch-size --lr --warmup-epochs --momentum --weight-decay --seed
    flags.add_device_flags(parser)  # --device, --backend, --dist-timeout, --no-sync-bn
    techniques.add_flags(parser)  # --channels-last, --compile, --loader, --optimizer-impl
    SafetyNet.add_flags(parser, sharded=True)  # --output-dir, checkpoints (directories of shards), --evaluate
    args = flags.parse(parser, argv)
    if args.lr is None:  # --lr's default: 0.1 at a global batch of 256, scaled with the batch (linear scaling)
        args.lr = flags.scaled_lr(args.batch_size)
    return args


def train_one_epoch(model, criterion, optimizer, loader, device, safety):
    """One pass over this rank's batches: forward, loss, backward and the optimizer's step for each."""
    model.train()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters the gradients, stage by stage: each rank gets the average of its shard
        optimizer.step()  # each rank updates its shard of the weights, with its shard of the momentum
        if safety.step_done(loss):  # every rank, every step: progress, checkpoints; True once all know of a stop
            return


def shard(model: nn.Module, amp_dtype: torch.dtype | None, reshard_after_forward: bool) -> nn.Module:
    """The model with 1/world_size of each parameter on each rank, as DTensors (every rank built the same
    weights from the same seed; fully_shard keeps its share of dim 0)."""
    # Mixed precision the FSDP way: forward and backward run on amp_dtype copies of the weights (gathered in
    # amp_dtype, half the bytes of float32); gradients are reduced in float32 into the float32 shards that
    # the optimizer updates. No autocast: each sharded module's inputs are cast, the logits cast back.
    policy = dict(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None)
    if amp_dtype:  # BatchNorm stays float32, as under autocast (its statistics are float32): all of it one unit
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        fully_shard(norms, reshard_after_forward=False)  # float32 policy; 38 KB, one all-gather a step, kept
    # each residual stage one unit: gathered for its forward, freed after it (reshard_after_forward) and
    # gathered again for its backward, its gradients then reduce-scattered
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mp_policy=MixedPrecisionPolicy(**policy), reshard_after_forward=reshard_after_forward)
    # the root unit holds the rest (stem, fc), and gives the logits back in float32 for the loss
    root = MixedPrecisionPolicy(**policy, output_dtype=torch.float32 if amp_dtype else None)
    return fully_shard(model, mp_policy=root, reshard_after_forward=reshard_after_forward)


def train(args, env, safety) -> int:
    # None: float32; no float16, which would need loss scaling across the shards
    amp_dtype = precision.autocast_dtype(args, env.device, env.is_main, safety.recorded_precision(), float16=False)
    batch = flags.per_rank_batch(args.batch_size, env.world_size)
    train_set, test_set = data.datasets(args, env)  # your own data: replace data.datasets (docs/template.md)
    # each epoch a seeded shuffle of the training set, dealt to the ranks in turn: rank r takes r, r+W, ...
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, seed=args.seed, drop_last=True)
    train_loader = loaders.train_loader(train_set, sampler, per_rank_batch=batch, env=env, args=args)
    test_loader = loaders.test_loader(test_set, per_rank_batch=batch, env=env, args=args)

    torch.manual_seed(args.seed)
    model = models.resnet18_cifar(data.num_classes(train_set))  # one output per class of the data
    model = model.to(env.device, memory_format=techniques.memory_format(args))
    if not args.no_sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
        sync_bn = nn.SyncBatchNorm if env.device.type == "cuda" else CpuSyncBatchNorm  # torch's is GPU-only
        model = sync_bn.convert_sync_batchnorm(model)
    model = shard(model, amp_dtype, args.reshard_after_forward)
    techniques.compile_if_asked(model, args.compile)
    criterion = nn.CrossEntropyLoss()
    optimizer, scheduler = models.sgd_with_cosine(model, args)  # over the shards: each rank steps its own

    if args.evaluate:  # the weights of <output-dir>'s checkpoint on the test set, into eval.json
        safety.load_weights(model, amp_dtype)  # each rank reads its own shards (torch.distributed.checkpoint)
        safety.write_eval(metrics.evaluate(model, test_loader, env.device, sharded=True))
        return safety.finish()
    # every rank: continue from <output-dir>'s checkpoint if there is one (each rank reads its own shards)
    start_epoch = safety.resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                steps_per_epoch=train_loader.steps, precision=amp_dtype)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank (else every epoch repeats)
        start_step = safety.begin_epoch(epoch)  # 0, or the step a mid-epoch checkpoint reached
        batches = train_loader.epoch(epoch, start_step)  # this rank's batches, from start_step on
        train_one_epoch(model, criterion, optimizer, batches, env.device, safety)
        if args.no_sync_bn:  # FSDP shards parameters, not buffers: rank 0's BatchNorm statistics for all, as DDP has
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        # every rank forwards as many batches (each forward all-gathers), so a stop waits for its end
        results = metrics.evaluate(model, test_loader, env.device, sharded=True)
        if safety.ask_all_ranks_whether_to_stop():  # a signal reached some rank: a checkpoint of this step, then exit
            return safety.save_stopped_run()
        safety.end_epoch(results, lr=scheduler.get_last_lr()[0])  # metrics.jsonl, and the epoch's line
        scheduler.step()
        safety.save(epoch + 1)  # the checkpoint of the epochs done, in <output-dir>
    return safety.finish()


def main(argv=None):
    args = parse_args(argv)
    safety = SafetyNet.for_flags(args, __file__, sharded=True)  # sharded checkpoints; catches Ctrl-C, SIGTERM, ...
    with exit_on_error():
        SafetyNet.check_flags_before_start(args, __file__, sharded=True)  # <output-dir> free, its checkpoint usable
        env = launch.this_process(args)  # RANK, LOCAL_RANK, WORLD_SIZE as torchrun sets them; device, backend
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)  # this process's GPU: NCCL and every .cuda() without an index use it
        # join the process group at MASTER_ADDR:MASTER_PORT: every rank waits here until all have joined
        dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, timeout=env.timeout,
                                store=launch.torchrun_restart_store(env.timeout))  # None, but after a restart
        safety.arm(env)
        try:
            status = train(args, env, safety)
        finally:
            dist.destroy_process_group()  # frees the backend's threads and sockets before the process ends
    sys.exit(status)


if __name__ == "__main__":
    main()
