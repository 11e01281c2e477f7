"""What distributed_pipeline.py needs beyond its own lines: its flags and their checks, and the exact evaluation
through the pipeline (every test image once, whatever the number of stages)."""
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from utils import flags, metrics
from utils.errors import UsageError

BLOCKS = 8  # ResNet-18's residual blocks: at most one stage each


def add_flags(parser) -> None:
    group = parser.add_argument_group("pipeline parallelism")
    group.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
                       help="1f1b: each stage alternates one micro-batch's forward and one's backward once the "
                            "pipeline is full, holding the activations of at most (stages) micro-batches; gpipe: all "
                            "forwards, then all backwards, holding all of them. The same weights either way")
    group.add_argument("--microbatches", type=flags.positive_int, default=4, metavar="M",
                       help="micro-batches each global batch is cut into, at least one per stage; the stages idle "
                            "for (S-1)/(M+S-1) of a step (the bubble). BatchNorm normalises each micro-batch alone")
    group.add_argument("--replicas", type=flags.positive_int, default=1, metavar="R",
                       help="R replicas of the pipeline, each on world size / R ranks and a 1/R share of every batch; "
                            "each stage's gradients averaged over its R replicas, as DDP's (a 2-D mesh of ranks)")
    parser.checks.append(microbatches_divide_the_batch)


def microbatches_divide_the_batch(args) -> str | None:
    pieces = args.replicas * args.microbatches  # each replica's share of the batch, cut into micro-batches
    into = f"--replicas {args.replicas} x " * (args.replicas > 1) + f"--microbatches {args.microbatches}"
    if args.batch_size % pieces:
        return f"--batch-size {args.batch_size} does not divide into {into}"
    if args.batch_size // pieces < 2:
        return (f"--batch-size {args.batch_size} in {into} leaves one image a micro-batch: BatchNorm needs two or "
                "more to train")
    return None


def check_stages(world_size: int, replicas: int, microbatches: int) -> None:
    """Before the ranks meet: the ranks split into whole replicas of the pipeline, as many stages as the split allows,
    and a micro-batch for each stage to work on (fewer hang in torch's schedules, pytorch/torchtitan#775)."""
    if world_size % replicas:
        raise UsageError(f"{world_size} processes do not split into --replicas {replicas} replicas of the pipeline")
    stages = world_size // replicas
    if stages > BLOCKS:
        raise UsageError(f"{stages} stages but ResNet-18 splits into at most {BLOCKS} (one residual block each); "
                         f"start at most {BLOCKS * replicas} processes, or more --replicas")
    if microbatches < stages:
        raise UsageError(f"--microbatches {microbatches} is fewer than the {stages} stages: the pipeline would never "
                         f"fill (and torch's schedules hang); use --microbatches {stages} or more")


def layout(env, replicas: int) -> SimpleNamespace:
    """Where this rank sits: .stage of .stages in its replica .replica of the pipeline (rank = replica x stages +
    stage), .pipeline the process group of its replica's stages (None: all ranks), .replicas that of its stage in
    every replica (None: one replica). Every rank (collective: makes the groups of the 2-D mesh)."""
    stages = env.world_size // replicas
    if replicas == 1:
        return SimpleNamespace(stage=env.rank, stages=stages, replica=0, pipeline=None, replicas=None)
    mesh = init_device_mesh(env.device.type, (replicas, stages), mesh_dim_names=("replicas", "pipeline"))
    return SimpleNamespace(stage=mesh["pipeline"].get_local_rank(), stages=stages,
                           replica=mesh["replicas"].get_local_rank(), pipeline=mesh["pipeline"].get_group(),
                           replicas=mesh["replicas"].get_group())


def average_over_replicas(model: torch.nn.Module, replicas) -> None:
    """--replicas: every rank (collective: one all-reduce over `replicas`, after the step's last micro-batch): this
    stage's gradients averaged over its replicas, as DDP would, all of them flattened into one message (not one a
    parameter: 30 or 32 a step here). Hand-written: DDP around a stage fails its bucket rebuild after the schedule's
    several forwards (torch 2.14: "rebuilt parameter indices" INTERNAL ASSERT). Nothing with one replica."""
    if replicas is not None:
        grads = [parameter.grad for parameter in model.parameters()]
        flat = torch.cat([grad.flatten() for grad in grads])
        dist.all_reduce(flat, group=replicas)
        flat /= dist.get_world_size(replicas)  # the sum to the mean
        for grad, mean in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
            grad.copy_(mean.view_as(grad))


def broadcast_buffers_from_the_first_replica(model: torch.nn.Module, replicas) -> None:
    """Every rank (collective: a broadcast per buffer over `replicas`): the first replica's BatchNorm statistics in
    every replica of this stage, as DDP keeps rank 0's; nothing with one replica."""
    if replicas is not None:
        for buffer in model.buffers():
            dist.broadcast(buffer, group=replicas, group_src=0)


@torch.no_grad()
def evaluate(stage, schedule, loader, device: torch.device, batch: int) -> dict:
    """Top-1/top-5 accuracy and mean loss over exactly the test set, through the pipeline (collective: every stage
    iterates the same `loader`, the schedule sends the activations on; then one all-reduce of the counts). A short
    last batch is padded to `batch` with zeros (the schedule cuts every batch into the same micro-batches), and the
    last stage counts only its real images: in eval mode each image's logits depend on that image alone."""
    stage.submod.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    for images, targets in loader:
        images, targets, real = images.to(device), targets.to(device), len(targets)
        padded = [torch.cat([t, t.new_zeros(batch - real, *t.shape[1:])]) for t in (images, targets)]
        # the last stage's targets too: the schedule computes each micro-batch's loss there (not used: see below)
        logits = schedule.eval(*padded[:1] if stage.is_first else [], target=padded[1] if stage.is_last else None)
        if stage.is_last:
            totals += metrics.counts(logits[:real], targets)
    return metrics.results(totals)  # the last stage's counts, zeros elsewhere
