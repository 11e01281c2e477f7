"""The one prepared check for a lent GPU's few minutes: its steps in order of value, each under its own time limit,
the report written after every step, so that a check cut short still reports what it found.

    python -m benchmarks.gpu_check --output-dir benchmarks/results/gpu-h100     # at most 9 minutes (--budget-s)
    python -m benchmarks.gpu_check --dry-run                                    # the plan: steps, limits, commands
    python -m benchmarks.gpu_check --only tests,job --output-dir DIR            # some steps again

The steps, in this order: the commit and the versions (the device, driver, torch, CUDA, cuDNN, NCCL); the tests
marked gpu at this commit (pytest -m gpu over tests/); the README's fastest command as a whole 50,000-image job
(--compile --cuda-graphs: seconds per epoch of epochs 2-3, the first epoch's and the whole command's); the host
waits of the graph path between progress lines (the epoch's order copied from pinned memory: expected 0);
distributed.py's timeline on one GPU (--profile-steps, then benchmarks.timeline: kernel and NCCL lanes); FSDP
against DDP on CUDA (benchmarks.fsdp_profile); then the benchmark's rows (python -m benchmarks.run), the most telling
first (our fastest, the tuned and the plain peer, the bare step's split into compiled kernels and graph replay,
FSDP's variants), until the budget is spent. A step past its limit is stopped (SIGTERM, then SIGKILL) and the
check goes on; a step that would start with too little time left is skipped. The default budget, 530 s, fits the
9 minutes a lent GPU's call may take; the steps before the benchmark took about 5 of them on an H200 (their
limits: 7 at most), leaving the benchmark 2 to 4.

Writes to --output-dir: report.md (the table a person reads) and report.json after every step, log.txt (what each
step printed), and the benchmark's benchmark.md, .json and .png (its tables are written after every row).
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from examples.local_processes import session_members
from utils import flags

ROOT = Path(__file__).resolve().parent.parent
EPOCH_IMAGES = 50_000
# the job of the headline figure: one process, bfloat16, the data set and its augmentation on the GPU
JOB = ["--dataset", "synthetic", "--train-samples", str(EPOCH_IMAGES), "--test-samples", "10000", "--batch-size",
       "256", "--epochs", "3", "--workers", "0", "--print-freq", "100", "--amp-dtype", "bfloat16", "--loader",
       "device", "--device", "cuda"]
# the same on fewer images (2 epochs of 32 steps: the capture in the first, replays in both), its waits counted
GRAPH_WAITS_JOB = [*JOB[:2], "--train-samples", "8192", "--test-samples", "512", *JOB[6:8], "--epochs", "2", *JOB[10:]]
# the benchmark's rows in order of value: our fastest, the tuned and the plain peer in bfloat16, the bare step's
# split of our speed-up (compiled kernels; compiled kernels replayed from graphs) beside our eager-kernel graph and
# device-loader rows, FSDP's variants, then the seed table, the peers and everything else (each --only value a
# whole name, a keyword or a part)
BENCHMARK_ROWS = ["DDP + bfloat16, CUDA graphs, compiled", "tuned tutorial DDP loop + bfloat16 autocast",
                  "plain tutorial DDP loop + bfloat16 autocast", "bare step, compiled", "bare step, CUDA graphs",
                  "DDP + bfloat16, CUDA graphs", "DDP + bfloat16, all techniques", "DDP + bfloat16 autocast",
                  "FSDP + bfloat16 policy", "FSDP + bfloat16 autocast, one unit", "FSDP (fully_shard)",
                  "FSDP, no reshard after forward", "seed",
                  "DDP (spawn)", "peers", "others"]
# distributed.py's few profiled steps on one GPU, for its timeline (benchmarks/timeline.py)
TIMELINE_RUN = ["--dataset", "synthetic", "--train-samples", "8192", "--test-samples", "512", "--batch-size", "256",
                "--epochs", "1", "--workers", "4", "--print-freq", "100", "--device", "cuda", "--profile-steps", "3"]
# how torch.cuda.set_sync_debug_mode("warn") words each host wait (not its notice that the mode is a prototype)
SYNC_WARNING = "called a synchronizing CUDA operation"
GRACE_S = 20  # what a step stopped at its limit gets to exit after SIGTERM (the benchmark writes its tables)
MIN_STEP_S = 30  # a step is not started with less time than this left in the check's budget
CALL_S = 540  # the 9 minutes one call to a lent GPU may take (its machine's start is counted apart)


@dataclass
class Step:
    name: str
    limit_s: int
    what: str
    command: list = field(default_factory=list)  # run from the repository's root, in a session of its own
    read: str = "exit"  # how the step's result is read: exit, pytest, job, waits or benchmark


def job(name: str, extra: list[str], limit_s: int, what: str) -> Step:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return Step(name, limit_s, what, [*torchrun, "distributed_apex.py", *JOB, *extra, "--output-dir", "{tmp}"],
                read="job")


def steps(out: Path) -> list[Step]:
    """Every step, in the order they run."""
    me = [sys.executable, "-m", "benchmarks.gpu_check"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    timeline = shlex.join([*torchrun, "distributed.py", *TIMELINE_RUN, "--output-dir", "{tmp}/run"]) + " && " + \
        shlex.join([sys.executable, "-m", "benchmarks.timeline", "{tmp}/run", "--output",
                    str(out / "timeline-distributed.png"), "--title", "distributed.py, one GPU"])
    return [
        Step("versions", 20, "the commit, the device, the driver, torch, CUDA, cuDNN, NCCL",
             [*me, "--inner", "versions"]),
        Step("tests", 170, "the tests marked gpu at this commit (pytest -m gpu tests/)",
             [sys.executable, "-m", "pytest", "-q", "-rA", "-m", "gpu", "-n", "6", "-p", "no:cacheprovider",
              "--timeout", "160", "tests"], read="pytest"),
        job("job-compiled-cuda-graphs", ["--compile", "--cuda-graphs"], 75,
            "the README's fastest command as a whole job (--compile --cuda-graphs, 3 epochs of 50,000 images)"),
        Step("graph-waits", 30, "host waits of the graph path between progress lines (tests/script_driver.py); "
                                "expected 0",
             [*torchrun, "tests/script_driver.py", "--host-reads", "{tmp}/host_reads.txt", "--sync-waits",
              "distributed_apex.py", *GRAPH_WAITS_JOB, "--cuda-graphs", "--output-dir", "{tmp}/run"], read="waits"),
        Step("timeline", 60, "distributed.py's timeline on one GPU: kernel and NCCL lanes, the overlap share",
             ["bash", "-c", timeline], read="text"),
        Step("fsdp-profile", 60, "FSDP against DDP on one GPU, bfloat16, batch 256 (benchmarks.fsdp_profile)",
             [sys.executable, "-m", "benchmarks.fsdp_profile", "--device", "cuda", "--batch-size", "256",
              "--precision", "bfloat16"], read="text"),
        Step("benchmark", 600, "python -m benchmarks.run, the rows in order of value until the time is spent",
             [sys.executable, "-m", "benchmarks.run", *[a for row in BENCHMARK_ROWS for a in ("--only", row)],
              "--output-dir", str(out)], read="benchmark"),
    ]


def left_in_session(sid: int) -> list[str]:
    """The processes still in session `sid` (a step's), as 'pid command'."""
    found = []
    for pid in session_members(sid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()[:120].replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended since
            continue
        found.append(f"{pid} {command}")
    return found


def run_step(step: Step, limit_s: float, log) -> dict:
    """The step's command under its limit: its exit status, output, seconds, and what was left running."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [part.replace("{tmp}", tmp) for part in step.command]
        log.write(f"\n===== {step.name}: {' '.join(command)} (limit {limit_s:.0f} s)\n")
        log.flush()
        started = time.perf_counter()
        # into a file, not a pipe: a process the step leaves behind cannot keep the check waiting for its output
        with open(Path(tmp, "output.txt"), "w+") as output_file:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=output_file, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            timed_out = False
            try:
                proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            seconds = time.perf_counter() - started
            output_file.seek(0)
            output = output_file.read()
        time.sleep(1)  # what the step's processes left behind, once its first process has gone
        left = left_in_session(proc.pid)
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        log.write(output)
        log.flush()
        result = {"name": step.name, "what": step.what, "seconds": round(seconds, 1), "exit": proc.returncode,
                  "timed_out": timed_out, "left_running": left}
        result.update(READERS[step.read](output, Path(tmp)))
        if timed_out:
            result["ok"] = False
            result["summary"] = "; ".join(filter(None, [f"stopped at its limit of {limit_s:.0f} s", result["summary"]]))
        elif proc.returncode != 0 and step.read != "pytest":
            result["ok"] = False
        if left:
            result["ok"] = False
            result["summary"] += f"; {len(left)} process(es) left running, killed"
        return result


def last_lines(output: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-n:])[:400]


def read_exit(output: str, tmp: Path) -> dict:
    try:
        return {"ok": True, "summary": last_lines(output, 1), "found": json.loads(output.strip().splitlines()[-1])}
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "summary": last_lines(output)}


def read_text(output: str, tmp: Path) -> dict:
    """A step that prints what it found: its last lines (run_step marks a failed exit)."""
    return {"ok": True, "summary": last_lines(output, 4)}


def read_pytest(output: str, tmp: Path) -> dict:
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)(?:\s+-\s+(.*))?$", output, re.M)
    # the last line of pytest -q: "11 passed, 3 skipped in 174.29s (0:02:54)" (between ='s without -q)
    totals = re.findall(r"^=* ?(\d+ (?:passed|failed|error|skipped|deselected).*?) in [\d.]+s", output, re.M)
    summary = totals[-1] if totals else last_lines(output)
    failed = [f"{status} {test}" + (f": {why[:200]}" if why else "") for status, test, why in outcomes
              if status in ("FAILED", "ERROR")]
    return {"ok": bool(totals) and not failed and "failed" not in summary and "error" not in summary,
            "summary": summary, "tests": [f"{status} {test}" for status, test, _ in outcomes], "failures": failed}


def read_job(output: str, tmp: Path) -> dict:
    try:
        records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    except OSError:
        return {"ok": False, "summary": "no metrics.jsonl: " + last_lines(output)}
    epochs = [EPOCH_IMAGES / r["images_per_s"] for r in records[1:] if r.get("images_per_s")]
    found = {"s_per_epoch": [round(s, 3) for s in epochs], "train_loss": [r["train_loss"] for r in records],
             "test_loss": [r["test_loss"] for r in records], "top1": [r["top1"] for r in records],
             "epoch_time_s": [r["epoch_time_s"] for r in records], "peak_memory_mb": records[-1].get("peak_memory_mb")}
    best = f"{min(epochs):.2f} s per 50,000-image epoch (epochs 2-3: {', '.join(f'{s:.2f}' for s in epochs)})" \
        if epochs else "no timed epoch"
    first = f"; epoch 1's training steps (compilation, warm-up) {records[0]['epoch_time_s']:.1f} s"
    losses = ", ".join(f"{loss:.3f}" for loss in found["train_loss"])
    return {"ok": len(records) == 3, "summary": f"{best}{first}; train_loss {losses}", "found": found}


def read_waits(output: str, tmp: Path) -> dict:
    """A waits step prints one JSON line: {"waits": N, "where": [...], ...}; the driver writes host_reads.txt."""
    reads = tmp / "host_reads.txt"
    if reads.exists():
        lines = reads.read_text().strip().splitlines()
        count = sum(int(line.split()[0]) for line in lines if line.split()[0].isdigit())
        return {"ok": count == 0, "summary": f"{count} host read(s) or wait(s) between progress lines"
                + (f": {'; '.join(lines)[:300]}" if count else ""), "found": lines}
    found = read_exit(output, tmp)
    if found["ok"]:
        waits = found["found"]
        found["ok"] = waits["waits"] == 0
        found["summary"] = f"{waits['waits']} host wait(s) in {waits['batches']} batches" + (
            f": {'; '.join(waits['where'])[:300]}" if waits["waits"] else "")
    return found


def read_benchmark(output: str, tmp: Path) -> dict:
    done = re.findall(r"^\[\d+/\d+\] (.*?)(?:; about .*|; under a minute left)?$", output, re.M)
    return {"ok": "failed:" not in output, "summary": f"{len(done)} stage(s) done: " + "; ".join(done)[:600],
            "stages": done}


READERS = {"exit": read_exit, "pytest": read_pytest, "job": read_job, "waits": read_waits, "benchmark": read_benchmark,
           "text": read_text}


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# GPU check", "", f"`{report['command']}` at commit {report.get('commit', 'unknown')}", "",
             *[f"- {line}" for line in report["versions"]], "",
             "| step | what | result | seconds |", "|---|---|---|---|"]
    for r in report["steps"]:
        mark = "ok" if r.get("ok") else "skipped" if r.get("skipped") else "**FAILED**"
        lines.append(f"| {r['name']} | {r['what']} | {mark}: {r['summary'].replace('|', '/')} | {r['seconds']} |")
    failures = [f for r in report["steps"] for f in r.get("failures", [])]
    if failures:
        lines += ["", "Failed tests:", "", *[f"- {f}" for f in failures]]
    if report.get("unfinished"):
        lines += ["", f"**Unfinished**: {report['unfinished']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def git_commit() -> str:
    """The commit checked out here, with "+changes" when the tree differs from it; "unknown" without git (a copy
    of the tree without .git: give --commit)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def inner_versions() -> dict:
    import torch
    props = torch.cuda.get_device_properties(0)
    smi = shutil.which("nvidia-smi")
    driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip() if smi else "unknown"
    return {"device": torch.cuda.get_device_name(0), "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "python": sys.version.split()[0], "cpus": os.cpu_count()}


def inner_loader_waits() -> dict:
    """Batches of the device loader, training and test, as distributed_apex.py makes them with --loader device, under
    torch.cuda.set_sync_debug_mode('warn'): each host wait is a warning."""
    import warnings

    import torch

    from speed.device_loader import DeviceLoader
    from utils import data
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    train = data.Images(*data.synthetic(4096, train=True), augment=True, seed=0)
    test = data.Images(*data.synthetic(1000, train=False), augment=False, seed=0)
    sampler = data.ResumableDistributedSampler(train, num_replicas=1, rank=0, seed=0, drop_last=True)
    train_loader = DeviceLoader(train, 256, sampler, device, drop_last=True)
    test_loader = DeviceLoader(test, 256, range(0, len(test), 1), device)  # rank 0 of 1: every test image
    waits, batches = [], 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for loader in (train_loader, test_loader):  # each one's order: copied once an iteration, by design
                batches += sum(1 for _ in loader)
            torch.cuda.set_sync_debug_mode("default")
        waits += [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno} {str(w.message)[:80]}" for w in caught
                  if SYNC_WARNING in str(w.message)]
    torch.cuda.synchronize()
    return {"waits": len(waits), "batches": batches, "where": sorted(set(waits))}


def main(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--output-dir", default="runs/gpu_check",
                        help="where report.md, report.json, log.txt and the benchmark's tables go")
    parser.add_argument("--budget-s", type=flags.positive_int, default=530,
                        help="seconds for the whole check; each step gets the smaller of its own limit and what is "
                             "left, and the benchmark, last, what remains")
    parser.add_argument("--only", default=None, metavar="STEPS",
                        help="run only these steps, separated by commas (a part of a name selects every step "
                             "that has it: 'job' is the three jobs); --dry-run lists them")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, their limits and commands; run none")
    parser.add_argument("--commit", default=None,
                        help="the commit this tree is, for the report (default: git's, where the tree has .git)")
    parser.add_argument("--inner", choices=["versions", "loader-waits"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:  # a step of this check, in a process of its own
        print(json.dumps({"versions": inner_versions, "loader-waits": inner_loader_waits}[args.inner]()), flush=True)
        return
    out = Path(args.output_dir)
    chosen = steps(out)
    if args.only:
        texts = [t.strip() for t in args.only.split(",")]
        unknown = [t for t in texts if not any(t in s.name for s in chosen)]
        if unknown:
            parser.error(f"--only {unknown[0]!r} names no step (the steps: {', '.join(s.name for s in chosen)})")
        chosen = [s for s in chosen if any(t in s.name for t in texts)]
    if args.dry_run:
        before = 0  # the most the steps before the benchmark can take, by their limits
        for step in chosen:
            limit = f"the rest, {max(args.budget_s - before - GRACE_S, 0):3d} s at least" \
                if step.read == "benchmark" else f"at most {step.limit_s:3d} s"
            before += 0 if step.read == "benchmark" else step.limit_s
            print(f"{step.name:26} {limit}  {step.what}\n{'':26} {shlex.join(step.command)}")
        print(f"budget: {args.budget_s} s in all ({'within' if args.budget_s <= CALL_S else 'over'} the {CALL_S} s "
              f"of one call to a lent GPU); a step is not started with under {MIN_STEP_S} s left")
        return
    import torch
    if not torch.cuda.is_available():
        parser.error("no GPU is visible: this check measures the GPU path (--dry-run lists its steps)")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    given = sys.argv[1:] if argv is None else argv
    report = {"command": shlex.join(["python", "-m", "benchmarks.gpu_check", *given]),
              "commit": args.commit or git_commit(), "versions": [], "steps": [],
              "unfinished": "no step has finished yet"}
    with open(out / "log.txt", "w") as log:
        for k, step in enumerate(chosen):
            left = args.budget_s - (time.perf_counter() - started)
            if left < MIN_STEP_S:
                report["steps"].append({"name": step.name, "what": step.what, "ok": False, "skipped": True,
                                        "seconds": 0, "summary": f"not started: {left:.0f} s left of the budget"})
                continue
            limit = left - GRACE_S if step.read == "benchmark" else min(step.limit_s, left)
            print(f"[{k + 1}/{len(chosen)}] {step.name} (at most {limit:.0f} s): {step.what}", flush=True)
            result = run_step(step, limit, log)
            report["steps"].append(result)
            if step.name == "versions" and "found" in result:
                report["versions"] = [f"{key}: {value}" for key, value in result["found"].items()]
            report["unfinished"] = (f"{k + 1} of {len(chosen)} steps done when this was written"
                                    if k + 1 < len(chosen) else None)
            write_report(report, out)
            print(f"    {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s: {result['summary']}", flush=True)
    report["unfinished"] = None  # every step ran or was skipped, saying why
    write_report(report, out)
    print(f"wrote {out / 'report.md'}, report.json, log.txt")
    sys.exit(0 if all(r.get("ok") for r in report["steps"]) else 1)


if __name__ == "__main__":
    main()
