"""The command-line flags every script shares, and the checks that need no process group."""
import argparse
import math
import os
import re
import sys
import tempfile

from utils import speed
from utils.dist import check_address
from utils.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit status 2) instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, unless it is None or False (nothing to show) or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _dashes(argv):
    """Accept the seed-era spellings: --batch_size means --batch-size, --local_rank --local-rank."""
    return [re.sub(r"^(--[^=]*)", lambda m: m.group(1).replace("_", "-"), a) if a.startswith("--") else a
            for a in argv]


def make_parser(doc: str, script: str, distributed: bool = True) -> Parser:
    """The shared flags of design.md; `distributed` adds those that only DDP scripts have."""
    name = os.path.splitext(os.path.basename(script))[0]
    parser = Parser(
        prog=os.path.basename(script),
        description=doc.strip().splitlines()[0],
        epilog="Underscore spellings of the flags (--batch_size, --local_rank, ...) are accepted too.",
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--data-dir", default="./data", help="where CIFAR-100 is (cifar-100-python/) or will be downloaded")
    add("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
        help="cifar100, or a learnable CIFAR-shaped synthetic set that needs no download")
    add("--train-samples", type=positive_int, default=None, metavar="N", help="use the first N training images")
    add("--test-samples", type=positive_int, default=None, metavar="N", help="use the first N test images")
    add("--epochs", type=positive_int, default=30, help="number of training epochs")
    add("--batch-size", type=positive_int, default=256,
        help="global batch size, summed over all processes/devices (per rank = global / world size)")
    add("--lr", type=non_negative_float, default=0.1,
        help="peak learning rate of SGD (cosine schedule over the epochs)")
    add("--momentum", type=non_negative_float, default=0.9, help="SGD momentum")
    add("--weight-decay", type=non_negative_float, default=5e-4, help="SGD weight decay")
    add("--seed", type=int, default=0, help="seed of the weights, the data order and the augmentation")
    add("--workers", type=non_negative_int, default=4, help="DataLoader worker processes per rank")
    add("--loader", choices=["dataloader", "device"], default="dataloader",
        help="dataloader: --workers processes per rank load, crop and flip each image on the CPU; "
             "device: the whole set held on the training device, augmented there in batches, no worker "
             "processes (fastest on GPU). Both give the same batches")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when a GPU is visible")
    add("--output-dir", default=os.path.join("runs", name),
        help="where metrics.jsonl, checkpoint.pt and eval.json are written")
    add("--print-freq", type=positive_int, default=50, help="log progress every N steps (the only host syncs)")
    add("--no-augment", action="store_true", help="turn off random crop and horizontal flip")
    add("--evaluate", action="store_true",
        help="evaluate <output-dir>/checkpoint.pt on the test set, write eval.json, do not train")
    add("--save-every-steps", type=non_negative_int, default=0, metavar="N",
        help="also snapshot every N steps within an epoch (0: only at the end of each epoch)")
    add("--resume", default=None, metavar="PATH",
        help="continue from this snapshot (default: <output-dir>/checkpoint.pt, when there is one)")
    add("--restart", action="store_true",
        help="start afresh although <output-dir> holds a snapshot; the old one is kept, renamed")
    if distributed:
        add("--backend", choices=["auto", "nccl", "gloo"], default="auto",
            help="process-group backend; auto: nccl on GPU, gloo on CPU")
        add("--dist-timeout", type=positive_int, default=300, metavar="SECONDS",
            help="how long a collective waits for a missing rank before the run fails")
        add("--no-sync-bn", action="store_true",
            help="keep per-rank BatchNorm instead of converting it to SyncBatchNorm")
    speed.add_flags(parser, distributed)
    return parser


def add_spawn_flags(parser: Parser, default_nprocs_help: str) -> None:
    """Flags of the scripts that start their own processes with torch.multiprocessing.spawn."""
    add = parser.add_argument
    add("--nprocs", type=positive_int, default=None, help=default_nprocs_help)
    add("--nnodes", type=positive_int, default=1, help="number of machines taking part")
    add("--node-rank", type=non_negative_int, default=0, help="this machine's index, 0..nnodes-1")
    add("--ip", default="127.0.0.1", help="address of the machine with node rank 0 (the rendezvous)")
    add("--port", type=port_number, default=None, help="rendezvous port; default: a free port on one machine")
    add("--local-rank", type=int, default=None, help="set by torch.distributed.launch; LOCAL_RANK wins")


def parse(parser: Parser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(_dashes(sys.argv[1:] if argv is None else list(argv)))
    if getattr(args, "nnodes", 1) > 1 and args.port is None:
        parser.error("--port is required with --nnodes > 1 (every machine must name the same port)")
    if getattr(args, "node_rank", 0) >= getattr(args, "nnodes", 1):
        parser.error(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} for --nnodes {args.nnodes}")
    return args


def check_before_start(args) -> None:
    """Checks of the flags that need the file system or the network, before any process starts or any
    data loads, creating nothing: the output directory can be written (or made), and --ip resolves."""
    if not args.output_dir.strip():
        raise UsageError("--output-dir is empty; name a directory (default: runs/<script name>)")
    path = os.path.abspath(args.output_dir)
    existing = path
    while not os.path.exists(existing):  # the run makes the missing folders: the nearest existing one decides
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--output-dir {args.output_dir}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):  # a write, not os.access: root passes that on a read-only disk
            pass
    except OSError as error:
        raise UsageError(f"--output-dir {args.output_dir}: cannot write in {existing} ({error.strerror})") from None
    check_address(getattr(args, "ip", None))


def per_rank_batch(global_batch: int, world_size: int, what: str = "the world size") -> int:
    """The global batch split evenly over the ranks; an uneven split is a UsageError."""
    if global_batch % world_size:
        raise UsageError(f"--batch-size {global_batch} is not divisible by {what} ({world_size})")
    return global_batch // world_size


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0: torch.optim refuses negative ones, and NaN or inf would train to NaN."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {text}")
    return value
