"""Live recovery on one machine, in one command: distributed_live_recovery.py's replica groups lose one and heal it.

It starts a torchft lighthouse and --groups replica groups (each a torchrun of --procs-per-group CPU processes),
kills one group outright (SIGKILL to its torchrun and processes, as a lost machine) at --kill-at-step, lets the
others train on alone for --down-for-steps steps (their progress lines say how many groups take part), starts it
again (it heals: it copies a live group's weights, optimizer, schedule and place in the run), waits for all to end,
and compares every group's final checkpoint: the same weights, bit for bit, or exit status 1.

    python examples/live_recovery_demo.py                       # 2 groups of 1 process, about a minute on 2 cores
    python examples/live_recovery_demo.py --groups 3 -- --epochs 3   # after --: flags for every group's script

Ctrl-C (or SIGTERM) stops every group at a step, each writing its checkpoint, and leaves no process behind.
Each group's whole output is in <output-dir>/replica_group_<g>.log; the lighthouse's in <output-dir>/lighthouse.log.

Run as a script, the demo has only its own folder on its import path, not the repository's packages: it imports torch
only to compare the checkpoints at the end, and otherwise the standard library and the two modules beside it
(local_processes.py, own_lighthouse.py), which keep to the standard library for it.
"""
import argparse
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import own_lighthouse
from local_processes import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "distributed_live_recovery.py")
TRAINING = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "960", "--test-samples", "200",
            "--batch-size", "16", "--epochs", "2", "--workers", "0", "--print-freq", "5"]
PROGRESS = re.compile(r"^epoch (\d+)/\d+ step (\d+)/(\d+) ")
WAIT_S = 300  # the longest any stage may take before the demo gives up


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups to start (2 or more)")
    parser.add_argument("--procs-per-group", type=int, default=1, help="CPU processes in each group (torchrun)")
    parser.add_argument("--kill-group", type=int, default=None, help="the group to kill (default: the last)")
    parser.add_argument("--kill-at-step", type=int, default=15, help="kill it once it has done this many steps")
    parser.add_argument("--down-for-steps", type=int, default=10,
                        help="start it again once the others have done this many more steps without it")
    parser.add_argument("--port", type=int, default=29510, help="the lighthouse's port")
    parser.add_argument("--output-dir", default=os.path.join("runs", "live_recovery_demo"),
                        help="the groups' checkpoints and logs (each group in replica_group_<g>/)")
    parser.add_argument("training", nargs="*", metavar="-- FLAGS",
                        help=f"flags for every group's script, after the defaults {' '.join(TRAINING)}")
    args = parser.parse_args(argv)
    args.kill_group = args.groups - 1 if args.kill_group is None else args.kill_group
    problems = [(args.groups < 2, "--groups must be 2 or more: one dies, another trains on"),
                (args.procs_per_group < 1, "--procs-per-group must be 1 or more"),
                (not 0 <= args.kill_group < args.groups, f"--kill-group must be 0 to {args.groups - 1}"),
                (min(args.kill_at_step, args.down_for_steps) < 1,
                 "--kill-at-step and --down-for-steps must be 1 or more"),
                (importlib.util.find_spec("torchft") is None, "the demo needs torchft: pip install torchft"),
                (own_lighthouse.program() is None,
                 "torchft_lighthouse is not on PATH (pip install torchft installs it)"),
                (port_taken(args.port), f"port {args.port} is in use (another lighthouse?); give another --port")]
    for problem in (message for failed, message in problems if failed):
        parser.error(problem)
    return args


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("::", port))
        except OSError:
            return True
    return False


class Group:
    """One replica group: its torchrun in a session of its own (killed as one), its lines read by a thread."""

    def __init__(self, g: int, args, lighthouse: str):
        self.g, self.args, self.lighthouse = g, args, lighthouse
        self.step = 0  # the steps this group has reported, over all epochs
        self.healed = self.process = None
        # once stopped: the script's own stop, warning and error lines are shown; torchrun's report goes to the log
        self.stopping = False

    def start(self, fresh: bool) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={self.args.procs_per_group}", SCRIPT, *TRAINING, *self.args.training,
               "--replica-group", str(self.g), "--replica-groups", str(self.args.groups),
               "--lighthouse", self.lighthouse, "--output-dir", self.args.output_dir] + (["--restart"] if fresh else [])
        threads = max(1, (os.cpu_count() or 1) // (self.args.groups * self.args.procs_per_group))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        log = open(os.path.join(self.args.output_dir, f"replica_group_{self.g}.log"), "a")  # noqa: SIM115
        self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, args=(self.process, log), daemon=True).start()

    def _read(self, process, log) -> None:
        for line in process.stdout:
            log.write(line)
            log.flush()
            if re.match(r"^\[rank\d+\]:\[W", line):  # torch's C++ warnings, once per process: in the log only
                continue
            if self.stopping and not (line.startswith(("stopped by", "warning:")) or ": error: " in line):
                continue  # torchrun's traceback of the signal: in the log only; the script's own lines are shown
            print(f"[group {self.g}] {line}", end="", flush=True)
            if match := PROGRESS.match(line):
                epoch, step, steps = map(int, match.groups())
                self.step = (epoch - 1) * steps + step
            if line.startswith("healed from"):
                self.healed = line.strip()
        log.close()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """`signum` to the group's torchrun, and with SIGKILL to its processes too (torchrun starts each in a
        session of its own, so that only torchrun passes a stop signal on to them)."""
        if not self.running():
            return
        for pid in ([*descendants(self.process.pid), self.process.pid] if signum == signal.SIGKILL
                    else [self.process.pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def wait_until(condition, what: str, groups) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up after {WAIT_S} s waiting for {what}")
        if not any(group.running() for group in groups):
            raise RuntimeError(f"every group ended while waiting for {what}")
        time.sleep(0.2)


def same_weights(args) -> bool:
    """Every group's final checkpoint against group 0's: equal tensors, bit for bit."""
    import torch

    states = [torch.load(os.path.join(args.output_dir, f"replica_group_{g}", "checkpoint.pt"), map_location="cpu",
                         weights_only=False) for g in range(args.groups)]
    first = states[0]["model"]
    differing = [(g, name) for g, state in enumerate(states[1:], 1) for name, tensor in state["model"].items()
                 if not torch.equal(tensor, first[name])]
    steps = sorted({state["manager"]["step"] for state in states})
    if differing:
        print(f"[demo] the groups' weights differ: {differing[:5]} ... ({len(differing)} tensors)", flush=True)
        return False
    print(f"[demo] all {args.groups} replica groups ended on the same weights, bit for bit ({len(first)} tensors, "
          f"committed steps {steps})", flush=True)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    lighthouse_log = open(os.path.join(args.output_dir, "lighthouse.log"), "w")  # noqa: SIM115
    # the job's coordinator: a quorum of one group is enough to train on; a group silent 2 s is dead
    lighthouse = own_lighthouse.start(args.port, min_replicas=1, heartbeat_timeout_ms=2000, output=lighthouse_log,
                                      new_session=True)
    address = own_lighthouse.address(args.port)
    groups = [Group(g, args, address) for g in range(args.groups)]
    stop = []

    def interrupt(signum, _frame):  # Ctrl-C and SIGTERM alike: the groups are stopped below
        stop.append(signum)
        raise KeyboardInterrupt
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    try:
        if not own_lighthouse.answers(lighthouse, args.port, wait_s=10):
            raise RuntimeError("the lighthouse did not start (see lighthouse.log)")
        print(f"[demo] lighthouse at {address}; starting {args.groups} replica groups of {args.procs_per_group} "
              "process(es)", flush=True)
        for group in groups:
            group.start(fresh=True)
        victim, others = groups[args.kill_group], [g for g in groups if g is not groups[args.kill_group]]
        wait_until(lambda: victim.step >= args.kill_at_step, f"group {victim.g} to reach step {args.kill_at_step}",
                   groups)
        victim.signal(signal.SIGKILL)
        # the groups step in lockstep (a quorum a step), but a group's progress line may not be read yet: the
        # victim's is, so count the steps alone from the furthest of all
        killed_at = max(group.step for group in groups)
        print(f"[demo] SIGKILL to replica group {victim.g} (its torchrun and processes) at step {victim.step}: the "
              "others train on without it", flush=True)
        wait_until(lambda: max(group.step for group in others) >= killed_at + args.down_for_steps,
                   f"the others to do {args.down_for_steps} steps alone", groups)
        print(f"[demo] starting replica group {victim.g} again: it heals from a live group", flush=True)
        victim.start(fresh=False)
        wait_until(lambda: victim.healed, f"group {victim.g} to heal", groups)
        for group in groups:
            group.process.wait()
        failed = [group.g for group in groups if group.process.returncode != 0]
        if failed:
            print(f"[demo] replica group(s) {failed} failed: see {args.output_dir}/replica_group_<g>.log", flush=True)
            return 1
        return 0 if same_weights(args) else 1
    except KeyboardInterrupt:
        name = signal.Signals(stop[0] if stop else signal.SIGINT).name
        print(f"[demo] {name}: stopping every group at a step (each writes its checkpoint)", flush=True)
        for group in groups:
            group.stopping = True
            group.signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        while any(group.running() for group in groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"[demo] torchrun's own report of the signal (a traceback) is in {args.output_dir}/"
              "replica_group_<g>.log", flush=True)
        return 128 + (stop[0] if stop else signal.SIGINT)
    except RuntimeError as error:
        print(f"[demo] {error}; see {args.output_dir}/replica_group_<g>.log", file=sys.stderr, flush=True)
        return 1
    finally:
        for group in groups:
            group.signal(signal.SIGKILL)
        own_lighthouse.stop(lighthouse)


if __name__ == "__main__":
    sys.exit(main())
