"""The parser every script uses, the groups of flags every script shares (each script adds those it reads), and the
checks that need no process group."""
import argparse
import math
import os
import re
import socket
import sys

from utils.errors import UsageError, exit_with_line, local_rank


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit status 2) instead of usage + error, and `checks`, the
    checks of several flags together, run by parse() after parsing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks = []  # functions of the parsed args: a message says what is wrong, None that all is well

    def error(self, message):  # every rank of torchrun (or task of srun) parses the flags: said once a machine
        exit_with_line(f"{message} (see --help)", UsageError.exit_status)

    def _print_message(self, message, file=None):  # --help, likewise: printed by local rank 0 alone
        if local_rank() == "0":
            super()._print_message(message, file)


def group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """argparse's argument group of this title, made by its first caller: several functions add flags to the shared
    groups ("training", "processes and devices", ...), and --help lists the groups in the order they were made."""
    for made in parser._action_groups:
        if made.title == title:
            return made
    return parser.add_argument_group(title)


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


def make_parser(doc: str, script: str) -> Parser:
    """An empty parser for `script`: the script adds its flags, group by group (its own first), then parses with
    parse()."""
    return Parser(
        prog=os.path.basename(script),
        description=" ".join(doc.strip().split("\n\n")[0].split()),  # the docstring's first paragraph
        epilog="Underscore spellings of the flags (--batch_size, --local_rank, ...) are accepted too.",
        formatter_class=HelpFormatter,
    )


def add_training_flags(parser: Parser) -> None:
    """The optimisation's flags, in the group "training": --epochs, --batch-size, --lr (None unless given: the script
    applies scaled_lr), --warmup-epochs, --momentum, --weight-decay, --clip-grad-norm, --seed."""
    train = group(parser, "training")
    train.add_argument("--epochs", type=positive_int, default=30, help="number of training epochs")
    train.add_argument("--batch-size", type=positive_int, default=256,
                       help="global batch size, summed over all processes/devices (per rank = global / world size)")
    train.add_argument("--lr", type=non_negative_float, default=None,
                       help="peak learning rate of SGD (cosine schedule over the epochs); default: 0.1 x --batch-size "
                            "/ 256, i.e. 0.1 at the default batch, scaled with the global batch (the linear scaling "
                            "rule)")
    train.add_argument("--warmup-epochs", type=non_negative_int, default=0, metavar="N",
                       help="raise the rate linearly from --lr/100 to --lr over the first N epochs, then the cosine "
                            "(as torchvision's --lr-warmup-epochs; global batches of thousands need it)")
    parser.checks.append(_warmup_leaves_a_cosine)
    train.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum")
    train.add_argument("--weight-decay", type=non_negative_float, default=5e-4, help="SGD weight decay")
    train.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="MAX",
                       help="scale each step's gradients down to a global norm of MAX where they exceed it (the "
                            "norm over every rank's, shard's and stage's, after unscaling and after the last "
                            "micro-batch); the safety net logs the norm before clipping (progress lines, "
                            "metrics.jsonl). Off by default")
    train.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and the augmentation")


def add_device_flags(parser: Parser, process_group: bool = True, sync_bn: bool = True) -> None:
    """--device, in the group "processes and devices"; `process_group` adds the flags of a script with one process
    per device: --backend, --dist-timeout and (unless not `sync_bn`: no BatchNorm spans ranks) --no-sync-bn."""
    procs = group(parser, "processes and devices")
    procs.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                       help="auto: cuda when a GPU is visible")
    if not process_group:
        return
    procs.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                       help="process-group backend; auto: nccl on GPU, gloo on CPU")
    procs.add_argument("--dist-timeout", type=positive_int, default=300, metavar="SECONDS",
                       help="how long a collective waits for a missing rank before the run fails")
    if sync_bn:
        procs.add_argument("--no-sync-bn", action="store_true",
                           help="keep per-rank BatchNorm instead of converting it to SyncBatchNorm")


def add_torchrun_flags(parser: Parser) -> None:
    """Flags of the scripts started by a launcher (torchrun, torch.distributed.launch, srun)."""
    procs = group(parser, "processes and devices")
    # The launcher tells each process who it is: torchrun sets LOCAL_RANK; torch.distributed.launch
    # also passes --local-rank=N (--local_rank before torch 2.0). The environment wins when both exist.
    procs.add_argument("--local-rank", type=int, default=None, help="set by torch.distributed.launch")
    procs.add_argument("--ip", default=None, help="rendezvous address (MASTER_ADDR) if the launcher sets none")
    procs.add_argument("--port", type=port_number, default=None,
                       help="rendezvous port (MASTER_PORT) if the launcher sets none")


def parse(parser: Parser, argv=None) -> argparse.Namespace:
    """The parsed flags, after every check the flag groups added (a failed one: its line, exit status 2)."""
    args = parser.parse_args(_dashes(sys.argv[1:] if argv is None else list(argv)))
    for check in parser.checks:
        if problem := check(args):
            parser.error(problem)
    return args


def _warmup_leaves_a_cosine(args) -> str | None:
    if args.warmup_epochs and args.warmup_epochs >= args.epochs:
        return f"--warmup-epochs {args.warmup_epochs} leaves no epoch of the cosine in --epochs {args.epochs}"
    return None


def scaled_lr(global_batch: int, base_lr: float = 0.1, base_batch: int = 256) -> float:
    """The default learning rate: base_lr at the global batch base_batch, in proportion to the batch (Goyal et
    al. 2017, "Accurate, Large Minibatch SGD"; the gradient of a batch twice as large is half as noisy)."""
    return base_lr * global_batch / base_batch


def per_rank_batch(global_batch: int, world_size: int, accu_steps: int = 1) -> int:
    """The global batch split evenly over the ranks (and each rank's share into `accu_steps` equal
    micro-batches); an uneven split is a UsageError."""
    if global_batch % world_size:
        raise UsageError(f"--batch-size {global_batch} is not divisible by the world size ({world_size})")
    if global_batch // world_size % accu_steps:
        raise UsageError(f"the per-rank batch ({global_batch // world_size}) is not divisible by "
                         f"--grad-accu-steps {accu_steps}")
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


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {text}")
    return value


def check_address(ip: str | None) -> None:
    """An --ip that does not resolve would fail deep in c10d, after the processes started."""
    if ip:
        try:
            socket.getaddrinfo(ip, None)
        except (socket.gaierror, UnicodeError) as error:
            reason = getattr(error, "strerror", None) or error
            raise UsageError(f"--ip {ip} does not resolve to an address ({reason})") from None
