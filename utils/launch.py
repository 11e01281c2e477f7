"""Launch plumbing: who this process is in the job, and where its ranks meet, for every way to start it.

torchrun (or torch.distributed.launch) describes each process in environment variables, srun in SLURM's,
torch.multiprocessing.spawn in --nnodes/--node-rank/--nprocs and the process index; `this_process`
reads whichever applies and returns plain values that the scripts pass to dist.init_process_group.
The rest checks a launch before any process starts, so that a wrong value is one line, not a hang.
"""
import contextlib
import datetime
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils import flags
from utils.errors import UsageError


@dataclass(frozen=True)
class Env:
    rank: int  # this process among all processes of the job
    local_rank: int  # this process among those of its machine; picks its GPU
    world_size: int  # number of processes of the job
    device: torch.device
    backend: str = "gloo"  # nccl on GPUs, gloo on the CPU
    store: dist.Store | None = None  # where the ranks meet to form the process group
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)  # --dist-timeout

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(flag: str) -> str:
    """'cuda' or 'cpu' for --device; asking for cuda without a visible GPU is a UsageError."""
    if flag == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no GPU is visible (check CUDA_VISIBLE_DEVICES); use --device cpu")
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return flag


def resolve_backend(flag: str, device_type: str) -> str:
    if flag == "nccl" and device_type != "cuda":
        raise UsageError("--backend nccl needs GPUs, and this run is on the CPU; use --backend gloo")
    if flag == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return flag


def check_launch(args, local_processes: int, gpu_count: int | None = None) -> None:
    """Everything about the launch that can be wrong before a process group exists."""
    device_type = resolve_device(args.device)
    backend = resolve_backend(args.backend, device_type)
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    if device_type == "cuda" and local_processes > gpus:
        raise UsageError(f"{local_processes} processes on this machine but only {gpus} GPU(s) visible; "
                         f"{backend} needs one GPU per process (lower --nprocs or use --device cpu)")


def this_process(args, local_rank: int | None = None) -> Env:
    """This process's place in the job, its device (made the current CUDA device) and the store where the
    ranks meet. local_rank=None: started by torchrun/launch/srun, the environment says who we are (a plain
    `python script.py` is a world of one). Otherwise: started by mp.spawn as process `local_rank`."""
    device_type = resolve_device(args.device)
    backend = resolve_backend(args.backend, device_type)
    flags.check_address(args.ip)
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    if local_rank is None and "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # srun started this process, no launcher: SLURM says who we are, node 0's first host hosts the store
        rank, world_size, local_rank = (int(os.environ[k]) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        addr, port = slurm_address(args)
        store = rendezvous(addr, port, rank, world_size, timeout, f"{world_size} SLURM tasks")
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank))  # so errors.report knows who speaks
    elif local_rank is None:
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", getattr(args, "local_rank", None) or 0))
        # the launcher's address; --ip/--port for launchers that set none
        addr = os.environ.get("MASTER_ADDR") or getattr(args, "ip", None)
        port = int(os.environ.get("MASTER_PORT") or getattr(args, "port", None) or 29500)
        if world_size > 1 and not addr:
            raise UsageError("WORLD_SIZE is set but MASTER_ADDR is not; start with torchrun or give --ip/--port")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = _agent_store(timeout)
        elif addr:
            store = rendezvous(addr, port, rank, world_size, timeout, f"WORLD_SIZE={world_size}")
        else:
            store = dist.HashStore()
    else:
        rank = args.node_rank * args.nprocs + local_rank
        world_size = args.nnodes * args.nprocs
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank))  # so errors.report knows who speaks
        shape = f"--nnodes {args.nnodes} --nprocs {args.nprocs}"
        store = rendezvous(args.ip, args.port, rank, world_size, timeout, shape)
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                         f"{backend} needs one GPU per process; start fewer processes or use --device cpu")
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL, and every .cuda() without an index, use this process's GPU
    return Env(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend,
               store=store, timeout=timeout)


def rendezvous(addr: str, port: int, rank: int, world_size: int, timeout, shape: str) -> dist.Store:
    """The job's store at addr:port, hosted by rank 0. Every process states the job's shape (for spawn:
    --nnodes and --nprocs); the first statement wins and a process that says otherwise stops, before
    any training, instead of waiting for ranks that will never come."""
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistError as error:
        reason = str(error).splitlines()[0][:120]
        if rank == 0:
            raise UsageError(f"cannot host the rendezvous on {addr}:{port} ({reason}); choose another --port") from None
        raise UsageError(f"could not reach the rendezvous at {addr}:{port} within {timeout.seconds} s ({reason}); "
                         "is node 0 started, are the address and port right and the port open?") from None
    agreed = store.compare_set("job-shape", "", shape).decode()
    if agreed != shape:
        raise UsageError(f"this machine was started with {shape}, another one with {agreed}; "
                         "start every machine with the same values")
    return dist.PrefixStore("job", store)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07', 'n[1-2]-ib' -> 'n1-ib'."""
    match = re.match(r"([^,\[]+)(?:\[([^-,\]]+)[^\]]*\]([^,]*))?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read the host names in SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, first, suffix = match.groups()
    return prefix + (first or "") + (suffix or "")


def slurm_address(args) -> tuple[str, int]:
    """Where srun's tasks meet: --ip/--port, else MASTER_ADDR/MASTER_PORT, else the node list's first
    host on a port that is the same for every task of the job and differs between jobs on a machine."""
    addr = getattr(args, "ip", None) or os.environ.get("MASTER_ADDR") or first_host(os.environ["SLURM_JOB_NODELIST"])
    port = (getattr(args, "port", None) or int(os.environ.get("MASTER_PORT", 0))
            or 29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000)
    return addr, port


def _agent_store(timeout) -> dist.Store:
    """torchrun's store, with a key prefix per restart attempt. The agent keeps one store across
    --max-restarts, and without the prefix a restarted rank can read the address a rank of the killed
    group published and fail to connect to it (a race; pytorch/pytorch#167288)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def launched_by_torchrun() -> bool:
    """torchrun (and torch.distributed.launch) export RANK and WORLD_SIZE to every worker."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def has_torchrun_agent() -> bool:
    """torchrun's agent started this process and waits for it (so its death means the run is orphaned)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def check_port_free(ip: str, port: int) -> None:
    """The rendezvous store listens on ip:port on node 0; a busy port would fail deep in c10d."""
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError as error:
            raise UsageError(f"cannot listen on {ip}:{port} ({error.strerror}); choose another --port") from None


def prepare_rendezvous(args) -> None:
    """On the machine that hosts the rendezvous, pick a free port (or check the given one)."""
    if args.node_rank == 0:
        if args.port is None:
            args.port = free_port(args.ip)
        else:
            check_port_free(args.ip, args.port)


def check_before_spawn(args) -> None:
    """Everything that can be wrong with a spawn launch, checked before any process starts: the job's
    shape against the GPUs, the batch split, --ip; on node 0, the rendezvous port
    (a free one if --port is not given)."""
    check_launch(args, local_processes=args.nprocs)
    flags.per_rank_batch(args.batch_size, args.nnodes * args.nprocs, getattr(args, "grad_accu_steps", 1))
    flags.check_address(args.ip)
    prepare_rendezvous(args)


def default_nprocs(device_flag: str) -> int:
    """One process per visible GPU; on the CPU two processes, enough to show DDP at work."""
    return torch.cuda.device_count() if resolve_device(device_flag) == "cuda" else 2


@contextlib.contextmanager
def spawn_errors():
    """mp.spawn stops the other processes when one fails; show that rank's error, not a wall."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process N"
    try:
        yield
    except mp.ProcessExitedException as error:
        if error.exit_code < 0:  # killed by a signal it could not handle (SIGKILL, a crash): say which
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        sys.exit(error.exit_code)  # an exit status of its own: bad input, divergence or a stop; it said why
    except mp.ProcessRaisedException as error:  # a rank raised: its traceback is in the message
        print(error, file=sys.stderr)
        sys.exit(1)
