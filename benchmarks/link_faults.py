"""What a failing link between two machines costs each launcher, measured on two hosts made on this machine.

    sudo python -m benchmarks.link_faults                   # outages of 2, 5 and 10 s; lasting cuts; a few minutes
    sudo python -m benchmarks.link_faults --outages 3 --outage-timeout 20 --dist-timeout 20

The hosts are benchmarks.network's TwoHosts (network namespaces joined by a veth pair, a hostname each; root only), one
rank each; the link is set down on host 0's end as a pulled cable (nothing passes, no connection is reset):
- an outage of S seconds after step 4 of DDP (distributed.py, its CpuSyncBatchNorm on, static torchrun, its
  --dist-timeout set by --outage-timeout): how long the run printed no step line across it, against the median step;
- a lasting cut after step 4, under torchrun and under the spawn script (distributed_mp.py --nnodes 2): the time from
  the cut to each host's exit, beside --dist-timeout, and the steps lost (the last step printed before the cut minus
  the newest checkpoint's, --save-every-steps 3);
- live recovery (distributed_live_recovery.py; the lighthouse and replica group 0 on host 0, group 1 on host 1), the
  link cut for good at group 0's step 20, each step paced to 0.25 s: how long group 0 stood still before training on
  alone, when group 1 ended; then the link back and group 1's same command again: the time from the link's return to
  its first step.
Every run is a fresh one in a temporary folder. Writes <output-dir>/link_faults.json and link_faults.md, each replaced
whole after every measurement; stopped (Ctrl-C, SIGTERM, SIGHUP), it keeps what it measured, marked unfinished.
tests/test_link_faults.py proves that the same commands end where they should (the weights, the lines, no process
left).
"""
import itertools
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness, network
from benchmarks.launched import STEP, Launched
from examples import own_lighthouse
from utils import flags
from utils.errors import UsageError, print_line

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PORT = 29410  # the static rendezvous, on host 0's address; +1 a c10d one, +2 the lighthouse, +3 a replica group's
TRAINING = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "96", "--test-samples", "21",
            "--batch-size", "8", "--epochs", "1", "--workers", "0", "--print-freq", "1"]
CUT_AFTER = 4  # the step whose line a cut follows: the newest checkpoint then is step 3's


def host_command(hosts, host: int, output_dir, launcher: str = "torchrun", script: str = "distributed.py",
                 extra: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    """(command, environment) of one host's launcher as a user starts a fixed pair: torchrun with a static rendezvous
    (--nnodes=2 --node-rank) and `script`, or distributed_mp.py spawning its rank (--nnodes 2 --node-rank --ip --port);
    TRAINING, a checkpoint every 3 steps and `extra` its flags."""
    if launcher == "torchrun":
        start = TORCHRUN + ["--nnodes=2", f"--node-rank={host}", "--nproc_per_node=1",
                            f"--master-addr={network.ADDRESSES[0]}", f"--master-port={PORT}",
                            f"--local-addr={network.ADDRESSES[host]}", str(harness.ROOT / script)]
    else:
        start = [sys.executable, str(harness.ROOT / "distributed_mp.py"), "--nnodes", "2", "--node-rank", str(host),
                 "--nprocs", "1", "--ip", network.ADDRESSES[0], "--port", str(PORT)]
    every = [*TRAINING, "--save-every-steps", "3", *extra, "--output-dir", str(output_dir)]
    env = {**harness.threads_env(1), "GLOO_SOCKET_IFNAME": network.INTERFACES[host]}
    return hosts.prefix(host) + start + every, env


def replica_group_command(hosts, group: int, output_dir, extra: tuple[str, ...]) -> tuple[list[str], dict]:
    """distributed_live_recovery.py's replica group `group` on host `group`: one process under torchrun, its store on
    the host's address (the other group reaches it there), the lighthouse on host 0, each step paced to 0.25 s
    (tests/script_driver.py) so that group 0 still trains when group 1 comes back on a slow machine; TRAINING and
    `extra` its flags (the last of a flag given twice counts)."""
    return (hosts.prefix(group) + TORCHRUN + [
        "--nnodes=1", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={network.ADDRESSES[group]}:"
        f"{PORT + 3}", str(harness.ROOT / "tests" / "script_driver.py"), "--step-seconds", "0.25",
        "distributed_live_recovery.py", "--replica-group", str(group), "--replica-groups", "2", "--lighthouse",
        f"http://{hosts.hostnames[0]}:{PORT + 2}", *TRAINING, *extra, "--output-dir", str(output_dir)],
        {**harness.threads_env(1), "GLOO_SOCKET_IFNAME": network.INTERFACES[group]})


def start_lighthouse(hosts, heartbeat_s: float) -> subprocess.Popen:
    """torchft's lighthouse on host 0 (a quorum of one group is enough), once it answers."""
    lighthouse = subprocess.Popen(hosts.prefix(0) + [own_lighthouse.program(), "--min_replicas", "1", "--bind",
                                                     f"[::]:{PORT + 2}", "--heartbeat_timeout_ms",
                                                     str(int(heartbeat_s * 1000))],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ask = f"import urllib.request as u; u.urlopen('http://localhost:{PORT + 2}/status', timeout=5)"
    deadline = time.monotonic() + 60
    while subprocess.run(hosts.prefix(0) + [sys.executable, "-c", ask], capture_output=True).returncode:
        if time.monotonic() > deadline or lighthouse.poll() is not None:
            lighthouse.kill()
            raise RuntimeError("the lighthouse did not start")
        time.sleep(0.5)
    return lighthouse


def both(hosts, launched: list[Launched], during=None) -> list[Launched]:
    """`during(launched)` while they run (if given); back once all have exited, the link up again; killed with every
    process of theirs if anything fails or the benchmark is stopped."""
    try:
        if during:
            during(launched)
        for one in launched:
            one.status, one.exited = one.ended()
        return launched
    finally:
        hosts.set_link(True)
        for one in launched:
            if one.proc.poll() is None:
                one.kill()


def cut_after(hosts, launched: Launched, step: int, seconds: float | None = None) -> float:
    """The link down once `launched` printed its line of step `step` (of an epoch of one), and up again after
    `seconds` (None: left down); when it went down."""
    launched.wait_for(re.compile(rf"^epoch 1/1 step {step}/"))
    hosts.set_link(False)
    cut_at = time.monotonic()
    if seconds is not None:
        time.sleep(seconds)
        hosts.set_link(True)
    return cut_at


def stood_still(launched: Launched, cut_at: float) -> float | None:
    """How long `launched` printed no step line across a cut at `cut_at`: its last step line before, its first after
    (None: no step after it)."""
    whens = sorted(launched.steps().values())
    after = [w for w in whens if w > cut_at]
    return after[0] - max(w for w in whens if w <= cut_at) if after else None


def outage(hosts, seconds: float, dist_timeout: int) -> dict:
    """DDP under static torchrun, the link down for `seconds` after step CUT_AFTER."""
    cut = {}

    def down_then_up(launched):
        cut["at"] = cut_after(hosts, launched[0], CUT_AFTER, seconds)

    with tempfile.TemporaryDirectory() as out:
        first, second = both(hosts, [Launched(*host_command(hosts, h, out, extra=("--dist-timeout", str(dist_timeout))))
                                     for h in (0, 1)], down_then_up)
    whens = sorted(first.steps().values())
    step_s = statistics.median(later - earlier for earlier, later in itertools.pairwise(whens))
    return {"outage_s": seconds, "status": [first.status, second.status],
            "stood_still_s": stood_still(first, cut["at"]), "step_s": step_s}


def lasting(hosts, launcher: str, dist_timeout: int) -> dict:
    """A launcher's run on both hosts, the link down for good after step CUT_AFTER."""
    cut = {}

    def for_good(launched):
        cut["at"] = cut_after(hosts, launched[0], CUT_AFTER)
        for one in launched:
            one.status, one.exited = one.ended()

    with tempfile.TemporaryDirectory() as out:
        launched = both(hosts, [Launched(*host_command(hosts, h, out, launcher, extra=("--dist-timeout",
                                                                                        str(dist_timeout))))
                                for h in (0, 1)], for_good)
        kept = torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=True)["step"]
    last = max(step for step, when in launched[0].steps().items() if when <= cut["at"])
    return {"launcher": launcher, "status": [one.status for one in launched],
            "exited_after_s": [one.exited - cut["at"] for one in launched], "last_step": last, "checkpoint_step": kept,
            "steps_lost": last - kept}


def live_recovery(hosts, dist_timeout: int, heartbeat_s: float) -> dict:
    """The lighthouse and group 0 on host 0, group 1 on host 1; the link cut for good at group 0's step 20, group 1's
    same command again once it has ended and the link is back."""
    extra = ("--train-samples", "1920", "--dist-timeout", str(dist_timeout))
    alone = re.compile(r"^epoch 1/1 step \d+/\d+ .*, 1 of 2 replica groups")
    lighthouse = start_lighthouse(hosts, heartbeat_s)
    launched = []
    try:
        with tempfile.TemporaryDirectory() as out:
            launched = [Launched(*replica_group_command(hosts, g, out, extra)) for g in (0, 1)]
            launched[0].wait_for(re.compile(r"^epoch 1/1 step 20/\d+ .*, 2 of 2 replica groups"))
            hosts.set_link(False)
            cut_at = time.monotonic()
            alone_at, _ = launched[0].wait_for(alone, after=cut_at)
            status, exited = launched[1].ended()
            hosts.set_link(True)
            back_at = time.monotonic()
            launched.append(back := Launched(*replica_group_command(hosts, 1, out, extra)))
            first_step, _ = back.wait_for(STEP)
            healed = "healed from a live replica group" in back.text()
            ends = [launched[0].ended()[0], back.ended()[0]]
    finally:
        hosts.set_link(True)
        for one in launched:
            if one.proc.poll() is None:
                one.kill()
        lighthouse.kill()
        lighthouse.wait()
    return {"group_0_still_s": alone_at - cut_at, "group_1_status": status, "group_1_exited_after_s": exited - cut_at,
            "back_to_first_step_s": first_step - back_at, "healed": healed, "statuses_after": ends,
            "heartbeat_s": heartbeat_s}


def markdown(results: dict) -> str:
    meta = results["meta"]
    timeout = meta["dist_timeout"]
    lines = [f"Hardware: {meta['hardware']}. Command: `{meta['command']}`, at commit {meta['commit']}. Two hosts "
             "(network namespaces, one core and one rank each), the link set down on host 0's end; the outages' runs "
             f"with `--dist-timeout {meta['outage_timeout']}`, the lasting cuts' with `--dist-timeout {timeout}`.", ""]
    if meta.get("unfinished"):
        lines += [f"**Unfinished:** {meta['unfinished']}", ""]
    lines += harness.table(["DDP (torchrun), link down for", "no step line for", "a step (median)", "exit statuses"],
                           [[f"{r['outage_s']:g} s", "no step after it" if r["stood_still_s"] is None else
                             f"{r['stood_still_s']:.1f} s", f"{r['step_s']:.2f} s", r["status"]]
                            for r in results["outages"]])
    lines += ["", *harness.table(
        ["lasting cut", "host 0 exits after", "host 1 exits after", "exit statuses",
         "steps lost (last printed - checkpoint's)"],
        [[r["launcher"], f"{r['exited_after_s'][0]:.1f} s", f"{r['exited_after_s'][1]:.1f} s", r["status"],
          f"{r['steps_lost']} ({r['last_step']} - {r['checkpoint_step']})"] for r in results["lasting"]])]
    if live := results.get("live_recovery"):
        lines += ["", f"Live recovery (heartbeat timeout {live['heartbeat_s']:g} s): group 0 stood still "
                  f"{live['group_0_still_s']:.1f} s after the cut, then trained on alone; group 1 exited (status "
                  f"{live['group_1_status']}) {live['group_1_exited_after_s']:.1f} s after it; its same command, "
                  f"started once the link was back, printed its first step {live['back_to_first_step_s']:.1f} s "
                  f"later ({'healed from group 0' if live['healed'] else 'not healed'}); exit statuses "
                  f"{live['statuses_after']}."]
    return "\n".join(lines) + "\n"


def seconds_list(text: str) -> list[int]:
    return [flags.positive_int(word) for word in text.split(",")]


def parse_args(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.link_faults", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--outages", type=seconds_list,
                        default=[2, 5, 10], metavar="S,S,...", help="the outages' lengths in seconds (default: 2,5,10)")
    parser.add_argument("--dist-timeout", type=flags.positive_int, default=10, metavar="SECONDS",
                        help="the lasting cuts' --dist-timeout: how long a lasting cut is waited for (default: 10)")
    parser.add_argument("--outage-timeout", type=flags.positive_int, default=30, metavar="SECONDS",
                        help="the outages' --dist-timeout: longer than the longest outage and TCP's retransmission "
                             "backoff after it, or the run ends (default: 30)")
    parser.add_argument("--heartbeat", type=flags.positive_int, default=2, metavar="SECONDS",
                        help="the lighthouse's heartbeat timeout (default: 2, as the live recovery demo's)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where link_faults.json and .md go (default: benchmarks/results/cpu-<processor>-"
                             "link-faults)")
    return parser.parse_args(argv)  # a bad value: one line, exit status 2


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.output_dir or harness.ROOT / (network.machine_folder().removesuffix("-network") + "-link-faults")
    typed = sys.argv[1:] if argv is None else argv
    meta = {"hardware": harness.hardware("cpu", 2), "commit": harness.git_commit(), "dist_timeout": args.dist_timeout,
            "outage_timeout": args.outage_timeout,
            "command": shlex.join(["python", "-m", "benchmarks.link_faults", *typed])}
    results = {"meta": meta, "outages": [], "lasting": []}
    plan = [(f"DDP, a {s} s outage",
             lambda hosts, s=s: results["outages"].append(outage(hosts, s, args.outage_timeout))) for s in args.outages]
    plan += [(f"{launcher}, a lasting cut", lambda hosts, launcher=launcher: results["lasting"].append(
        lasting(hosts, launcher, args.dist_timeout))) for launcher in ("torchrun", "spawn")]
    plan += [("live recovery, a lasting cut", lambda hosts: results.update(
        live_recovery=live_recovery(hosts, args.dist_timeout, args.heartbeat)))]
    try:
        with harness.stopped_as_ctrl_c(), network.TwoHosts("link-faults", named=True) as hosts:
            out.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            for i, (name, measure) in enumerate(plan, 1):
                print(f"[{i}/{len(plan)}] {name} ({time.monotonic() - started:.0f} s in all)", flush=True)
                measure(hosts)
                harness.write_whole(out, {"link_faults.json": json.dumps(results, indent=1),
                                            "link_faults.md": markdown(results)})
    except UsageError as error:
        print_line(str(error))
        return error.exit_status
    except KeyboardInterrupt:
        meta["unfinished"] = f"stopped after {len(results['outages']) + len(results['lasting'])} measurements"
        if out.is_dir():
            harness.write_whole(out, {"link_faults.json": json.dumps(results, indent=1),
                                        "link_faults.md": markdown(results)})
        print_line(f"stopped; what was measured is in {out}", error=False)
        return 130
    print(f"written: {out / 'link_faults.md'}, {out / 'link_faults.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
