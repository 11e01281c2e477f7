"""Each strategy over a link of known speed: two hosts, one rank each, the link between them shaped to a list of rates.

    python -m benchmarks.network --quick            # 2 rates, per-rank batch 8, fewer rows: a check of every path
    python -m benchmarks.network                    # 5 rates, 4 timed steps a run (7 at the first rate)
    python -m benchmarks.network --rates 100mbit,30mbit --only DDP,fp16     # some rates, some rows

It needs root and iproute2 (network namespaces, tc) and taskset; without them it says so in one line, exit status 2.
The two hosts are network namespaces joined by a veth pair (tests/test_multinode.py uses them too), each running one
rank of the job pinned to a core of its own (taskset), one thread each; tc's token bucket (tbf) on both ends of the
link holds each direction to the rate. Each row runs a real script with its own flags, through torchrun, a launcher
on each host (two nodes of one process, the rendezvous on host 0), on CIFAR-100-shaped synthetic data at the CPU
benchmark's per-rank batch (benchmarks.run: 32; 8 with --quick), float32. Each run is two epochs of --steps + 1 steps
(three at the first rate, below): the first is warm-up (PowerSGD all-reduces in full through it and compresses from
the second); timed are the second epoch's steps after its first (--steps of them), each the time between two of rank
0's progress lines (--print-freq 1) as they reach this program: forward, backward, the communication the step waits
for, the optimizer's step and the safety net's small all-reduces (its stop flag, the line's loss), no evaluation
and no start-up. As each line arrives, this program reads how many bytes each host's interface has sent
(/proc/<launcher pid>/net/dev, in the host's namespace): the bytes of the timed steps.

At the first (fastest) rate each row also runs a third epoch and records steps 3 to --steps + 3 with --profile-steps:
the collectives of the last of them (the second epoch's second step), read from the traces as tools/timeline.py reads
them, and the bytes they make each host send (by how gloo runs them for 2 ranks), to set beside the counters. There the
timed steps are those after the recorded ones, each epoch's first left out: the second epoch's last --steps - 1 and the
third epoch's last --steps (7 with the default 4). Compute alone is the bare step (benchmarks/bare_step.py --phases: the
same per-rank batch, no process group, its forward, backward and optimizer's step timed apart), one process pinned on
each host's core, both at once. The link's limit at a rate is max(compute alone, the bytes the busier host sends per
step / rate); each row's floor counts what cannot overlap (floor_s): where its all-reduces hide only behind the backward
(DDP), the forward and the optimizer's step are added to the longer of the backward and the bytes' time; where nothing
hides them (one bucket after the backward, DiLoCo's round), compute alone and the bytes' time add up. Step / floor is
what each row is judged by. The DiLoCo rows run one epoch of 2H + 1 steps, a progress line every H steps, and are
timed over their second round (timed_round): the mean step of a whole round, its all-reduce included. Then a
--profile-steps timeline of DDP at the rate where its bytes take as long as its backward (tools.timeline's lanes, into
timeline.png; the small all-reduces that start in each recorded backward, SyncBatchNorm's, counted and timed), and
what each compression and DiLoCo row costs in learning: the loss after the same steps on the learnable synthetic set,
beside DDP's and DDP's with another seed (two ranks on this machine, unshaped: the loss does not depend on the
link).

Writes <output-dir>/network.md (the tables), network.json and network.png (step time against rate); the tables after
every row, so a run stopped (Ctrl-C, SIGTERM, SIGHUP) keeps the rows it measured, marked unfinished. Nothing is left
behind: the namespaces are deleted (their link and its qdiscs with them) and every process in them ended. The tables
are made from network.json alone (markdown(); doc_with_figures() for a page's part between DOC_MARKS), so a page's
figures can be checked against the json without running anything.
"""
import argparse
import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks import harness
from examples.local_processes import alive
from tools import timeline
from utils import flags
from utils.errors import UsageError, exit_on_error

MB = 2**20
RATES, QUICK_RATES = "unshaped,1gbit,300mbit,100mbit,30mbit", "unshaped,300mbit"
QUICK_ROUND = 4  # --quick: DiLoCo's rows timed over rounds of this many steps (2 x 4 + 1 a run, not 33)
INTERFACES = ("veth-a", "veth-b")  # host 0's end of the link, host 1's
ADDRESSES = ("10.231.1.1", "10.231.1.2")  # inside the namespaces: no clash with this machine's own
PROGRESS = re.compile(r"epoch (\d+)/\d+ step (\d+)/\d+ ")  # rank 0's line after each step (--print-freq 1)
# the bytes one of 2 ranks sends for a collective of the size a trace gives it, by what gloo ran: an all-reduce's ring
# sends its size (half in the reduce-scatter, half in the all-gather), an all-gather's size is the rank's own input, a
# broadcast is sent by its source alone (the trace does not say which rank: half each); a recv sends nothing
WIRE_SHARE = {"all_reduce": 1.0, "all_gather": 1.0, "broadcast": 0.5, "send": 1.0, "reduce_scatter": 0.5}
TIMELINE_ROW = "DDP"  # the row drawn at the rate where its communication takes as long as its backward
# the tables call a row faster or slower than DDP at a rate only where the two median steps differ by more than this
# share of DDP's; within it, "the same". A fixed margin, chosen: network.json keeps each run's median step, not the
# spread of its few timed steps, so the noise cannot be measured from it
SAME_WITHIN = 0.03
PHASES = ("forward_s", "backward_s", "optimizer_s")  # compute alone's, timed apart (bare_step --phases)


def rows() -> list[harness.Row]:
    """The strategies, each a script with its own flags, as benchmarks.run's rows run them."""
    def row(name, script, *extra, full_only=False):  # full_only: left out of --quick (another flag of a path in it)
        return harness.Row(name, script, "torchrun", list(extra), table="network", full_only=full_only)
    return [
        row("DDP", "distributed.py"),
        # one bucket for all 43 MB of gradients (the first bucket too, once the size is given): DDP starts a bucket's
        # all-reduce when its last gradient is ready, so this one starts when the backward ends: no overlap
        row("DDP, one bucket after the backward", "distributed.py", "--bucket-cap-mb", "64"),
        row("DDP, no SyncBatchNorm", "distributed.py", "--no-sync-bn", full_only=True),
        row("DDP + fp16 compression", "distributed.py", "--comm-hook", "fp16"),
        row("DDP + bf16 compression", "distributed.py", "--comm-hook", "bf16", full_only=True),
        row("DDP + PowerSGD (rank 2)", "distributed.py", "--comm-hook", "powersgd"),
        row("gradient accumulation (k=4)", "distributed_gradient_accumulation.py", "--grad-accu-steps", "4"),
        row("ZeRO-1", "distributed_zero.py"),
        row("FSDP", "distributed_fsdp.py", "--opt-level", "O0"),
        # HSDP across the two hosts: 2 replicas of one shard each (a machine of one rank has nothing to shard over)
        row("HSDP (2 replicas of 1 shard)", "distributed_fsdp.py", "--opt-level", "O0", "--replicas", "2"),
        row("Pipeline (2 stages, 1F1B, 4 micro-batches)", "distributed_pipeline.py"),
        # a round every H steps: one epoch of 2H + 1 steps, timed over the second round (timed_round)
        row("DiLoCo (H=16)", "distributed_diloco.py", "--sync-every", "16"),
        row("DiLoCo (H=64)", "distributed_diloco.py", "--sync-every", "64", full_only=True),
        row("DiLoCo (H=16), round overlapped", "distributed_diloco.py", "--sync-every", "16", "--overlap-round"),
    ]


# the rows whose every update is DDP's, up to the order of summation (ZeRO-1 and FSDP: tests/test_scripts_equal.py;
# HSDP: tests/test_fsdp.py; one bucket is DDP itself with another bucket size)
DDP_UPDATES = {"DDP", "DDP, one bucket after the backward", "ZeRO-1", "FSDP", "HSDP (2 replicas of 1 shard)"}


def sync_every(row: harness.Row) -> int | None:
    """A DiLoCo row's H (its --sync-every); None for the others."""
    return int(row.flags[row.flags.index("--sync-every") + 1]) if row.script == "distributed_diloco.py" else None


def floor_kind(name: str) -> str:
    """Which floor applies to the row `name` (floor_s): "backward" where its all-reduces can hide behind the backward
    alone (DDP's buckets; ZeRO-1's and accumulation's, their DDP, for which it is lower than they can reach: ZeRO-1's
    broadcasts follow the optimizer's step, accumulation overlaps only its last micro-batch's backward), "none" where
    nothing hides them (one bucket after the backward; DiLoCo's round, waited for at its end), "link" where they may
    hide behind the whole step (FSDP's and HSDP's all-gathers in the forward too, the pipeline's sends, the overlapped
    round) or the row is unknown."""
    row = next((r for r in rows() if r.name == name), None)
    if row is None:
        return "link"
    if row.script == "distributed_diloco.py":
        return "link" if "--overlap-round" in row.flags else "none"
    if "--bucket-cap-mb" in row.flags:
        return "none"
    backward = ("distributed.py", "distributed_zero.py", "distributed_gradient_accumulation.py")
    return "backward" if row.script in backward else "link"


def parse_rates(text: str) -> list[dict] | str:
    """The rates of --rates, the fastest first (unshaped before all), each {"tc": tc's word or None, "bps": bits per
    second or None, "label"}; or why the text is not a list of rates."""
    rates = []
    for word in (w.strip().lower() for w in text.split(",")):
        if word == "unshaped":
            rates.append({"tc": None, "bps": None, "label": "unshaped"})
            continue
        found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", word)
        bps = float(found[1]) * {"k": 1e3, "m": 1e6, "g": 1e9}[found[2]] if found else 0
        if bps < 1e6:
            return (f"--rates: {word!r} is not a rate of 1 Mbit/s or more (unshaped, or a number and kbit, mbit or "
                    "gbit, as tc writes them: 300mbit, 1gbit)")
        rates.append({"tc": word, "bps": bps, "label": rate_label(bps)})
    labels = [r["label"] for r in rates]
    if len(set(labels)) < len(labels):
        return f"--rates: {text!r} names a rate twice"
    return sorted(rates, key=lambda r: -(r["bps"] or float("inf")))


def rate_label(bps: float) -> str:
    """1 Gbit/s, 300 Mbit/s: a rate as the tables name it (1 Mbit/s or more)."""
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def tx_bytes(pid: int, interface: str) -> int:
    """The bytes `interface` has sent, as the network namespace of process `pid` sees it (/proc/<pid>/net/dev: this
    program stays in its own namespace, where the interface is not)."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # receive: 8 counters, then transmit's bytes
    raise OSError(f"process {pid} sees no {interface}")


class TwoHosts:
    """Two network namespaces joined by a veth pair (tests/test_multinode.py uses them too): host i has address
    ADDRESSES[i] on its end INTERFACES[i], and runs its commands pinned to a core of its own. On exit every process
    still in them is killed and both are deleted: their link and its qdiscs go with them."""

    def __init__(self, prefix: str = "ddp-network", named: bool = False):
        """named: each host has a hostname of its own (HOSTNAMES[i], known to both), as two machines do; else both
        have this machine's, which resolves to each one's own loopback (torchft advertises its servers by it)."""
        self.names = [f"{prefix}-{os.getpid()}-{i}" for i in (0, 1)]
        self.hostnames = [f"{prefix}-host-{i}" for i in (0, 1)] if named else None
        self.cores = host_cores()
        self.made = []

    def __enter__(self):
        tools = ("ip", "tc", "taskset") + (("unshare",) if self.hostnames else ())
        missing = [tool for tool in tools if shutil.which(tool) is None]
        if os.geteuid() != 0 or missing:
            raise UsageError("two hosts on one machine need root (network namespaces, tc) and " +
                             (f"{', '.join(missing)}, missing here" if missing else "iproute2 and taskset") +
                             ": run it as root, or on a machine where you are")
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self.made.append(name)
            _ip("link", "add", INTERFACES[0], "netns", self.names[0], "type", "veth", "peer", "name", INTERFACES[1],
                "netns", self.names[1])
            for name, interface, address in zip(self.names, INTERFACES, ADDRESSES, strict=True):
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
                _ip("-n", name, "link", "set", interface, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if self.hostnames:  # `ip netns exec` shows each namespace /etc/netns/<name>/hosts as /etc/hosts
                    os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                    with open(f"/etc/netns/{name}/hosts", "w") as hosts:
                        hosts.write("127.0.0.1 localhost\n" + "".join(
                            f"{address} {hostname}\n" for address, hostname in zip(ADDRESSES, self.hostnames,
                                                                                  strict=True)))
        except subprocess.CalledProcessError as error:
            self.__exit__()
            raise UsageError(f"cannot make two network namespaces here: {error.stderr.strip()}") from None
        return self

    def __exit__(self, *exc):
        for name in self.made:
            pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()]
            for pid in pids:  # ours: nothing else runs in a namespace this program made
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while alive(pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self.made = []

    def shape(self, rate: dict, burst: str = "256kb", latency: str = "100ms") -> None:
        """Both directions held to the rate by a token bucket on each end of the link (tc's tbf: `burst` the bucket's
        size, `latency` how long a packet may wait in its queue before it is dropped); unshaped: none."""
        for name, interface in zip(self.names, INTERFACES, strict=True):
            if rate["tc"] is None:  # none there yet: tc says so, and that is fine
                subprocess.run(["tc", "-n", name, "qdisc", "del", "dev", interface, "root"], capture_output=True)
                continue
            shaped = subprocess.run(["tc", "-n", name, "qdisc", "replace", "dev", interface, "root", "tbf", "rate",
                                     rate["tc"], "burst", burst, "latency", latency], capture_output=True, text=True)
            if shaped.returncode:
                raise UsageError(f"tc cannot shape the link to {rate['label']} here: {shaped.stderr.strip()}")

    def set_link(self, up: bool) -> None:
        """The link between the hosts down (as a pulled cable: nothing passes, no connection is reset) or up again."""
        _ip("-n", self.names[0], "link", "set", INTERFACES[0], "up" if up else "down")

    def prefix(self, host: int) -> list[str]:
        """What runs a command on `host`: in its namespace (named: under its hostname), on its core."""
        named = (["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[host]]
                 if self.hostnames else [])
        return ["ip", "netns", "exec", self.names[host], *named, "taskset", "-c", str(self.cores[host])]

    @staticmethod
    def env(host: int) -> dict:
        """A rank on `host`: one thread (the host is one core), gloo on the host's end of the link."""
        return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": INTERFACES[host]}

    def sent(self, pids: list[int]) -> list[int]:
        """The bytes each host has sent so far, read through a process of each (`pids`: one in each namespace)."""
        return [tx_bytes(pid, interface) for pid, interface in zip(pids, INTERFACES, strict=True)]


def host_cores() -> list[int]:
    """The core of each host: the first two this process may run on (the same one twice on a machine of one)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i % len(cores)] for i in (0, 1)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def workload(args, steps_per_epoch: int, epochs: int, out: str) -> list[str]:
    """The flags of every run: the synthetic set cut to `steps_per_epoch` steps of the global batch, one progress line
    a step (its clock and the counters' reading), no DataLoader workers (the rank's core computes)."""
    global_batch = 2 * args.batch_size
    return ["--device", "cpu", "--dataset", "synthetic", "--train-samples", str(steps_per_epoch * global_batch),
            "--test-samples", str(global_batch), "--batch-size", str(global_batch), "--epochs", str(epochs),
            "--workers", "0", "--print-freq", "1", "--output-dir", out]


def run_on_two_hosts(hosts: TwoHosts, row: harness.Row, script_flags: list[str], port: int, limit_s: float):
    """The row's script on both hosts (torchrun, two nodes of one process), and rank 0's progress lines, each as
    (arrival time, epoch, step, the bytes each host had sent); the result's stderr is that of a host that failed.
    Stopped (Ctrl-C, SIGTERM) or past `limit_s`: each launcher gets SIGTERM, which it passes to its rank, and up to
    60 s to exit (then SIGKILL, to its whole session)."""
    commands = [hosts.prefix(host) + [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                                      f"--node_rank={host}", "--nproc_per_node=1", f"--master_addr={ADDRESSES[0]}",
                                      f"--master_port={port}", *harness.launch_target(row.script)] + script_flags
                for host in (0, 1)]
    errors = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen(command, cwd=harness.ROOT, stdout=subprocess.PIPE if host == 0 else subprocess.DEVNULL,
                              stderr=errors[host], text=True, start_new_session=True, env=hosts.env(host))
             for host, command in enumerate(commands)]
    lines = []

    def read_progress():
        for text in procs[0].stdout:
            arrived = time.perf_counter()
            if found := PROGRESS.match(text):
                with contextlib.suppress(OSError):  # a launcher that has just ended: no reading
                    lines.append((arrived, int(found[1]), int(found[2]), hosts.sent([p.pid for p in procs])))

    reader = threading.Thread(target=read_progress, daemon=True)
    reader.start()
    late = False
    try:
        deadline = time.monotonic() + limit_s
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        late = True
        harness.stop(procs, grace_s=60)  # each launcher passes SIGTERM to its rank
    except KeyboardInterrupt:
        harness.stop(procs, grace_s=60)  # each launcher passes SIGTERM to its rank
        raise
    finally:
        reader.join(10)
        if not reader.is_alive():
            procs[0].stdout.close()
        said = []
        for error in errors:
            error.seek(0)
            said.append(error.read())
            error.close()
    failed = next((host for host, proc in enumerate(procs) if proc.returncode), 0)
    code = 124 if late else procs[failed].returncode
    return subprocess.CompletedProcess(commands[0], code, "", said[failed]), lines


def timed(lines: list, steps_per_epoch: int, after_step: int = 0) -> dict | None:
    """The median step time and the bytes each host sent per step over the timed steps: those of the second epoch and
    later after each epoch's first (the first step's time holds the evaluation and checkpoint before it), and after
    global step `after_step` (the recorded steps of --profile-steps, the last of which writes the traces)."""
    seconds, sent = [], [0, 0]
    for (t0, epoch0, step0, sent0), (t1, epoch1, step1, sent1) in itertools.pairwise(lines):
        if epoch1 >= 2 and epoch1 == epoch0 and step1 == step0 + 1 and \
                (epoch0 - 1) * steps_per_epoch + step0 >= after_step:
            seconds.append(t1 - t0)
            sent = [s + b - a for s, a, b in zip(sent, sent0, sent1, strict=True)]
    if not seconds:
        return None
    return {"step_s": statistics.median(seconds), "steps_timed": len(seconds),
            "sent_mb": [s / len(seconds) / MB for s in sent]}


def timed_round(lines: list, h: int) -> dict | None:
    """A DiLoCo row's mean step over a whole round, its all-reduce included: from rank 0's line after step H (the
    first round's end) to its line after step 2H (the second's; the epoch's last step, 2H + 1, ends a round of one,
    which waits for the round in flight), divided by H; the bytes each host sent over them, per step."""
    at = {step: (t, sent) for t, epoch, step, sent in lines if epoch == 1}
    if h not in at or 2 * h not in at:
        return None
    (t0, sent0), (t1, sent1) = at[h], at[2 * h]
    return {"step_s": (t1 - t0) / h, "steps_timed": h, "sent_mb": [(b - a) / h / MB for a, b in zip(sent0, sent1,
                                                                                                   strict=True)]}


def collectives_of_step(lanes: list[timeline.Lane], label: str) -> dict:
    """The collectives of the recorded step `label` ("step 7"): their calls on rank 0 (named as asked, and as gloo ran
    them where it differs) and the MB each rank sends for them (WIRE_SHARE), and rank 0's backward time."""
    calls, sent, backward = Counter(), [], 0.0
    for lane in lanes:
        start, end, _ = next(s for s in lane.steps if s[2] == label)
        mine = [c for c in lane.collectives if start <= c.start < end]
        sent.append(sum(c.size * WIRE_SHARE.get(c.ran, 0.0) for c in mine) / MB)
        if lane is lanes[0]:
            calls = Counter(c.asked if c.asked == c.ran else f"{c.asked} (as {c.ran})" for c in mine)
            backward = timeline._length([(max(s, start), min(e, end)) for s, e in lane.compute.get("backward", [])
                                         if e > start and s < end]) / 1000
    return {"calls": dict(sorted(calls.items())), "sent_mb": sent, "backward_s": backward}


def measure_row(hosts: TwoHosts, row: harness.Row, rate: dict, args, port: int, count: bool) -> dict:
    """One row at one rate (already shaped): its step time and bytes; with `count`, a third epoch and the collectives
    of one recorded step (--profile-steps) too."""
    steps_per_epoch, epochs = args.steps + 1, 3 if count else 2
    if h := sync_every(row):  # DiLoCo: one epoch of 2H + 1 steps, its second round timed; no collectives counted
        h = min(h, QUICK_ROUND) if args.quick else h  # --quick: rounds of 4 (a check of the path, in a third the steps)
        steps_per_epoch, epochs, count = 2 * h + 1, 1, False
    # the recorded steps 3 .. steps_per_epoch + 2: the last is the second epoch's second (PowerSGD compresses there)
    profiled = steps_per_epoch + 2 if count else 0
    # generous: five times the compute, twice 100 MB a step over the link, and start-up
    limit = 300 + steps_per_epoch * epochs * (5 * args.compute_s + 2 * 100 * MB * 8 / (rate["bps"] or 1e10))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        # DiLoCo: a progress line every H steps, as its timing needs: a line's loss all-reduce each step would cross
        # the link each step, which a user's run (--print-freq 50) does not
        script_flags = workload(args, steps_per_epoch, epochs, out) + row.flags + (
            ["--sync-every", str(h), "--print-freq", str(h)] if h else []) + (
            ["--profile-steps", str(steps_per_epoch)] if count else [])
        result, lines = run_on_two_hosts(hosts, row, script_flags, port, limit)
        if result.returncode:
            return {"error": f"still running after {limit:.0f} s: stopped" if result.returncode == 124 else
                    harness.why_it_failed(result.stderr)}
        measured = timed_round(lines, h) if h else timed(lines, steps_per_epoch, profiled)
        if measured is None:
            return {"error": f"no timed steps among {len(lines)} progress lines"}
        if count:
            measured["collectives"] = collectives_of_step(timeline.read_run(Path(out)), f"step {profiled}")
    # wall_s: the whole run; start_s: until rank 0's first step was done (start-up, rendezvous, the model built)
    return {**measured, "wall_s": time.perf_counter() - started, "start_s": lines[0][0] - started}


def compute_alone(args) -> dict:
    """The bare step of the per-rank batch, one process pinned on each host's core, both at once: the mean of their
    times per step (no process group, no communication; the machine's two cores as busy as in the rows)."""
    command = [sys.executable, "-m", "benchmarks.bare_step", "--device", "cpu", "--batch-size", str(args.batch_size),
               "--steps", str(max(3, args.steps)), "--warmup", "2", "--phases"]
    printed = harness.last_json_lines([["taskset", "-c", str(core), *command] for core in host_cores()],
                                        [{**os.environ, "OMP_NUM_THREADS": "1"}] * 2)
    if printed is None:
        raise UsageError("the bare step failed; run python -m benchmarks.bare_step --device cpu to see why")
    rates = [p["images_per_s"] for p in printed]
    return {"step_s": statistics.mean(args.batch_size / r for r in rates),
            **{phase: statistics.mean(p[phase] for p in printed) for phase in PHASES},
            "command": shlex.join(["python", *command[1:]])}


def balanced_rate(collectives: dict) -> dict | None:
    """The rate at which the busier host's bytes of a step take as long as rank 0's backward, to 2 digits in Mbit/s."""
    if not collectives or not collectives["backward_s"]:
        return None
    bps = max(collectives["sent_mb"]) * MB * 8 / collectives["backward_s"]
    mbit = float(f"{bps / 1e6:.2g}")
    return {"tc": f"{mbit:g}mbit", "bps": mbit * 1e6, "label": rate_label(mbit * 1e6)}


def draw_timeline(hosts: TwoHosts, row: harness.Row, rate: dict, args, port: int, out: Path) -> dict:
    """`row` at `rate`: 2 steps of warm-up and 2 recorded (--profile-steps 2), drawn into out/timeline.png."""
    hosts.shape(rate)
    with tempfile.TemporaryDirectory() as run_dir:
        script_flags = workload(args, 4, 1, run_dir) + row.flags + ["--profile-steps", "2"]
        result, _ = run_on_two_hosts(hosts, row, script_flags, port, 600 + 20 * args.compute_s)
        if result.returncode:
            return {"rate": rate["label"], "error": harness.why_it_failed(result.stderr)}
        lanes = timeline.read_run(Path(run_dir))
    title = f"{row.script} {' '.join(row.flags)}".strip() + f": 2 recorded steps, 2 hosts at {rate['label']}"
    timeline.draw(lanes, title, out / "timeline.png")
    return {"rate": rate["label"], "row": row.name, "picture": "timeline.png", "summary": timeline.summary_text(lanes),
            "small_in_backward": small_in_backward(lanes)}


def small_in_backward(lanes: list[timeline.Lane], under: int = 64 * 1024) -> list[dict]:
    """For each rank and recorded step, the all-reduces of under `under` bytes that started within its backward's span
    (from its first backward operator to its last): in DDP with SyncBatchNorm its layers' gradient sums, on a group of
    their own, so their time is not a wait behind the buckets on gloo's threads: the link's, or the other rank's arrival
    (DDP's buckets here are 8 MB and up). Each: the rank, the step, how many and their summed time in s (each blocks its
    layer's backward)."""
    found = []
    for lane in lanes:
        for start, end, label in lane.steps:
            backward = [(s, e) for s, e in lane.compute.get("backward", []) if start <= s < end]
            first, last = (min(s for s, _ in backward), max(e for _, e in backward)) if backward else (end, end)
            mine = [c for c in lane.collectives
                    if c.asked == "all_reduce" and c.size < under and first <= c.start < last]
            found.append({"lane": lane.name, "step": label, "count": len(mine),
                          "seconds": sum(c.end - c.start for c in mine) / 1000})
    return found


def learning_rows(selected: list[harness.Row], quick: bool = False) -> list[harness.Row]:
    """DDP, DDP with another seed (how far two runs of one method land apart), and each compression and DiLoCo row
    selected: the rows whose arithmetic is not DDP's; DiLoCo (H=16), if selected, with another seed too, and the
    overlapped round with no outer momentum too (--outer-momentum 0: its time is the row's);
    with --quick (a check of every path) not those two, which run no path the others do not."""
    def learning_only(row: harness.Row, name: str, flags: list[str]) -> harness.Row:
        return harness.Row(f"{row.name}, {name}", row.script, "torchrun", flags, table="network")
    ddp = next(r for r in rows() if r.name == "DDP")
    extra = [learning_only(r, "another seed", [*r.flags, "--seed", "1"]) for r in selected if r.name == "DiLoCo (H=16)"]
    extra += [learning_only(r, "no outer momentum", [*r.flags, "--outer-momentum", "0"])
              for r in selected if "--overlap-round" in r.flags]
    return [ddp, learning_only(ddp, "another seed", ["--seed", "1"])] + \
        [r for r in selected if "--comm-hook" in r.flags or sync_every(r)] + ([] if quick else extra)


def learn(row: harness.Row, args) -> dict:
    """The row on 2 ranks of this machine (torchrun --standalone) for --learning-steps steps on the learnable
    synthetic set: its last epoch's mean training loss and its test loss and top-1."""
    epochs = 2  # 64 steps an epoch by default: a round of DiLoCo's H=64 in each (a round never spans an epoch)
    per_epoch = max(1, args.learning_steps // epochs)
    global_batch = 2 * args.batch_size
    with tempfile.TemporaryDirectory() as out:
        command = harness.launch(row, 2) + [
            "--device", "cpu", "--dataset", "synthetic", "--train-samples", str(per_epoch * global_batch),
            "--test-samples", "256", "--batch-size", str(global_batch), "--epochs", str(epochs), "--lr", "0.05",
            "--no-augment", "--workers", "0", "--print-freq", "1000000", "--output-dir", out] + row.flags
        result = harness.run_stoppable(command, harness.threads_env(2))
        if result.returncode:
            return {"name": row.name, "flags": row.flags, "error": harness.why_it_failed(result.stderr)}
        last = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()][-1]
    return {"name": row.name, "flags": row.flags, "steps": per_epoch * epochs, "train_loss": last["train_loss"],
            "test_loss": last["test_loss"], "top1": last["top1"]}


def machine_folder() -> str:
    """The full run's results folder: benchmarks/results/cpu-<processor's family>-network."""
    name = harness.processor().lower()
    family = next((word for word in ("epyc", "xeon", "ryzen", "core", "graviton", "neoverse") if word in name),
                  os.uname().machine)
    return f"benchmarks/results/cpu-{family}-network"


# ---- the tables and the picture ----

def measured(results: dict) -> dict:
    """{(row name, rate label): its measurement} of the runs that succeeded."""
    return {(r["row"], r["rate"]): r for r in results["runs"] if "step_s" in r}


def link_limit_s(results: dict, run: dict, rate: dict) -> float:
    """max(compute alone, the busier host's bytes per step / rate): the step time the link allows."""
    alone = results["meta"]["compute_alone"]["step_s"]
    return max(alone, max(run["sent_mb"]) * MB * 8 / rate["bps"]) if rate["bps"] else alone


def phased(results: dict) -> bool:
    """Whether compute alone's forward, backward and optimizer step were timed (results since --phases)."""
    return all(phase in results["meta"]["compute_alone"] for phase in PHASES)


def floor_s(results: dict, run: dict, rate: dict) -> float:
    """The fastest step the row's kind allows (floor_kind): compute alone with the bytes' time (bytes per step / rate)
    where nothing hides them; where only the backward can, compute alone less the backward plus the longer of the
    backward and the bytes' time; else the link's limit. Results without compute alone's phases: the link's limit."""
    alone = results["meta"]["compute_alone"]
    wire = max(run["sent_mb"]) * MB * 8 / rate["bps"] if rate["bps"] else 0.0
    kind = floor_kind(run["row"]) if phased(results) else "link"
    if kind == "none":
        return alone["step_s"] + wire
    if kind == "backward":
        return alone["step_s"] - alone["backward_s"] + max(alone["backward_s"], wire)
    return link_limit_s(results, run, rate)


def markdown(results: dict, pictures: str = "") -> str:
    """The run's tables; `pictures`: the folder of its pictures, relative to where the text goes."""
    meta = results["meta"]
    alone = meta["compute_alone"]["step_s"]
    drift = (f", the mean of {meta['compute_alone']['before']:.2f} before the rows and "
             f"{meta['compute_alone']['after']:.2f} after" if "after" in meta["compute_alone"] else "")
    first = meta["rates"][0]["label"] if meta["rates"] else "the first rate"
    lines = [f"Hardware: {meta['hardware']}. Command: `{meta['command']}`, at commit {meta['commit']}.",
             f"Two hosts: network namespaces joined by a veth pair, one rank each, pinned to a core of its own "
             f"(taskset), one thread; the link held to each rate in both directions by tc's tbf. Per-rank batch "
             f"{meta['batch_size']}, float32, synthetic data. Each run: 2 epochs of {meta['steps'] + 1} steps, the "
             f"first warm-up; at the first rate ({first}) 3 epochs, steps 3 to {meta['steps'] + 3} recorded with "
             f"--profile-steps and the collectives of step {meta['steps'] + 3} (the second epoch's second) counted "
             f"for the bytes table. Step time: the median of the timed steps, each the time between two of rank 0's "
             f"progress lines (the step's forward, backward, the communication it waits for, the optimizer's step "
             f"and the safety net's small all-reduces: the stop flag, the line's loss; no evaluation, no start-up). "
             f"Timed: each epoch's steps after its first, from the second epoch on (at the first rate only those "
             f"after the recorded steps): "
             f"{timed_counts(results)}. Sent: each host's interface counters over those steps. Compute alone: "
             f"{alone:.2f} s per step{drift} (`{meta['compute_alone']['command']}`, one pinned process per core, "
             f"both at once, no communication). " + floors_said(results), ""]
    if meta.get("unfinished"):
        lines += [f"**Unfinished:** {meta['unfinished']}", ""]
    if meta.get("left_out"):
        lines += [meta["left_out"] + ".", ""]
    lines += ladder_table(results) + bytes_table(results) + goals(results) + learning_table(results) + \
        choice_table(results)
    for rate in meta["rates"]:
        lines += rate_table(results, rate)
    if results.get("timeline"):
        t = results["timeline"]
        lines += ["### A DDP step where communication takes as long as the backward", "",
                  f"{t['row']} at {t['rate']}: {t.get('summary') or t.get('error')}.", ""]
        if t.get("small_in_backward"):  # (runs before aa27cdd did not count them)
            counted = "; ".join(f"{s['lane']}, {s['step']}: {s['count']}, {s['seconds']:.3f} s"
                                for s in t["small_in_backward"])
            lines += ["All-reduces under 64 KB started in each recorded step's backward (SyncBatchNorm's, on a group "
                      f"of their own), their count and summed time: {counted}.", ""]
        if "picture" in t:
            lines += [f"![{t['row']} at {t['rate']}]({pictures}{t['picture']})", ""]
    if any(measured(results)):
        lines += [f"![step time against link rate]({pictures}network.png)", ""]
    return "\n".join(lines)


def floors_said(results: dict) -> str:
    """The header's words on the floors, and on the DiLoCo rows' timing where there are any."""
    if not phased(results):
        return "Floor: max(compute alone, the busier host's bytes per step / rate)."
    alone = results["meta"]["compute_alone"]
    diloco = [name for name in results["meta"]["rows"] if name.startswith("DiLoCo")]
    return (f"Of compute alone, the forward and loss took {alone['forward_s']:.2f} s, the backward "
            f"{alone['backward_s']:.2f} s, the optimizer's step {alone['optimizer_s']:.2f} s (timed apart in the same "
            "runs). The bytes' time: the busier host's bytes per step / rate. Floor, by what can hide a row's bytes "
            "(the table's \"floor counts\"): where only the backward can (DDP, its compression and no-SyncBatchNorm "
            "rows, ZeRO-1 and accumulation, for which it is lower than they can reach: \"backward\"), compute alone "
            "less the backward plus the longer of the backward and the bytes' time; where nothing can (one bucket "
            "after the backward, DiLoCo's round: \"none\"), compute alone plus the bytes' time; where the whole step "
            "can (FSDP, HSDP, the pipeline, the overlapped round: "
            "\"link\"), the link's limit, max(compute alone, the bytes' time), which each rate's table gives for "
            "every row too." + (
                " DiLoCo rows: one epoch of 2H + 1 steps" + (
                    ", a progress line every H steps (--print-freq H)" if results["meta"].get("diloco_lines") else "") +
                "; step time: the mean step over its second round (steps H + 1 "
                "to 2H, the round's all-reduce included), between rank 0's progress lines after steps H and 2H; sent: "
                "the counters over that round, per step (with --overlap-round the all-reduces run across the lines: "
                "about a round's bytes, not split exactly); no collectives counted." if diloco else ""))


def timed_counts(results: dict) -> str:
    """How many steps each rate's runs timed, from network.json: "7 a run at unshaped, 4 at 1 Gbit/s and 30 Mbit/s"."""
    counts = {}  # the count's text: the rates with it, in order
    for rate in results["meta"]["rates"]:
        timed = sorted({r["steps_timed"] for r in results["runs"] if r["rate"] == rate["label"] and "steps_timed" in r})
        if timed:
            counts.setdefault(f"{timed[0]}" if len(timed) == 1 else f"{timed[0]}-{timed[-1]}", []).append(rate["label"])
    said = [f"{n}{' a run' if i == 0 else ''} at {joined(labels)}" for i, (n, labels) in enumerate(counts.items())]
    return ", ".join(said) if said else "none yet"


def joined(words: list[str]) -> str:
    """a; a and b; a, b and c."""
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]


def cell(results: dict, name: str, rate: dict) -> str:
    run = next((r for r in results["runs"] if r["row"] == name and r["rate"] == rate["label"]), None)
    if run is None:
        return ""
    if "step_s" not in run:
        return f"failed: {run['error']}"
    return f"{run['step_s']:.2f} ({run['step_s'] / floor_s(results, run, rate):.2f}x)"


def ladder_table(results: dict) -> list[str]:
    """Step time (s) of each strategy at each rate, with step / floor."""
    rates = results["meta"]["rates"]
    return ["### Step time against link rate (s per step, and step / floor)", "", *harness.table(
        ["strategy", *(r["label"] for r in rates)],
        [[name, *(cell(results, name, r) for r in rates)] for name in results["meta"]["rows"]]), ""]


def bytes_table(results: dict) -> list[str]:
    """Each strategy's bytes per step: the collectives of one recorded step beside the interface counters."""
    done = measured(results)
    cells = []
    for name in results["meta"]["rows"]:
        counted = results["collectives"].get(name)
        runs = [r for (row, _), r in done.items() if row == name]
        if not counted and not runs:
            continue
        calls = ", ".join(f"{n} {what}" for what, n in counted["calls"].items()) if counted else ""
        ours = " / ".join(f"{mb:.1f}" for mb in counted["sent_mb"]) if counted else ""
        wire = [statistics.median(r["sent_mb"][h] for r in runs) for h in (0, 1)] if runs else None
        theirs = " / ".join(f"{mb:.1f}" for mb in wire) if wire else ""
        apart = agreement(results, name)  # and the difference, both hosts, in MB
        ratio = f"{apart:.3f} ({(apart - 1) * sum(counted['sent_mb']):+.2f} MB)" if apart is not None else ""
        cells.append([name, calls, ours, theirs, ratio])
    return ["### Bytes per step: the collectives beside the interface counters", "", *harness.table(
        ["strategy", "collectives of one step (rank 0)", "MB sent, host 0 / host 1, from the collectives",
         "MB sent, host 0 / host 1, from the counters (median over the rates)",
         "counters / collectives, both hosts (and their difference)"], cells), ""]


def rate_table(results: dict, rate: dict) -> list[str]:
    """Every row at one rate, with its bytes, compute alone and floor."""
    alone = results["meta"]["compute_alone"]["step_s"]
    cells = []
    scripts = {r.name: harness.script_and_flags({"script": r.script, "flags": r.flags}) for r in rows()}
    for run in (r for r in results["runs"] if r["rate"] == rate["label"]):
        what = f"`{scripts.get(run['row'], '')}`"
        if "step_s" not in run:
            cells.append([run["row"], what, f"failed: {run['error']}", "", "", "", "", ""])
            continue
        counted = results["collectives"].get(run["row"])
        ratio = f"{sum(run['sent_mb']) / sum(counted['sent_mb']):.3f}" if counted and sum(counted["sent_mb"]) else ""
        floor = floor_s(results, run, rate)
        cells.append([run["row"], what, f"{run['step_s']:.2f}", " / ".join(f"{mb:.1f}" for mb in run["sent_mb"]), ratio,
                      f"{alone:.2f}", f"{floor:.2f}", f"{run['step_s'] / floor:.2f}"])
        if phased(results):
            limit = link_limit_s(results, run, rate)
            cells[-1][6:6] = [floor_kind(run["row"])]
            cells[-1] += [f"{limit:.2f}", f"{run['step_s'] / limit:.2f}"]
    header = ["strategy", "script + flags", "step s", "MB sent per step, host 0 / host 1 (counters)",
              "counters / collectives", "compute alone s", "floor s", "step / floor"]
    if phased(results):
        header[6:6] = ["floor counts"]
        header += ["link limit s", "step / link limit"]
        cells = [cell + [""] * (len(header) - len(cell)) for cell in cells]  # a failed run's row
    return [f"### At {rate['label']}", "", *harness.table(header, cells), ""]


def goals(results: dict) -> list[str]:
    """The issue's figures, each as measured: DDP against its floor at 300 Mbit/s and up, the one bucket beside it;
    at 100 Mbit/s and below fp16 against DDP and PowerSGD against compute alone; where each row crosses DDP."""
    done, rates = measured(results), results["meta"]["rates"]
    alone = results["meta"]["compute_alone"]["step_s"]

    def ratio(name, rate):
        run = done.get((name, rate["label"]))
        return run["step_s"] / floor_s(results, run, rate) if run else None

    def listed(name, figures):
        said = [f"{rate['label']} {value:.2f}x" for rate, value in figures if value is not None]
        return f"{name}: " + (", ".join(said) if said else "not measured")

    fast = [r for r in rates if not r["bps"] or r["bps"] >= 300e6]
    slow = [r for r in rates if r["bps"] and r["bps"] <= 100e6]
    ddp = [(r, ratio("DDP", r)) for r in fast]
    met = [v for _, v in ddp if v is not None]
    lines = ["### The goals, as measured", "",
             f"- DDP within 1.15x of its floor at 300 Mbit/s and up: {listed('step / floor', ddp)}" +
             (f" ({'met' if max(met) <= 1.15 else 'not met'})." if met else "."),
             f"- Its one bucket after the backward (no overlap) at those rates: "
             f"{listed('step / floor', [(r, ratio('DDP, one bucket after the backward', r)) for r in fast])}."]
    for rate in slow:
        plain, fp16 = done.get(("DDP", rate["label"])), done.get(("DDP + fp16 compression", rate["label"]))
        power = done.get(("DDP + PowerSGD (rank 2)", rate["label"]))
        if plain and fp16:
            speedup = plain["step_s"] / fp16["step_s"]
            word = against_ddp(fp16["step_s"], plain["step_s"])
            how = (f"{speedup:.2f}x faster than DDP" if word == "faster" else
                   f"{than_ddp(word)} ({speedup:.2f}x its speed)")
            lines.append(f"- At {rate['label']}, fp16 compression {how} (goal 1.8x faster: "
                         f"{'met' if speedup >= 1.8 else 'not met'}).")
        if power:
            lines.append(f"- At {rate['label']}, PowerSGD {power['step_s'] / alone:.2f}x compute alone (goal 1.3x: "
                         f"{'met' if power['step_s'] / alone <= 1.3 else 'not met'}).")
    lines += diloco_goals(results)
    apart = {name: agreement(results, name) for name in results["meta"]["rows"]}
    off = [f"{name} {ratio:.2f}" for name, ratio in apart.items() if ratio is not None and abs(ratio - 1) > 0.1]
    if any(ratio is not None for ratio in apart.values()):
        lines.append("- The counters and the collectives within 10% of each other: " +
                     (f"not for {', '.join(off)} (counters / collectives)." if off else "every row."))
    crossings = [f"- {name}: {crossing}." for name in results["meta"]["rows"]
                 if name != "DDP" and (crossing := crossover(done, name, rates))]
    if crossings:
        lines += [f"- Each row against DDP: faster or slower where the two median steps differ by more than "
                  f"{SAME_WITHIN:.0%} of DDP's, else the same (a fixed margin: the results keep each run's median "
                  f"step, not the spread of its steps)."] + crossings
    return lines + [""]


def diloco_goals(results: dict) -> list[str]:
    """At the slowest rate measured: DiLoCo (H=16)'s mean step against compute alone (goal 1.7x) and DDP's (goal 5x
    faster), the overlapped round's against compute alone (goal 1.2x)."""
    done, rates = measured(results), [r for r in results["meta"]["rates"] if r["bps"]]
    if not rates:
        return []
    slowest = min(rates, key=lambda r: r["bps"])
    alone = results["meta"]["compute_alone"]["step_s"]
    plain, late, ddp = (done.get((name, slowest["label"])) for name in (
        "DiLoCo (H=16)", "DiLoCo (H=16), round overlapped", "DDP"))
    lines = []
    if plain:
        faster = f", {ddp['step_s'] / plain['step_s']:.2f}x faster than DDP (goal 5x: " \
                 f"{'met' if ddp['step_s'] / plain['step_s'] >= 5 else 'not met'})" if ddp else ""
        lines.append(f"- At {slowest['label']}, DiLoCo (H=16) {plain['step_s'] / alone:.2f}x compute alone (goal 1.7x: "
                     f"{'met' if plain['step_s'] / alone <= 1.7 else 'not met'}){faster}.")
    if late:
        lines.append(f"- At {slowest['label']}, its round overlapped {late['step_s'] / alone:.2f}x compute alone (goal "
                     f"1.2x: {'met' if late['step_s'] / alone <= 1.2 else 'not met'}).")
    return lines


def within_ddps_spread(results: dict) -> tuple[float, dict] | None:
    """(the test loss a row may reach and still learn as DDP does: the worse of DDP's two seeds plus their difference;
    {learning run's name: its test loss}); None without both of DDP's learning runs."""
    losses = {r["name"]: r["test_loss"] for r in results.get("learning", []) if "test_loss" in r}
    if "DDP" not in losses or "DDP, another seed" not in losses:
        return None
    seeds = losses["DDP"], losses["DDP, another seed"]
    return max(seeds) + abs(seeds[0] - seeds[1]), losses


def choice_table(results: dict) -> list[str]:
    """For each rate: the fastest row whose learning is within DDP's seed spread (within_ddps_spread: every seed of
    it), and the fastest whatever its learning. The rows of DDP's updates (DDP_UPDATES) learn as DDP does; the others
    without a learning run are not known to; a learning run named after a timed row ("<row>, no outer momentum")
    takes that row's time."""
    spread = within_ddps_spread(results)
    if spread is None:
        return []
    bound, losses = spread

    def learns(name):
        runs = [run for run in (name, name + ", another seed") if run in losses]
        return name in DDP_UPDATES or bool(runs) and all(losses[run] <= bound for run in runs)
    def timed_row(learned, timed):  # the timed row a learning run is named after: the longest name that prefixes it
        return max((name for name in timed if learned.startswith(name + ", ")), key=len, default=None)
    done, cells = measured(results), []
    for rate in results["meta"]["rates"]:
        timed = {name: run["step_s"] for (name, label), run in done.items() if label == rate["label"]}
        fastest = min(timed, key=timed.get, default=None)
        variants = {learned: timed[row] for learned in losses
                    if not learned.endswith("another seed") and (row := timed_row(learned, timed))}
        candidates = timed | variants  # a timed row first: of two at the same time, the row itself is named
        good = min((n for n in candidates if learns(n)), key=candidates.get, default=None)
        cells.append([rate["label"], good or "none", f"{candidates[good]:.2f}" if good else "",
                      fastest or "none", f"{timed[fastest]:.2f}" if fastest else ""])
    return ["### What to run at each rate", "", *harness.table(
        ["rate", "fastest whose learning is within DDP's seed spread", "s / step", "fastest whatever its learning",
         "s / step"], cells), "",
        f"Within DDP's seed spread: a test loss after the learning comparison's steps of at most {bound:.4f} (the "
        f"worse of DDP's two seeds plus their difference), in every seed run. These make DDP's updates (up to the "
        f"order of summation) and learn as it does: {'; '.join(sorted(DDP_UPDATES))}. A row that neither makes DDP's "
        f"updates nor has a learning run is not a candidate. "
        f"A learning run named after a timed row takes that row's step time. One run a seed: rows within a few "
        f"percent of each other are not told apart.", ""]


def agreement(results: dict, name: str) -> float | None:
    """The row's bytes per step from the counters (both hosts, the median over the rates) over those of its
    collectives; None where either is missing."""
    counted = results["collectives"].get(name)
    wire = [sum(r["sent_mb"]) for r in results["runs"] if r["row"] == name and "sent_mb" in r]
    if not counted or not wire or not sum(counted["sent_mb"]):
        return None
    return statistics.median(wire) / sum(counted["sent_mb"])


def than_ddp(word: str) -> str:
    """against_ddp's word as a phrase: "faster than DDP", "the same as DDP"."""
    return f"{word} {'as' if word == 'the same' else 'than'} DDP"


def against_ddp(step_s: float, ddp_s: float) -> str:
    """faster, slower or the same as DDP's step: the same within SAME_WITHIN of DDP's."""
    if abs(step_s - ddp_s) <= SAME_WITHIN * ddp_s:
        return "the same"
    return "faster" if step_s < ddp_s else "slower"


def crossover(done: dict, name: str, rates: list[dict]) -> str | None:
    """How `name` compares with DDP at each rate, from the fastest to the slowest (against_ddp), the rates of one
    word together: "the same as DDP at unshaped, slower at 1 Gbit/s and 300 Mbit/s, faster at 30 Mbit/s"."""
    words = [(r["label"], against_ddp(done[(name, r["label"])]["step_s"], done[("DDP", r["label"])]["step_s"]))
             for r in rates if (name, r["label"]) in done and ("DDP", r["label"]) in done]
    if not words:
        return None
    if len({word for _, word in words}) == 1:
        return f"{than_ddp(words[0][1])} at every rate measured"
    runs = [(word, [label for label, _ in group]) for word, group in itertools.groupby(words, key=lambda w: w[1])]
    return ", ".join(f"{than_ddp(word) if i == 0 else word} at {joined(labels)}"
                     for i, (word, labels) in enumerate(runs))


def learning_table(results: dict) -> list[str]:
    if not results.get("learning"):
        return []
    base = next((r for r in results["learning"] if r["name"] == "DDP" and "train_loss" in r), None)
    cells = []
    for r in results["learning"]:
        flags_text = f"`{' '.join(r['flags'])}`" if r["flags"] else ""
        if "train_loss" not in r:
            cells.append([r["name"], flags_text, f"failed: {r['error']}", "", "", "", ""])
            continue
        versus = f"{r['train_loss'] - base['train_loss']:+.4f}" if base else ""
        cells.append([r["name"], flags_text, r["steps"], f"{r['train_loss']:.4f}", f"{r['test_loss']:.4f}",
                      f"{r['top1']:.1f}", versus])
    diloco = any(r["name"].startswith("DiLoCo") for r in results["learning"])
    what = "compression and DiLoCo cost" if diloco else "compression costs"
    return [f"### What {what} in learning (2 ranks, unshaped: the loss does not depend on the link)", "",
            *harness.table(["row", "flags", "steps", "training loss, last epoch", "test loss", "top-1 %",
                            "training loss - DDP's"], cells), "",
            "Learning rate 0.05, no augmentation, the global batch of the rows; PowerSGD all-reduces in full through "
            "the first epoch and compresses from the second. Each row is one run. \"DDP, another seed\" is one "
            "measure of how far two runs of the same method land apart: a compression's difference within it cannot "
            "be told from noise." + (" A DiLoCo row's training loss is its ranks' own, each on its own weights "
                                     "between rounds; its test loss and top-1 are those of the weights every rank "
                                     "agrees on after the last round." if diloco else ""), ""]


def chart(results: dict, path: Path) -> None:
    """Step time against link rate (a log axis), a line per strategy, DDP's floor and compute alone drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates, done = results["meta"]["rates"], measured(results)
    shaped = [r["bps"] for r in rates if r["bps"]]
    unshaped_x = 3 * max(shaped, default=1e9)  # where "unshaped" stands on the axis
    x = {r["label"]: r["bps"] or unshaped_x for r in rates}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab20").colors  # a colour and a marker a row: more rows than tab10 has colours
    for i, name in enumerate(results["meta"]["rows"]):
        points = sorted((x[label], run["step_s"]) for (row, label), run in done.items() if row == name)
        if points:
            ax.plot(*zip(*points, strict=True), marker="osD^v<>ph*X"[i % 11], color=colours[2 * i % 20 + i // 10],
                    label=name)
    alone = results["meta"]["compute_alone"]["step_s"]
    sent = [max(run["sent_mb"]) for (row, _), run in done.items() if row == "DDP"]
    if sent and shaped:  # DDP's floor as a curve of the rate, its bytes the median over the rates
        grid = [min(shaped) / 1.5 * (1.5 * unshaped_x / min(shaped)) ** (i / 200) for i in range(201)]
        bits = statistics.median(sent) * MB * 8
        ax.plot(grid, [max(alone, bits / g) for g in grid], color="black", linestyle="--",
                label="DDP's floor: max(compute alone, bytes / rate)")
    ax.axhline(alone, color="grey", linestyle=":", label="compute alone")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xticks([x[r["label"]] for r in rates], [r["label"] for r in rates], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("link rate (both directions)")
    ax.set_ylabel("s per step (median; lower is better)")
    ax.set_title(f"{results['meta']['hardware']}; per-rank batch {results['meta']['batch_size']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, out: Path, doc: Path | None = None) -> None:
    """network.json and network.md, each replaced whole (written beside, then renamed over); with `doc`, the page's
    part between its two DOC_MARKS replaced by the tables too."""
    harness.write_whole(out, {"network.json": json.dumps(results, indent=1), "network.md": markdown(results)})
    if doc:
        fill_doc(doc, results, out)


DOC_MARKS = ("<!-- the figures of python -m benchmarks.network: begin -->",
             "<!-- the figures of python -m benchmarks.network: end -->")


def fill_doc(doc: Path, results: dict, out: Path) -> None:
    """The tables between the page's DOC_MARKS, with the pictures (in `out`) linked from the page's folder."""
    doc.write_text(doc_with_figures(doc.read_text(), results, os.path.relpath(out, doc.parent) + "/"))


def doc_with_figures(text: str, results: dict, pictures: str) -> str:
    """The page's `text` with its part between DOC_MARKS made anew from `results` (network.json's content);
    `pictures`: the results folder as the page links it. What fill_doc writes, and what a test compares a page with."""
    head, _, rest = text.partition(DOC_MARKS[0])
    _, _, tail = rest.partition(DOC_MARKS[1])
    return f"{head}{DOC_MARKS[0]}\n{markdown(results, pictures)}\n{DOC_MARKS[1]}{tail}"


def check_doc(doc: str | None) -> Path | None:
    """--doc's page, which must hold both DOC_MARKS (checked before anything runs)."""
    if doc is None:
        return None
    page = Path(doc)
    if not page.is_file() or not all(mark in page.read_text() for mark in DOC_MARKS):
        raise UsageError(f"--doc {doc}: not a page holding the two lines {DOC_MARKS[0]!r} and {DOC_MARKS[1]!r}")
    return page


def parse_args(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.network", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"2 rates ({QUICK_RATES}), 2 timed steps a run (3 at the first rate), per-rank batch "
                             f"8, DiLoCo's rounds timed at --sync-every {QUICK_ROUND}, 8 learning steps, and without "
                             "--only not the rows that change one flag of a path it runs (bf16 compression, no "
                             "SyncBatchNorm): a check of every path, not figures")
    parser.add_argument("--rates", default=None,
                        help=f"comma-separated link rates as tc writes them, or unshaped (default: {RATES}; "
                             f"with --quick {QUICK_RATES})")
    parser.add_argument("--only", action="append", default=None, metavar="ROWS",
                        help="only the rows whose name contains one of these comma-separated texts (any case; "
                             "repeatable): DDP, one bucket, fp16, bf16, PowerSGD, accumulation, ZeRO, FSDP, HSDP, "
                             "Pipeline, DiLoCo, overlapped")
    parser.add_argument("--steps", type=flags.positive_int, default=None,
                        help="timed steps a run (default: 4; 2 with --quick); at the first rate, 2 x STEPS - 1 "
                             "(a third epoch, the recorded steps left out)")
    parser.add_argument("--batch-size", type=flags.positive_int, default=None,
                        help="per-rank batch, divisible by 4 (default: 32, the CPU benchmark's; 8 with --quick)")
    parser.add_argument("--learning-steps", type=flags.non_negative_int, default=None,
                        help="steps of the learning comparison, in 2 epochs (default: 128; 8 with --quick); 0: none")
    parser.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                        help=f"draw a --profile-steps timeline of {TIMELINE_ROW} at the rate where its bytes take as "
                             "long as its backward")
    parser.add_argument("--output-dir", default=None,
                        help="where network.md, .json and .png go (default: runs/network with --quick, else "
                             f"{machine_folder()}, the folder of this machine's results)")
    parser.add_argument("--doc", default=None, metavar="PAGE",
                        help="also put the tables into this page, between its two marker lines (docs/network.md)")
    args = parser.parse_args(argv)
    args.rates = parse_rates(args.rates or (QUICK_RATES if args.quick else RATES))
    if isinstance(args.rates, str):
        parser.error(args.rates)
    args.steps = args.steps or (2 if args.quick else 4)
    args.batch_size = args.batch_size or (8 if args.quick else 32)
    if args.batch_size % 4:
        parser.error("--batch-size must be divisible by 4 (accumulation's 4 micro-batches, the pipeline's 4)")
    args.learning_steps = args.learning_steps if args.learning_steps is not None else (8 if args.quick else 128)
    args.output_dir = args.output_dir or ("runs/network" if args.quick else machine_folder())
    args.selected = harness.rows_named(rows(), args.only)
    if isinstance(args.selected, str):
        parser.error(args.selected)
    left_out = [r.name for r in args.selected if r.full_only and args.quick and not args.only]
    args.selected = [r for r in args.selected if r.name not in left_out]
    args.left_out = (f"--quick leaves out {' and '.join(left_out)}, which change one flag of a path it runs: run "
                     "without --quick, or name them with --only" if left_out else None)
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        parser.error(f"--output-dir {args.output_dir} is a file")
    return args


def main(argv=None):
    args = parse_args(argv)
    with exit_on_error():
        doc = check_doc(args.doc)
        with TwoHosts():  # root and namespaces, checked before anything runs (made and removed at once)
            pass
        measure(args, doc, shlex.join(["python", "-m", "benchmarks.network",
                                       *(sys.argv[1:] if argv is None else argv)]))


def measure(args, doc: Path | None, command: str) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"hardware": harness.hardware("cpu", 2), "processor": harness.processor(), "torch": torch.__version__,
            "command": command, "commit": harness.git_commit(), "batch_size": args.batch_size,
            "steps": args.steps, "rates": args.rates, "rows": [r.name for r in args.selected],
            "left_out": args.left_out, "diloco_lines": "every H steps"}
    results = {"meta": meta, "runs": [], "collectives": {}, "learning": [], "timeline": None}
    learners = learning_rows(args.selected, args.quick) if args.learning_steps else []
    ddp = next((r for r in args.selected if r.name == TIMELINE_ROW), None)
    stages = 2 + len(args.rates) * len(args.selected) + bool(args.timeline and ddp) + len(learners)
    done, port = harness.Progress(stages, write=lambda line: print(line, flush=True)).done, [29600]

    def next_port() -> int:  # a fresh one each run: the last run's may still be in TIME_WAIT
        port[0] += 1
        return port[0]

    print(f"{meta['hardware']}; {len(args.selected)} rows at {len(args.rates)} rates; writing {out}" +
          (f"\n{args.left_out}" if args.left_out else ""), flush=True)
    try:
        with harness.stopped_as_ctrl_c(), TwoHosts() as hosts:
            meta["compute_alone"] = compute_alone(args)
            args.compute_s = meta["compute_alone"]["step_s"]
            done(f"compute alone: {args.compute_s:.2f} s per step of {args.batch_size} images")
            for i, rate in enumerate(args.rates):
                hosts.shape(rate)
                for row in args.selected:
                    result = measure_row(hosts, row, rate, args, next_port(), count=i == 0)
                    if "collectives" in result:
                        results["collectives"][row.name] = result.pop("collectives")
                    results["runs"].append({"row": row.name, "rate": rate["label"], **result})
                    meta["unfinished"] = (f"{len(results['runs'])} of {len(args.rates) * len(args.selected)} runs "
                                          "measured when this was written; the run did not finish.")
                    write(results, out)
                    done(f"{rate['label']}, {row.name}: " + (
                        f"{result['step_s']:.2f} s per step, "
                        f"{' / '.join(f'{mb:.1f}' for mb in result['sent_mb'])} MB sent per host "
                        f"({result['wall_s']:.0f} s)" if "step_s" in result else f"failed: {result['error']}"))
            # compute alone again after the rows, so that the machine's drift during them shows; the floor: their mean
            again, first = compute_alone(args), dict(meta["compute_alone"])
            after, before = again["step_s"], first["step_s"]
            meta["compute_alone"].update({phase: (first[phase] + again[phase]) / 2 for phase in PHASES},
                                         step_s=(before + after) / 2, before=before, after=after)
            done(f"compute alone again: {after:.2f} s per step")
            if args.timeline and ddp and (rate := balanced_rate(results["collectives"].get(ddp.name))):
                results["timeline"] = draw_timeline(hosts, ddp, rate, args, next_port(), out)
                write(results, out)
                done(f"timeline of {ddp.name} at {rate['label']}: " +
                     results["timeline"].get("summary", results["timeline"].get("error", "")))
        for row in learners:
            results["learning"].append(learn(row, args))
            write(results, out)
            r = results["learning"][-1]
            done(f"learning, {row.name}: " + (f"training loss {r['train_loss']:.4f} after {r['steps']} steps"
                                              if "train_loss" in r else f"failed: {r['error']}"))
    except KeyboardInterrupt as stopped:
        sys.exit(harness.stopped_status(stopped, f"after {len(results['runs'])} of "
                                          f"{len(args.rates) * len(args.selected)} runs: {out / 'network.md'} has the "
                                          "rows measured" if results["runs"] else "before any row was measured"))
    meta.pop("unfinished", None)
    write(results, out, doc)
    if measured(results):
        chart(results, out / "network.png")
    print(markdown(results))
    print(f"wrote {out / 'network.md'}, {out / 'network.json'}" + (f", {out / 'network.png'}" if measured(results)
                                                                   else "") + (f" and {doc}" if doc else ""))
    if any("error" in r for r in results["runs"] + results["learning"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
