"""Launch plumbing: who this process is in the job, and where its ranks meet, for every way to start it.

torchrun (or torch.distributed.launch) describes each process in environment variables, srun in SLURM's,
torch.multiprocessing.spawn in --nnodes/--node-rank/--nprocs and the process index (the spawn scripts set
torchrun's variables from those); `read_and_fill_environment` reads torchrun's variables and writes into
os.environ those a start left out, so that dist.init_process_group can read them too;
`torchrun_restart_store` is where the ranks meet after torchrun restarted them. The spawn scripts' parent has
its own module, utils/spawn.py.
"""
import contextlib
import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils import flags
from utils.errors import UsageError, print_line


@dataclass(frozen=True)
class Env:
    rank: int  # this process among all processes of the job
    local_rank: int  # this process among those of its machine; picks its GPU
    world_size: int  # number of processes of the job
    device: torch.device
    backend: str = "gloo"  # nccl on GPUs, gloo on the CPU
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


def read_and_fill_environment(args) -> Env:
    """Reads this process's place in the job from the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE),
    and its device and backend; and fills in os.environ: what dist.init_process_group reads from it (MASTER_ADDR,
    MASTER_PORT) is written where a start left it out: srun's tasks from SLURM's variables (RANK, WORLD_SIZE and
    LOCAL_RANK too), a launcher that sets no address from --ip/--port (and --local-rank), a plain
    `python script.py` as a world of one. Under an elastic torchrun whose next join would hang, it says so first."""
    with contextlib.suppress(OSError), open(f"/proc/{os.getppid()}/cmdline") as agent:  # torchrun's, under torchrun
        if joins_hang(os.environ, agent.read().split("\0")):
            print_line("warning: under torchrun --nnodes=MIN:MAX a machine that joins this job hangs the rendezvous "
                       "(torch's shared store); start every torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                       "(docs/fault_tolerance.md#machines-that-come-and-go)", error=False, local_rank_0_only=True)
    device_type = resolve_device(args.device)
    backend = resolve_backend(args.backend, device_type)
    flags.check_address(args.ip)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # srun started this process, no launcher: SLURM says who we are, node 0's first host hosts the store
        addr, port = slurm_address(args)
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ["SLURM_LOCALID"], MASTER_ADDR=addr, MASTER_PORT=str(port))
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    if not os.environ.get("MASTER_ADDR"):  # the launcher set no address: --ip/--port, or a world of one
        if world_size > 1 and not args.ip:
            raise UsageError("WORLD_SIZE is set but MASTER_ADDR is not; start with torchrun or give --ip/--port")
        os.environ["MASTER_ADDR"] = args.ip or "127.0.0.1"
        # a world of one meets only itself, on any free port (0); else where the other processes were sent
        os.environ["MASTER_PORT"] = str(args.port or (29500 if world_size > 1 else 0))
    os.environ.setdefault("MASTER_PORT", str(args.port or 29500))
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                         f"{backend} needs one GPU per process; start fewer processes or use --device cpu")
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    return Env(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend,
               timeout=datetime.timedelta(seconds=args.dist_timeout))


# torch 2.14.1 (dynamic_rendezvous.py's next_rendezvous): with the agents' TCPStore shared (the default,
# pytorch#128096) a round's MASTER_ADDR is written only by a rank 0 new to the job or newly rank 0 (pytorch#182375),
# so a machine that joins a running job waits for it until the store's wait times out, and both agents fail
def joins_hang(environ, agent: list[str]) -> bool:
    """Whether a machine joining this job would hang torchrun's rendezvous: its agents share their store
    (TORCHELASTIC_USE_AGENT_STORE; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns it off) and the agent's command line
    `agent` gives --nnodes as a range MIN:MAX, MIN < MAX (the last one given, as --nnodes=1:2 or --nnodes 1:2)."""
    nnodes = [word.split("=", 1)[1] if word.startswith("--nnodes=") else after
              for word, after in zip(agent, [*agent[1:], ""], strict=False) if word.split("=")[0] == "--nnodes"]
    low, _, high = (nnodes[-1] if nnodes else "").partition(":")
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and low != high != ""


def torchrun_restart_store(timeout) -> dist.Store | None:
    """The store= of dist.init_process_group: None (it then meets at MASTER_ADDR:MASTER_PORT as usual), except in
    ranks that torchrun restarted (--max-restarts; the safety net resumes them from the checkpoint): the agent's
    store with a key prefix per restart. The agent keeps one store across restarts, and without the prefix a
    restarted rank can read the address a rank of the killed group published and fail to connect to it (a race,
    seen here 2 times in 5; pytorch/pytorch#167288). `timeout`: the store's, --dist-timeout (env.timeout)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts == 0:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{restarts}", store)


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
    addr = args.ip or os.environ.get("MASTER_ADDR") or first_host(os.environ["SLURM_JOB_NODELIST"])
    port = (args.port or int(os.environ.get("MASTER_PORT", 0))
            or 29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000)
    return addr, port
