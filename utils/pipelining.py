"""What distributed_pipeline.py needs beyond its own lines: its flags and their checks, and the exact evaluation
through the pipeline (every test image once, whatever the number of stages)."""
import torch

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
    parser.checks.append(_microbatches_divide_the_batch)


def _microbatches_divide_the_batch(args) -> str | None:
    if args.batch_size % args.microbatches:
        return f"--batch-size {args.batch_size} does not divide into --microbatches {args.microbatches}"
    if args.batch_size // args.microbatches < 2:
        return (f"--batch-size {args.batch_size} in --microbatches {args.microbatches} leaves one image a "
                "micro-batch: BatchNorm needs two or more to train")
    return None


def check_stages(stages: int, microbatches: int) -> None:
    """Before the ranks meet: as many stages (ranks) as the split allows, and a micro-batch for each stage to work
    on (fewer hang in torch's schedules, pytorch/torchtitan#775)."""
    if stages > BLOCKS:
        raise UsageError(f"{stages} processes but ResNet-18 splits into at most {BLOCKS} stages (one residual block "
                         "each); start at most 8")
    if microbatches < stages:
        raise UsageError(f"--microbatches {microbatches} is fewer than the {stages} stages: the pipeline would never "
                         f"fill (and torch's schedules hang); use --microbatches {stages} or more")


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
