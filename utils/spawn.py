"""The spawn scripts' parent process: the flags it completes and checks before mp.spawn starts any rank
(one line, not a hang, for a wrong value), and how it watches the ranks: their stop signals, a rank that failed."""
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys

import torch
import torch.multiprocessing as mp

from utils import flags, launch
from utils.errors import UsageError, exit_on_error, print_line


def add_spawn_flags(parser: flags.Parser) -> None:
    """Flags of the scripts that start their own processes with torch.multiprocessing.spawn."""
    group = flags.group(parser, "processes and devices")
    group.add_argument("--nprocs", type=flags.positive_int, default=None,
                       help="processes on this machine; default: one per visible GPU, or 2 on the CPU")
    group.add_argument("--nnodes", type=flags.positive_int, default=1, help="number of machines taking part")
    group.add_argument("--node-rank", type=flags.non_negative_int, default=0,
                       help="this machine's index, 0..nnodes-1")
    group.add_argument("--ip", default="127.0.0.1", help="address of the machine with node rank 0 (the rendezvous)")
    group.add_argument("--port", type=flags.port_number, default=None,
                       help="rendezvous port; default: a free port on one machine")
    group.add_argument("--local-rank", type=int, default=None, help="set by torch.distributed.launch; LOCAL_RANK wins")
    parser.checks.append(_machines_agree_on_the_port)


def _machines_agree_on_the_port(args) -> str | None:
    if args.nnodes > 1 and args.port is None:
        return "--port is required with --nnodes > 1 (every machine must name the same port)"
    if args.node_rank >= args.nnodes:
        return f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} for --nnodes {args.nnodes}"
    return None


def launched_by_torchrun() -> bool:
    """torchrun (and torch.distributed.launch) export RANK and WORLD_SIZE to every worker."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_launch(args, local_processes: int, gpu_count: int | None = None) -> None:
    """Everything about the launch that can be wrong before a process group exists."""
    device_type = launch.resolve_device(args.device)
    backend = launch.resolve_backend(args.backend, device_type)
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    if device_type == "cuda" and local_processes > gpus:
        raise UsageError(f"{local_processes} processes on this machine but only {gpus} GPU(s) visible; "
                         f"{backend} needs one GPU per process (lower --nprocs or use --device cpu)")


def check_port_free(ip: str, port: int) -> None:
    """The rendezvous store listens on ip:port on node 0; a busy port would fail deep in c10d. SO_REUSEADDR, as the
    store binds: the connections of a run that just ended there (TCP's TIME_WAIT, a minute) do not make it busy."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as error:
            raise UsageError(f"cannot listen on {ip}:{port} ({error.strerror}); choose another --port") from None


def free_port(ip: str = "127.0.0.1") -> int:
    """A port nobody listens on now (another process may take it before we do)."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def prepare_rendezvous(args) -> None:
    """On the machine that hosts the rendezvous, pick a free port (or check the given one)."""
    if args.node_rank == 0:
        if args.port is None:
            args.port = free_port(args.ip)
        else:
            check_port_free(args.ip, args.port)


def complete_and_check_spawn_flags(args) -> None:
    """Before any process starts: --nprocs filled in when not given (one per visible GPU, 2 on the CPU), then
    everything that can be wrong with a spawn launch checked (the job's shape against the GPUs, the batch
    split, --ip); on node 0, the rendezvous port checked, or a free one chosen when --port is not given. What is
    wrong: one line, exit status 2 (utils.errors.exit_on_error)."""
    with exit_on_error():
        args.nprocs = args.nprocs or default_nprocs(args.device)
        check_launch(args, local_processes=args.nprocs)
        # getattr: --grad-accu-steps is distributed_gradient_accumulation.py's own flag (the others step whole batches)
        flags.per_rank_batch(args.batch_size, args.nnodes * args.nprocs, getattr(args, "grad_accu_steps", 1))
        flags.check_address(args.ip)
        prepare_rendezvous(args)


def default_nprocs(device_flag: str) -> int:
    """One process per visible GPU; on the CPU two processes, enough to show DDP at work."""
    return torch.cuda.device_count() if launch.resolve_device(device_flag) == "cuda" else 2


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # those the ranks stop on (safety_net/stopping.py)


@contextlib.contextmanager
def supervising_the_ranks():
    """What torchrun's agent does for its workers, done by the spawn parent while mp.spawn runs the ranks: each stop
    signal to this process goes on to the ranks, which save and exit, and this one waits for them (killed, it would
    orphan them); mp.spawn stops the others when one fails, and that rank's error is shown, not a wall. A rank
    still importing when a signal comes dies of it: then this says so and exits as that rank did."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process N"
    forwarded = []

    def forward(signum, _frame):
        forwarded.append(signum)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        yield
    except mp.ProcessExitedException as error:
        if forwarded and error.exit_code == -forwarded[0]:  # the signal passed on killed a rank before it could stop
            print_line(f"stopped by {signal.Signals(forwarded[0]).name} while starting; nothing was trained, "
                       "no checkpoint written", error=False)
            sys.exit(128 + forwarded[0])
        if error.exit_code < 0:  # killed by a signal it could not handle (SIGKILL, a crash): say which
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        sys.exit(error.exit_code)  # an exit status of its own: bad input, divergence or a stop; it said why
    except mp.ProcessRaisedException as error:  # a rank raised: its traceback is in the message
        print(error, file=sys.stderr)
        sys.exit(1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
