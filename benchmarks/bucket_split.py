"""One all-reduce of a whole gradient against DDP's buckets of it, over a shaped link: the all-reduces alone.

    sudo python -m benchmarks.bucket_split                        # 30 Mbit/s, three queues, 3 repeats: about 12 min
    sudo python -m benchmarks.bucket_split --rate 100mbit --queues 256kb/100ms --repeats 5

The network benchmark found DDP's one bucket after the backward (one 42.9 MB all-reduce a step) faster than DDP's own
buckets (9.2, 25.3 and 8.3 MB, started during the backward) at 30 Mbit/s, and slower at every faster rate. This
program takes the training away: on benchmarks.network's TwoHosts (network namespaces joined by a veth pair, one rank
each on a core of its own, gloo, one thread), each rank all-reduces float32 tensors of --buckets' sizes in five
patterns, after the link has been idle for --idle seconds (as it is through a step's forward):
- one: a single all-reduce of their sum, the one-bucket row's;
- DDP's buckets, queued: all started at once (async_op=True, as DDP starts them from the backward), then waited for;
- DDP's buckets, in turn: each waited for before the next starts;
- DDP's buckets, queued, one gloo thread: as queued, in a process group of gloo's with one worker thread where
  init_process_group's has two (each runs a collective at a time: two of the queued run at once there);
- one, the core computing meanwhile: as one, while a thread of the rank multiplies matrices on the host's one core,
  as a training step's compute does under an all-reduce it overlaps (DDP's backward, DiLoCo's overlapped round).
The patterns take turns, --repeats times, under each of --queues: tc's token bucket (tbf) on both ends of the link at
--rate, with the bucket's burst and the queue's latency given (the network benchmark's is 256kb/100ms; a packet that
would wait longer than the latency is dropped; a bucket fills while the link is idle, up to its burst, and what it holds
goes out at once). For each, rank 0's time, the bytes the busier host's interface sent and their time at the rate, and
what the link did meanwhile on both hosts: how much of its time went unused (Unused: over 50 ms windows, the share
of each that the host's interface did not send), and from the kernel's counters in each host's namespace the packets
tc dropped (tc -s qdisc), the segments TCP sent again (/proc/net/snmp's RetransSegs) and its retransmission timeouts
(/proc/net/netstat's TCPTimeouts). Writes <output-dir>/bucket_split.json and .md, replaced whole after each queue;
stopped (Ctrl-C, SIGTERM, SIGHUP), it keeps what it measured, marked unfinished.
"""
import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import harness, network
from utils import flags
from utils.errors import UsageError, print_line

PORT = 29470  # host 0's store, + the queue's index: a fresh port each queue (the last one's may be in TIME_WAIT)
PATTERNS = ("one", "DDP's buckets, queued", "DDP's buckets, in turn", "DDP's buckets, queued, one gloo thread",
            "one, the core computing meanwhile")
COUNTERS = ("sent", "dropped", "retransmitted", "timeouts")
WINDOW_S = 0.05  # Unused's: at 30 Mbit/s a window carries about 190 kB, the kernel's largest segment 64 kB


def link_counters(interface: str) -> dict:
    """This process's namespace's counters (each host's rank reads its own): the bytes `interface` sent, the packets
    its tc queue dropped, the TCP segments sent again and TCP's retransmission timeouts, all since the host began."""
    def field(path: str, table: str, name: str) -> int:  # /proc/net/snmp and netstat: a line of names, one of values
        lines = [line.split() for line in Path(path).read_text().splitlines() if line.startswith(table + ":")]
        return int(lines[1][lines[0].index(name)])
    qdisc = subprocess.run(["tc", "-s", "qdisc", "show", "dev", interface], capture_output=True, text=True).stdout
    return {"sent": network.tx_bytes("self", interface), "dropped": int(re.search(r"dropped (\d+)", qdisc)[1]),
            "retransmitted": field("/proc/net/snmp", "Tcp", "RetransSegs"),
            "timeouts": field("/proc/net/netstat", "TcpExt", "TCPTimeouts")}


class Unused:
    """While a pattern runs, a thread adds up, over WINDOW_S windows, the share of each that this host's `interface`
    left unsent at `rate_bps`: the link's time unused in its direction (from the interface's counter, after tc's
    queue; a window without data still carries the acknowledgements of what the host receives, so none is empty)."""

    def __init__(self, interface: str, rate_bps: float):
        self.interface, self.capacity = interface, rate_bps / 8 * WINDOW_S
        self.stop, self.seconds = threading.Event(), 0.0
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self):
        last = network.tx_bytes("self", self.interface)
        while not self.stop.wait(WINDOW_S):
            now = network.tx_bytes("self", self.interface)
            self.seconds += WINDOW_S * max(0.0, 1 - (now - last) / self.capacity)
            last = now

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def worker(host: int, port: int, buckets_mb: list[float], repeats: int, idle_s: float, rate_bps: float) -> None:
    """One host's rank: each pattern in turn, --repeats times, after idle_s of idle link; a JSON line for each, its
    time and the counters' change across it."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{network.ADDRESSES[0]}:{port}", rank=host, world_size=2)
    buckets = [torch.ones(round(mb * network.MB / 4)) for mb in buckets_mb]
    whole = torch.ones(sum(b.numel() for b in buckets))
    # gloo's process group as init_process_group makes it, but with one worker thread (torch's private options: no
    # public flag sets the threads)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=network.INTERFACES[host])]
    options._threads = 1
    one_thread = dist.ProcessGroupGloo(dist.PrefixStore("one-thread", dist.distributed_c10d._get_default_store()),
                                       host, 2, options)
    for warm in (lambda t: dist.all_reduce(t), lambda t: one_thread.allreduce([t]).wait()):
        warm(torch.ones(256 * 1024))  # each group's connection made and used once before anything is timed

    def queued(start=lambda bucket: dist.all_reduce(bucket, async_op=True)):
        for work in [start(bucket) for bucket in buckets]:
            work.wait()

    def computing_meanwhile(run):
        done = threading.Event()

        def compute():  # torch releases the GIL in its kernels: the core is shared as with a training step
            a = torch.randn(256, 256)
            while not done.is_set():
                a = torch.tanh(a @ a)
        thread = threading.Thread(target=compute)
        thread.start()
        try:
            run()
        finally:
            done.set()
            thread.join()

    run = {"one": lambda: dist.all_reduce(whole), "DDP's buckets, queued": queued,
           "DDP's buckets, in turn": lambda: [dist.all_reduce(bucket) for bucket in buckets],
           "DDP's buckets, queued, one gloo thread": lambda: queued(lambda bucket: one_thread.allreduce([bucket])),
           "one, the core computing meanwhile": lambda: computing_meanwhile(lambda: dist.all_reduce(whole))}
    for repeat in range(repeats):
        for pattern in PATTERNS:
            dist.barrier()  # both start together, then the link idles as through a step's forward
            time.sleep(idle_s)
            before = link_counters(network.INTERFACES[host])
            with Unused(network.INTERFACES[host], rate_bps) as unused:
                started = time.perf_counter()
                run[pattern]()
                seconds = time.perf_counter() - started
            dist.barrier()  # the peer has all this host sent, so none of it waits in tc's queue: all counted
            after = link_counters(network.INTERFACES[host])
            print(json.dumps({"pattern": pattern, "repeat": repeat, "seconds": seconds, "unused": unused.seconds,
                              **{name: after[name] - before[name] for name in COUNTERS}}), flush=True)
    dist.destroy_process_group()


def measure_queue(hosts, queue: str, index: int, args) -> list[dict]:
    """Every pattern's runs under one tc queue ("burst/latency"): both hosts' lines joined, rank 0's time."""
    burst, latency = queue.split("/")
    hosts.shape(args.rate, burst, latency)
    code = (f"from benchmarks.bucket_split import worker; worker({{host}}, {PORT + index}, {args.buckets!r}, "
            f"{args.repeats}, {args.idle}, {args.rate['bps']})")
    commands = [hosts.prefix(host) + [sys.executable, "-c", code.format(host=host)] for host in (0, 1)]
    procs = [subprocess.Popen(cmd, cwd=harness.ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
                              env=hosts.env(host)) for host, cmd in enumerate(commands)]
    link_s = sum(args.buckets) * network.MB * 8 / args.rate["bps"]  # a pattern's bytes at the rate, a host's
    limit_s = 120 + args.repeats * len(PATTERNS) * (args.idle + 10 * link_s)  # a hang ends; 10x: a slow machine
    deadline = time.monotonic() + limit_s
    try:
        outputs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        harness.stop(procs, grace_s=0)
        raise UsageError(f"the ranks under {queue} did not finish within {limit_s:.0f} s") from None
    except KeyboardInterrupt:
        harness.stop(procs, grace_s=0)
        raise
    if any(proc.returncode for proc in procs):
        raise UsageError(f"a rank under {queue} failed (exit statuses {[p.returncode for p in procs]})")
    lines = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outputs]
    return [{"queue": queue, "pattern": a["pattern"], "repeat": a["repeat"], "seconds": a["seconds"],
             **{name: [a[name], b[name]] for name in ("unused", *COUNTERS)}} for a, b in zip(*lines, strict=True)]


def markdown(results: dict) -> str:
    meta = results["meta"]
    bps = meta["rate_bps"]
    lines = [f"Hardware: {meta['hardware']}. Command: `{meta['command']}`, at commit {meta['commit']}. Two hosts "
             f"(network namespaces, one core and one rank each, gloo), the link at {network.rate_label(bps)} in each "
             f"direction; float32 all-reduces of {', '.join(f'{mb:g}' for mb in meta['buckets_mb'])} MB (DDP's "
             f"buckets) or of their sum in one, each after {meta['idle_s']:g} s of idle link; {meta['repeats']} "
             "runs of each pattern under each queue, taking turns.", ""]
    if meta.get("unfinished"):
        lines += [f"**Unfinished:** {meta['unfinished']}", ""]
    body = []
    for queue in dict.fromkeys(r["queue"] for r in results["runs"]):
        for pattern in PATTERNS:
            runs = [r for r in results["runs"] if r["queue"] == queue and r["pattern"] == pattern]
            if not runs:
                continue
            seconds = statistics.median(r["seconds"] for r in runs)
            link_s = statistics.median(max(r["sent"]) * 8 / bps for r in runs)

            def both(name, runs=runs):  # the median run's count on each host
                return " / ".join(f"{statistics.median(r[name][h] for r in runs):g}" for h in (0, 1))
            body.append([f"tbf {queue}", pattern, f"{seconds:.2f}", f"{link_s:.2f}", f"{seconds / link_s:.3f}",
                         both("unused"), both("dropped"), both("retransmitted"), both("timeouts")])
    lines += harness.table(["queue (burst/latency)", "pattern", "s (median)", "bytes' time, s (the busier host's "
                            "sent / rate)", "s / bytes' time",
                            f"s of the link unused, host 0 / 1 (each {WINDOW_S * 1000:g} ms window's share not sent)",
                            "packets tc dropped, host 0 / 1",
                            "TCP segments sent again, host 0 / 1", "TCP timeouts, host 0 / 1"], body)
    return "\n".join(lines) + "\n"


def queue_list(text: str) -> list[str]:
    queues = [word.strip() for word in text.split(",")]
    for queue in queues:
        burst, _, latency = queue.partition("/")
        if not (burst[:1].isdigit() and latency[:1].isdigit()):
            raise argparse.ArgumentTypeError(f"{queue!r} is not burst/latency as tc writes them (256kb/100ms)")
    return queues


def size_list(text: str) -> list[float]:
    return [flags.positive_float(word) for word in text.split(",")]


def one_rate(text: str) -> dict:
    rates = network.parse_rates(text)
    if isinstance(rates, str) or len(rates) != 1 or rates[0]["tc"] is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not one rate of 1 Mbit/s or more, as tc writes it (30mbit)")
    return rates[0]


def parse_args(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.bucket_split", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--rate", type=one_rate, default=one_rate("30mbit"), metavar="RATE",
                        help="the link's rate in each direction, as tc writes it (default: 30mbit)")
    parser.add_argument("--queues", type=queue_list, default=queue_list("256kb/100ms,256kb/1s,4mb/100ms"),
                        metavar="BURST/LATENCY,...",
                        help="tc tbf's queues, each its burst and latency (default: 256kb/100ms,256kb/1s,4mb/100ms: "
                             "the network benchmark's, a queue ten times as deep, a burst sixteen times as large)")
    parser.add_argument("--buckets", type=size_list, default=size_list("9.2,25.3,8.3"), metavar="MB,MB,...",
                        help="the buckets' sizes in MB, in the order started (default: 9.2,25.3,8.3, DDP's in the "
                             "network benchmark's timeline of distributed.py); one all-reduces their sum")
    parser.add_argument("--repeats", type=flags.positive_int, default=3, help="runs of each pattern (default: 3)")
    parser.add_argument("--idle", type=flags.non_negative_float, default=1.0, metavar="SECONDS",
                        help="the link idle before each run, as through a step's compute (default: 1)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where bucket_split.json and .md go (default: benchmarks/results/cpu-<processor>-"
                             "bucket-split)")
    return parser.parse_args(argv)  # a bad value: one line, exit status 2


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.output_dir or harness.ROOT / (network.machine_folder().removesuffix("-network") + "-bucket-split")
    typed = sys.argv[1:] if argv is None else argv
    meta = {"hardware": harness.hardware("cpu", 2), "commit": harness.git_commit(), "rate_bps": args.rate["bps"],
            "buckets_mb": args.buckets, "repeats": args.repeats, "idle_s": args.idle,
            "command": shlex.join(["python", "-m", "benchmarks.bucket_split", *typed])}
    results = {"meta": meta, "runs": []}

    def write():
        harness.write_whole(out, {"bucket_split.json": json.dumps(results, indent=1),
                                  "bucket_split.md": markdown(results)})
    try:
        with harness.stopped_as_ctrl_c(), network.TwoHosts("bucket-split") as hosts:
            out.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            for index, queue in enumerate(args.queues):
                print(f"[{index + 1}/{len(args.queues)}] tbf {queue} at {args.rate['label']} "
                      f"({time.monotonic() - started:.0f} s in all)", flush=True)
                results["runs"] += measure_queue(hosts, queue, index, args)
                write()
    except UsageError as error:
        print_line(str(error))
        return error.exit_status
    except KeyboardInterrupt as stop:
        if out.is_dir():
            meta["unfinished"] = f"stopped after {len(results['runs'])} runs"
            write()
        return harness.stopped_status(stop, f"after {len(results['runs'])} runs; what was measured is in {out}")
    print(f"written: {out / 'bucket_split.md'}, {out / 'bucket_split.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
