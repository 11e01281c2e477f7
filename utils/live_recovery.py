"""Plumbing of distributed_live_recovery.py, the DDP script that trains on when a replica group dies (torchft).

Its flags (the lighthouse, this replica group, how many there are), the checks before a group starts (torchft
installed, the lighthouse answers, no live group has this group's id), torchft imported with quieter logs, where
this group's store is, and the manager's timeouts. What live recovery is made of (the manager, the gradient hook,
BatchNorm's statistics averaged between the groups, healing) stays in the script. Importing this module changes
nothing: torchft's logs are quieted by import_torchft_with_quiet_logs, when the script calls it.
"""
import datetime
import logging
import os
import re
import time
import urllib.error
import urllib.request
import warnings

import torch.distributed as dist

from utils.errors import UsageError
from utils.flags import non_negative_float, non_negative_int, positive_int

LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's default --bind port
HEARTBEATS_OVERDUE_S = 10.0  # how long a killed group's id may still look alive on the lighthouse
HEARTBEAT_FRESH_S = 1.0  # a live manager beats every 0.1 s; a group that stopped a moment ago is not marked old yet
WAIT_LINE_EVERY_S = 30.0  # how often a group waiting for the others says so


def add_flags(parser) -> None:
    """The flags of live recovery, in a group of their own; each defaults to the variable torchft's examples use."""
    group = parser.add_argument_group("live recovery (torchft)")
    group.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", f"http://localhost:{LIGHTHOUSE_PORT}"),
                       help="address of the lighthouse, the job's coordinator (start it first: torchft_lighthouse "
                            "--min_replicas 1); default: $TORCHFT_LIGHTHOUSE")
    group.add_argument("--replica-group", type=non_negative_int, metavar="ID",
                       default=os.environ.get("REPLICA_GROUP_ID", "0"),
                       help="this replica group's number, 0 to --replica-groups - 1: it picks the group's share of "
                            "the data and its folder <output-dir>/replica_group_<ID>; default: $REPLICA_GROUP_ID")
    group.add_argument("--replica-groups", type=positive_int, metavar="N",
                       default=os.environ.get("NUM_REPLICA_GROUPS", "2"),
                       help="how many replica groups the job has at most (the data is dealt into N shares); "
                            "default: $NUM_REPLICA_GROUPS")
    group.add_argument("--min-replica-groups", type=positive_int, default=1, metavar="N",
                       help="a step updates the weights only while at least N groups take part in it (fewer: "
                            "its batches are skipped); to have the live groups wait instead, start the lighthouse "
                            "with --min_replicas N")
    group.add_argument("--wait-for-groups", type=non_negative_float, default=300.0, metavar="S",
                       help="a group continuing from its checkpoint first waits up to S seconds for as many groups "
                            "as took part in its last step: trained on alone, it could reach the step another's "
                            "checkpoint holds, on other weights, and torchft heals only a group behind; 0: no wait")
    parser.checks.append(_why_not)


def _why_not(args) -> str | None:
    try:
        import torchft  # noqa: F401  (the script imported it first, with quiet logs: import_torchft_with_quiet_logs)
    except ImportError:
        return "torchft is not installed: pip install torchft (PyTorch's fault-tolerance library)"
    if args.replica_group >= args.replica_groups:
        return (f"--replica-group {args.replica_group} is not below --replica-groups {args.replica_groups}: "
                f"number the groups 0 to {args.replica_groups - 1}")
    if args.min_replica_groups > args.replica_groups:
        return f"--min-replica-groups {args.min_replica_groups} is more than --replica-groups {args.replica_groups}"
    if not re.fullmatch(r"https?://[^/\s]+/?", args.lighthouse):
        return f"--lighthouse {args.lighthouse!r} is not an address like http://host:{LIGHTHOUSE_PORT}"
    return None


def check_lighthouse(args) -> None:
    """Before the process group (a UsageError, one line): the lighthouse answers, and no live replica group has
    this --replica-group. A group that was just killed still shows on the lighthouse until its heartbeats are
    overdue (torchft_lighthouse --heartbeat_timeout_ms, 5 s by default): waits up to HEARTBEATS_OVERDUE_S.
    --evaluate needs no lighthouse: nothing is checked."""
    if args.evaluate:
        return
    deadline = time.monotonic() + HEARTBEATS_OVERDUE_S
    while args.replica_group in live_replica_groups(args.lighthouse):
        if time.monotonic() > deadline:
            raise UsageError(f"replica group {args.replica_group} is already training (the lighthouse at "
                             f"{args.lighthouse} has its heartbeats): give each group its own --replica-group")
        time.sleep(0.5)


def live_replica_groups(lighthouse: str, seen_within_s: float | None = None) -> set[int]:
    """The replica groups whose heartbeats the lighthouse has now, read from its status page (torchft's
    dashboard: replica ids "<group>:<uuid>", an overdue one marked old); seen_within_s: only those heard from
    that recently. No lighthouse there is a UsageError."""
    url = lighthouse.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            page = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise UsageError(f"no lighthouse answers at {lighthouse} ({reason}); start one first: torchft_lighthouse "
                         f"--min_replicas 1 --bind [::]:{LIGHTHOUSE_PORT}") from None
    beats = re.findall(r'class="heartbeat\s+(old\s+)?">\s*(\d+):\S*: seen ([\d.]+)(ns|µs|us|ms|s) ago', page)
    return {int(group) for old, group, age, unit in beats
            if not old and (seen_within_s is None or float(age) * _SECONDS[unit] <= seen_within_s)}


_SECONDS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}  # the lighthouse writes Rust's Duration


def wait_for_replica_groups(lighthouse: str, groups: int, wait_s: float, *, is_main: bool, stop) -> None:
    """Every rank of a group continuing from its checkpoint, before its first quorum (HTTP, no collective): until
    `groups` replica groups, this one included, beat on the lighthouse, at most wait_s seconds (--wait-for-groups);
    rank 0 says so every WAIT_LINE_EVERY_S. stop(): a stop signal came (the first step then stops the run)."""
    started = time.monotonic()
    said = None
    while len(live := live_replica_groups(lighthouse, seen_within_s=HEARTBEAT_FRESH_S)) < groups and not stop():
        waited = time.monotonic() - started
        if waited >= wait_s:
            if is_main:
                print(f"training without the {groups - len(live)} missing replica group(s) after --wait-for-groups "
                      f"{wait_s:g} s", flush=True)
            return
        if is_main and (said is None or waited - said >= WAIT_LINE_EVERY_S):
            print(f"waiting for {groups - len(live)} more replica group(s) before the first step ({waited:.0f} s of "
                  f"--wait-for-groups {wait_s:g}): the checkpoint's last step had {groups}, and one that trained on "
                  f"alone could reach the step another's checkpoint holds, on other weights", flush=True)
            said = waited
        time.sleep(0.5)


def import_torchft_with_quiet_logs():
    """torchft, or None when it is not installed (the flags' check then says so in one line), imported with: its
    coordinator's (Rust) logs at warnings and errors unless RUST_LOG says otherwise (at INFO it logs every step's
    quorum, three lines a step; read once, at the import), a lost peer logged in one line without a traceback per
    failed all-reduce, and no warning that a healing group reads the state from a bytes buffer (torch warns that it
    is not writable; nothing writes to it)."""
    os.environ.setdefault("RUST_LOG", "warn")
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    logging.getLogger("torchft.manager").addFilter(_NoTracebacks())
    try:
        import torchft
    except ImportError:
        return None
    return torchft


class _NoTracebacks(logging.Filter):
    """torchft logs a lost peer with a traceback per failed all-reduce; its one line says enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = None
        return True


def store_of_this_group() -> dict:
    """Manager's store_addr and store_port: the store this group's process group met at (torchrun's, or the one a
    world of one made on a free port). Other groups reach it there to form the quorum's process group, so on
    several machines MASTER_ADDR must be this machine's address (torchrun --rdzv-endpoint=<host>:<port>)."""
    store = dist.distributed_c10d._get_default_store()  # no public accessor; the port a world of one picked
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return {"store_addr": os.environ["MASTER_ADDR"], "store_port": store.port}


def timeouts(env) -> dict:
    """Manager's timeouts: a collective, a commit or a heal waits --dist-timeout; joining a quorum as long."""
    return {"timeout": env.timeout, "quorum_timeout": env.timeout, "connect_timeout": datetime.timedelta(seconds=30)}
