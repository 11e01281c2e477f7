"""The one prepared check for a lent GPU's few minutes: its steps in order of value, each under its own time limit,
the report written after every step, so that a check cut short still reports what it found.

    python -m lent_gpu.check --output-dir benchmarks/results/gpu-h100     # at most 480 s (--budget-s)
    python -m lent_gpu.check --dry-run                                    # the plan: its budget, its commands
    python -m lent_gpu.check --only tests,job --output-dir DIR            # some steps again

The steps, in this order: the date, the commit and the versions (the device, driver, torch, torchvision, triton,
CUDA, cuDNN, NCCL, Python); the benchmark's rows that answer open questions (python -m benchmarks.run: our fastest,
the tuned peer, FSDP with the whole model one unit and FSDP's default layout, under the float32 and bfloat16
ideals); the host waits of the graph path between progress lines (expected 0); the tests marked gpu at this commit
(pytest -m gpu over tests/, each test's result written as it ends); FSDP against DDP on CUDA
(benchmarks.fsdp_profile); the README's fastest command as a whole 50,000-image job (--compile --cuda-graphs);
distributed.py's timeline on one GPU; then the benchmark's other rows, and last its float16 rows with their ideal.

The check fits its call by construction. A step's worst case is its start-up allowance (START_S for each Python
process that imports torch, started one after another), its limit, its grace (SIGTERM, then SIGKILL) and its
wrap-up; a step starts only if its worst case fits what is left of --budget-s (480 s by default, a minute inside
the 9 of a call), counted from this process's own start; one that does not fit is skipped, saying why (a benchmark
or test step is shortened down to its minimum first). --dry-run prints that arithmetic line by line.

Writes to --output-dir: report.md (the table a person reads) and report.json after every step, log.txt (what each
step printed), tests.jsonl (a line as each test starts and ends), timeline-distributed.png, and a folder per
benchmark step with its benchmark.md, .json and .png (its tables written after every row).
"""
import argparse
import datetime
import json
import math
import os
import platform
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

from benchmarks.harness import EPOCH_IMAGES, ROOT, git_commit
from examples.local_processes import alive, descendants, session_members
from utils import flags

# the job of the headline figure: one process, bfloat16, the data set and its augmentation on the GPU
JOB = ["--dataset", "synthetic", "--train-samples", str(EPOCH_IMAGES), "--test-samples", "10000", "--batch-size",
       "256", "--epochs", "3", "--workers", "0", "--print-freq", "100", "--amp-dtype", "bfloat16", "--loader",
       "device", "--device", "cuda"]
# the same on fewer images (2 epochs of 32 steps: the capture in the first, replays in both), its waits counted
GRAPH_WAITS_JOB = [*JOB[:2], "--train-samples", "8192", "--test-samples", "512", *JOB[6:8], "--epochs", "2", *JOB[10:]]
# the benchmark's rows that answer open questions, in this order: our fastest (distributed_apex.py --amp-dtype
# bfloat16 --loader device --cuda-graphs --compile), the tuned peer it is compared with (benchmarks.run's
# TUNED_LOOP_BF16), FSDP with the whole model one unit (--units model) and FSDP's default layout (the stages), both
# in bfloat16 (docs/sharding.md). Only float32 and bfloat16 rows: the benchmark measures the ideal of each precision
# its rows use before any row, so that no float16 ideal comes first.
FIRST_ROWS = ["DDP + bfloat16, CUDA graphs, compiled",
              "tuned tutorial DDP loop + bfloat16 autocast (compiled, channels-last, fused SGD)",
              "FSDP + bfloat16 autocast, one unit", "FSDP + bfloat16 policy"]
# then the rest in order of value (each a whole name, a keyword of benchmarks.run or a part of names): DDP in
# bfloat16 (what FSDP is compared with), the plain peer, the bare step's split of our speed-up (compiled kernels;
# compiled kernels replayed from graphs), our eager-kernel graph and device-loader rows, FSDP's float32 variants,
# then the seed table, the peers and everything else; the float16 rows are left to a step of their own, the last
FIRST_OF_THE_REST = ["DDP + bfloat16 autocast", "plain tutorial DDP loop + bfloat16 autocast", "bare step, compiled",
                     "bare step, CUDA graphs", "DDP + bfloat16, CUDA graphs", "DDP + bfloat16, all techniques",
                     "FSDP (fully_shard)", "FSDP, no reshard after forward", "seed", "DDP (spawn)", "peers", "others"]
# distributed.py's few profiled steps on one GPU, for its timeline (tools/timeline.py)
TIMELINE_RUN = ["--dataset", "synthetic", "--train-samples", "8192", "--test-samples", "512", "--batch-size", "256",
                "--epochs", "1", "--workers", "4", "--print-freq", "100", "--device", "cuda", "--profile-steps", "3"]
# how torch.cuda.set_sync_debug_mode("warn") words each host wait (not its notice that the mode is a prototype)
SYNC_WARNING = "called a synchronizing CUDA operation"
TESTS_LOG = "GPU_CHECK_TESTS_LOG"  # the variable that turns this module, as a pytest plugin (-p), on: its file

# The budget. One call to a lent GPU may take 10 minutes and this check is given 9 of them (CALL_S); it takes at
# most BUDGET_S by construction, which leaves a minute for what is not counted (the tree's copy, the machine's
# start). Each allowance below is counted in every step's worst case (--dry-run prints them).
CALL_S = 540
BUDGET_S = 480
# the start of one Python process that imports torch: on a lent H200 the whole versions step (Python, torch, CUDA's
# start, nvidia-smi) took 4.5 s; `python -c "import torch"` took 5.3-8.6 s on 2 busy cores of the development
# machine. A step's allowance is this times the processes it starts one after another (torchrun, then its rank)
START_S = 10
CHECK_START_S = 15  # this check's own start (Python, torch, git) in the plan; when it runs, the time since its start
GRACE_S = 3  # from SIGTERM to SIGKILL for a step stopped at its limit (a Python process without a handler ends at once)
BENCHMARK_GRACE_S = 10  # the benchmark stops its row's launcher (then the check kills what is left of the row)
KILL_WAIT_S = 2  # after SIGKILL, at most this long for the step's first process to be gone
SETTLE_S = 1  # after a step: time for the processes it left behind to show
WRAP_S = 2  # after a step, at most: SETTLE_S, killing what it left, reading its output, writing the report
FINISH_S = 2  # the last report


@dataclass
class Step:
    name: str
    limit_s: int  # what the step may run once its processes have started
    what: str
    command: list = field(default_factory=list)  # run from the repository's root, in a session of its own
    read: str = "exit"  # how the step's result is read: exit, pytest, job, waits, benchmark or text
    starts: int = 1  # Python processes that import torch, started one after another (torchrun, then its rank)
    grace_s: int = GRACE_S
    min_s: int | None = None  # a step that may be shortened to fit what is left (none: it runs whole or not at all)
    env: dict = field(default_factory=dict)  # more environment ({out}: the output folder, {tmp}: the step's own)

    @property
    def startup_s(self) -> int:
        return self.starts * START_S

    @property
    def grace_and_kill_s(self) -> int:
        return self.grace_s + KILL_WAIT_S

    @property
    def overhead_s(self) -> int:
        """All of the step's worst case but its limit: start-up, grace with SIGKILL's wait, wrap-up."""
        return self.startup_s + self.grace_and_kill_s + WRAP_S


def fits(step: Step, left: float) -> int | None:
    """The limit the step runs under when `left` seconds of the budget remain: its own, less down to its minimum
    for a step that may be shortened; None when it does not fit."""
    room = math.floor(left - step.overhead_s)
    if room >= step.limit_s:
        return step.limit_s
    if step.min_s is not None and room >= step.min_s:
        return room
    return None


def job(name: str, extra: list[str], limit_s: int, what: str) -> Step:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return Step(name, limit_s, what, [*torchrun, "distributed_apex.py", *JOB, *extra, "--output-dir", "{tmp}"],
                read="job", starts=2)


def benchmark_groups() -> dict[str, list[str]]:
    """The benchmark's rows (whole names), by step: the first rows, the rest but the float16 ones, the float16 ones."""
    from benchmarks import run as bench  # here: it imports torch, which the check's own process needs late
    every = bench.rows("cuda")
    float16 = [r.name for r in every if r.amp == "float16"]
    ordered = [r.name for r in bench.rows_named(FIRST_OF_THE_REST, "cuda")]
    ordered += [r.name for r in every if r.name not in ordered]
    return {"rows-first": FIRST_ROWS, "rows-rest": [n for n in ordered if n not in FIRST_ROWS + float16],
            "rows-float16": float16}


def benchmark(name: str, rows: list[str], out: Path, limit_s: int, min_s: int, what: str) -> Step:
    only = [a for row in rows for a in ("--only", row)]  # whole names: each stands for itself, commas and all
    return Step(name, limit_s, what, [sys.executable, "-m", "benchmarks.run", *only, "--output-dir", str(out / name)],
                read="benchmark", grace_s=BENCHMARK_GRACE_S, min_s=min_s)


def steps(out: Path) -> list[Step]:
    """Every step, in the order they run."""
    me = [sys.executable, "-m", "lent_gpu.check"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    timeline = shlex.join([*torchrun, "distributed.py", *TIMELINE_RUN, "--output-dir", "{tmp}/run"]) + " && " + \
        shlex.join([sys.executable, "-m", "tools.timeline", "{tmp}/run", "--output",
                    str(out / "timeline-distributed.png"), "--title", "distributed.py, one GPU"])
    groups = benchmark_groups()
    return [
        Step("versions", 6, "the device, the driver, torch, torchvision, triton, CUDA, cuDNN, NCCL, Python",
             [*me, "--inner", "versions"]),
        # the float32 and bfloat16 ideals with their peaks (some 60 s: on the H200 three took 90 s with the
        # benchmark's start), the four rows (there 17-33 s each, our compiled one 33 s; the tuned peer, compiled too,
        # not measured yet: some 45 s), about 180 s in all; then the float32 ideal again
        benchmark("rows-first", groups["rows-first"], out, 190, 90,
                  "the rows that answer open questions: our fastest, the tuned peer, FSDP's one unit and its default "
                  "layout (python -m benchmarks.run)"),
        Step("graph-waits", 15, "host waits of the graph path between progress lines (tests/script_driver.py); "
                                "expected 0",
             [*torchrun, "tests/script_driver.py", "--host-reads", "{tmp}/host_reads.txt", "--sync-waits",
              "distributed_apex.py", *GRAPH_WAITS_JOB, "--cuda-graphs", "--output-dir", "{tmp}/run"], read="waits",
             starts=2),
        # each test to the next free worker (--dist load; the GPU tests share no module fixture): the H200's 174 s
        # were test_gpu.py's 7 tests one after another on one worker of --dist loadfile. A test that hangs fails
        # with its stack at --timeout, before the step's limit
        Step("tests", 155, "the tests marked gpu at this commit (pytest -m gpu tests/), each one's result in "
                           "tests.jsonl as it ends",
             [sys.executable, "-m", "pytest", "-q", "-rA", "-m", "gpu", "-n", "6", "--dist", "load", "-p",
              "no:cacheprovider", "-p", "lent_gpu.check", "--timeout", "140", "tests"], read="pytest", starts=2,
             min_s=60, env={TESTS_LOG: "{out}/tests.jsonl"}),
        Step("fsdp-profile", 50, "FSDP against DDP on one GPU, bfloat16, batch 256 (benchmarks.fsdp_profile)",
             [sys.executable, "-m", "benchmarks.fsdp_profile", "--device", "cuda", "--batch-size", "256",
              "--precision", "bfloat16"], read="text"),
        job("job-compiled-cuda-graphs", ["--compile", "--cuda-graphs"], 45,
            "the README's fastest command as a whole job (--compile --cuda-graphs, 3 epochs of 50,000 images)"),
        Step("timeline", 35, "distributed.py's timeline on one GPU: kernel and NCCL lanes, the overlap share",
             ["bash", "-c", timeline], read="text", starts=3),
        benchmark("rows-rest", groups["rows-rest"], out, 420, 90,
                  "the benchmark's other rows but the float16 ones, in order of value, until the time is spent"),
        benchmark("rows-float16", groups["rows-float16"], out, 120, 90,
                  "the benchmark's float16 rows, after the float16 ideal"),
    ]


def plan(chosen: list[Step], budget_s: int) -> list[dict]:
    """The check's worst case, line by line: its own start, then each step as `fits` decides it when every step
    before ran to its limit, was stopped and took all its allowances; then the last report."""
    lines = [{"name": "this check's own start", "startup": CHECK_START_S, "worst": CHECK_START_S}]
    spent = CHECK_START_S
    for step in chosen:
        left = budget_s - spent - FINISH_S
        limit = fits(step, left)
        if limit is None:
            need = step.overhead_s + (step.limit_s if step.min_s is None else step.min_s)
            lines.append({"name": step.name, "worst": 0, "note": f"skipped in the worst case: needs {need} s, "
                                                                  f"{max(left, 0):.0f} s left"})
            continue
        worst = step.overhead_s + limit
        lines.append({"name": step.name, "startup": step.startup_s, "limit": limit, "grace": step.grace_and_kill_s,
                      "wrap": WRAP_S, "worst": worst,
                      "note": f"shortened from {step.limit_s} s" if limit < step.limit_s else ""})
        spent += worst
    lines.append({"name": "the last report", "wrap": FINISH_S, "worst": FINISH_S})
    total = 0
    for line in lines:
        total += line["worst"]
        line["total"] = total
    return lines


def print_plan(chosen: list[Step], budget_s: int) -> None:
    lines = plan(chosen, budget_s)
    print("The worst case, in seconds: every step runs to its limit, is stopped (SIGTERM, then SIGKILL after its "
          "grace) and recorded;\na step that no longer fits what is left of the budget is skipped (a benchmark or "
          f"test step is shortened down to its minimum first).\nstart-up: {START_S} s for each Python process that "
          "imports torch, started one after another (on the H200 the whole versions step took 4.5 s);\ngrace: "
          f"SIGTERM to SIGKILL, then {KILL_WAIT_S} s for it to go; wrap-up: what it left killed, its output read, the "
          "report written.\n")
    print(f"{'step':26} {'start-up':>8} {'limit':>6} {'grace':>6} {'wrap-up':>7} {'worst':>6} {'total':>6}")
    for line in lines:
        cells = [str(line[key]) if key in line else "-" for key in ("startup", "limit", "grace", "wrap")]
        print(f"{line['name']:26} {cells[0]:>8} {cells[1]:>6} {cells[2]:>6} {cells[3]:>7} {line['worst']:>6} "
              f"{line['total']:>6}" + (f"  {line['note']}" if line.get("note") else ""))
    total = lines[-1]["total"]
    print(f"worst case: {total} s of the {budget_s} s budget ({'within' if total <= budget_s else 'OVER'} it; "
          f"one call to a lent GPU: {CALL_S} s)\n")
    for step in chosen:
        limit = f"at most {step.limit_s} s" + (f", at least {step.min_s} s" if step.min_s is not None else "")
        print(f"{step.name}: {step.what} ({limit} after {step.startup_s} s to start)\n    "
              f"{' '.join(f'{k}={v}' for k, v in step.env.items())}{' ' if step.env else ''}{shlex.join(step.command)}")


def left_in_session(sid: int) -> list[str]:
    """The processes still in session `sid` (a step's), as 'pid command'."""
    return [described for pid in session_members(sid) if (described := describe(pid))]


def describe(pid: int) -> str | None:
    """'pid command', or None when it has ended since."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()[:120].replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return f"{pid} {command}"


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # none of the group is left
        pass


def stop(proc: subprocess.Popen, grace_s: float) -> list[str]:
    """A step past its limit: SIGTERM to its process group; after grace_s, SIGKILL to the group and to every
    process below its first one, in any session (the benchmark's rows run in sessions of their own), those seen at
    SIGTERM and those seen before SIGKILL; then at most KILL_WAIT_S for it to go. Returns what was killed."""
    tree = set(descendants(proc.pid))
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        tree |= set(descendants(proc.pid))
    killed = [described for pid in alive([proc.pid, *sorted(tree)]) if (described := describe(pid))]
    signal_group(proc.pid, signal.SIGKILL)
    for pid in alive(sorted(tree)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel: reported by its exit status, None
        pass
    return killed


def run_step(step: Step, limit_s: int, log, out: Path) -> dict:
    """The step's command under its start-up allowance and limit: its exit status, output, seconds, and what was
    left running."""
    deadline = step.startup_s + limit_s
    with tempfile.TemporaryDirectory() as tmp:
        def fill(text: str) -> str:
            return text.replace("{tmp}", tmp).replace("{out}", str(out.resolve()))
        command = [fill(part) for part in step.command]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{key: fill(value) for key, value in step.env.items()}}
        log.write(f"\n===== {step.name}: {' '.join(command)} (limit {deadline} s: {step.startup_s} to start, "
                  f"{limit_s} to run)\n")
        log.flush()
        started = time.perf_counter()
        # into a file, not a pipe: a process the step leaves behind cannot keep the check waiting for its output
        with open(Path(tmp, "output.txt"), "w+") as output_file:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=output_file, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, env=env)
            timed_out, killed = False, []
            try:
                proc.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                timed_out = True
                killed = stop(proc, step.grace_s)
            seconds = time.perf_counter() - started
            output_file.seek(0)
            output = output_file.read()
        time.sleep(SETTLE_S)  # what the step's processes left behind, once its first process has gone
        left = left_in_session(proc.pid)
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.write(output)
        log.flush()
        result = {"name": step.name, "what": step.what, "seconds": round(seconds, 1), "limit_s": deadline,
                  "exit": proc.returncode, "timed_out": timed_out, "left_running": left}
        if killed:
            result["killed_at_limit"] = killed
        result.update(READERS[step.read](output, Path(tmp), out))
        if timed_out:
            result["ok"] = False
            result["summary"] = "; ".join(filter(None, [f"stopped at its limit of {deadline} s", result["summary"]]))
        elif proc.returncode != 0 and step.read != "pytest":
            result["ok"] = False
        if left:
            result["ok"] = False
            result["summary"] += f"; {len(left)} process(es) left running, killed"
        return result


def last_lines(output: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-n:])[:400]


def read_exit(output: str, tmp: Path, out: Path | None = None) -> dict:
    try:
        return {"ok": True, "summary": last_lines(output, 1), "found": json.loads(output.strip().splitlines()[-1])}
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "summary": last_lines(output)}


def read_text(output: str, tmp: Path, out: Path | None = None) -> dict:
    """A step that prints what it found: its last lines (run_step marks a failed exit)."""
    return {"ok": True, "summary": last_lines(output, 4)}


def read_test_log(path: Path) -> tuple[dict, list[str]]:
    """tests.jsonl, as this module writes it within pytest: each test's result (the worst of its phases) and the
    tests started that have none (running when pytest was stopped)."""
    results, started = {}, []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return results, started
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if "outcome" not in entry:
            started.append(entry["test"])
        elif rank.get(entry["outcome"], 2) >= rank.get(results.get(entry["test"], {}).get("outcome"), -1):
            results[entry["test"]] = entry
    return results, [test for test in dict.fromkeys(started) if test not in results]


def read_pytest(output: str, tmp: Path, out: Path | None = None) -> dict:
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)(?:\s+-\s+(.*))?$", output, re.M)
    # the last line of pytest -q: "11 passed, 3 skipped in 174.29s (0:02:54)" (between ='s without -q)
    totals = re.findall(r"^=* ?(\d+ (?:passed|failed|error|skipped|deselected).*?) in [\d.]+s", output, re.M)
    failed = [f"{status} {test}" + (f": {why[:200]}" if why else "") for status, test, why in outcomes
              if status in ("FAILED", "ERROR")]
    tests = [f"{status} {test}" for status, test, _ in outcomes]
    logged, running = read_test_log(out / "tests.jsonl") if out is not None else ({}, [])
    if not totals and logged:  # stopped before its summary: what each test that ended said, as it ended
        status = {test: "ERROR" if entry["outcome"] == "failed" and entry["when"] != "call" else
                  entry["outcome"].upper() for test, entry in logged.items()}
        tests = [f"{status[test]} {test}" for test in logged]
        failed = [f"{status[test]} {test}: {entry.get('why', '')[:200]}" for test, entry in logged.items()
                  if entry["outcome"] == "failed"]
        counts = {}
        for word in status.values():
            counts[word.lower()] = counts.get(word.lower(), 0) + 1
        summary = ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) + " before it was stopped" + \
            (f"; running then: {', '.join(running)}" if running else "")
    else:
        summary = totals[-1] if totals else last_lines(output)
    return {"ok": bool(totals) and not failed and "failed" not in summary and "error" not in summary,
            "summary": summary, "tests": tests, "failures": failed, "running": running}


def read_job(output: str, tmp: Path, out: Path | None = None) -> dict:
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


def read_waits(output: str, tmp: Path, out: Path | None = None) -> dict:
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


def read_benchmark(output: str, tmp: Path, out: Path | None = None) -> dict:
    done = re.findall(r"^\[\d+/\d+\] (.*?)(?:; about .*|; under a minute left)?$", output, re.M)
    rows = [stage for stage in done if not stage.startswith("ideal ")]
    return {"ok": "failed:" not in output, "summary": f"{len(rows)} row(s) measured: " + "; ".join(done)[:600],
            "stages": done}


READERS = {"exit": read_exit, "pytest": read_pytest, "job": read_job, "waits": read_waits, "benchmark": read_benchmark,
           "text": read_text}


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# GPU check", "", f"`{report['command']}` on {report['date']} at commit {report.get('commit', 'unknown')}"
             f"; its worst case by plan {report['worst_case_s']} s of a {report['budget_s']} s budget; its own start "
             f"took {report['startup_s']} s", "", *[f"- {key}: {value}" for key, value in report["versions"].items()],
             "", "| step | what | result | limit (s) | seconds |", "|---|---|---|---|---|"]
    for r in report["steps"]:
        mark = "ok" if r.get("ok") else "skipped" if r.get("skipped") else "**FAILED**"
        lines.append(f"| {r['name']} | {r['what']} | {mark}: {r['summary'].replace('|', '/')} | "
                     f"{r.get('limit_s', '')} | {r['seconds']} |")
    failures = [f for r in report["steps"] for f in r.get("failures", [])]
    if failures:
        lines += ["", "Failed tests:", "", *[f"- {f}" for f in failures]]
    tests = [t for r in report["steps"] for t in r.get("tests", [])]
    running = [t for r in report["steps"] for t in r.get("running", [])]
    if tests or running:
        lines += ["", "Each test's result (tests.jsonl has them as they ended):", "", *[f"- {t}" for t in tests],
                  *[f"- RUNNING when stopped: {t}" for t in running]]
    if report.get("unfinished"):
        lines += ["", f"**Unfinished**: {report['unfinished']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def process_age() -> float:
    """Seconds since this process started, Python's own start and imports included (Linux's /proc);
    CHECK_START_S where that cannot be read."""
    try:
        with open("/proc/self/stat") as file:
            started_ticks = int(file.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as file:
            uptime = float(file.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float(CHECK_START_S)


def module_version(name: str) -> str:
    try:
        return __import__(name).__version__
    except Exception as error:  # any failure to import it is the answer
        return f"not importable ({type(error).__name__})"


def inner_versions() -> dict:
    import torch
    props = torch.cuda.get_device_properties(0)
    smi = shutil.which("nvidia-smi")
    try:
        driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=5).stdout.strip().splitlines()[0] if smi else "no nvidia-smi"
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {"device": torch.cuda.get_device_name(0), "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "driver": driver, "torch": torch.__version__, "torchvision": module_version("torchvision"),
            "triton": module_version("triton"), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": sys.version.split()[0],
            "cpus": os.cpu_count()}


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


# This module is also a pytest plugin (pytest -p lent_gpu.check, the tests step): with GPU_CHECK_TESTS_LOG set,
# pytest's controlling process appends a JSON line to that file as each test starts and as it ends (xdist passes its
# workers' reports there), so that a pytest stopped at its limit still says which tests passed and which ran.
_PYTEST_STARTED = time.monotonic()
_pytest_worker = [False]  # whether this process is one of xdist's workers, which leave the file to the controller


def pytest_configure(config):
    _pytest_worker[0] = hasattr(config, "workerinput")


def _test_log(entry: dict) -> None:
    path = os.environ.get(TESTS_LOG)
    if path and not _pytest_worker[0]:
        with open(path, "a") as file:
            file.write(json.dumps({**entry, "at_s": round(time.monotonic() - _PYTEST_STARTED, 1)}) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _test_log({"test": nodeid})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a skip or failure in setup, an error in teardown
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
        why = "" if report.passed else report.longrepr[2] if isinstance(report.longrepr, tuple) else \
            crash or next((line for line in reversed(report.longreprtext.splitlines()) if line.strip()), "")
        _test_log({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                   "duration_s": round(report.duration, 1), "why": str(why)[:300]})


def main(argv=None, started: float | None = None):
    """`started`: time.monotonic() at this process's start (from the command line: its own start counts against
    the budget); by default, now."""
    started = time.monotonic() if started is None else started
    parser = flags.Parser(prog="python -m lent_gpu.check", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--output-dir", default="runs/gpu_check",
                        help="where report.md, report.json, log.txt, tests.jsonl and the benchmark's tables go")
    parser.add_argument("--budget-s", type=flags.positive_int, default=BUDGET_S,
                        help="seconds for the whole check, from this process's start; a step starts only if its "
                             "worst case fits what is left (--dry-run prints the arithmetic)")
    parser.add_argument("--only", default=None, metavar="STEPS",
                        help="run only these steps, separated by commas (a part of a name selects every step "
                             "that has it: 'rows' is the three benchmark steps); --dry-run lists them")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the budget line by line and each step's command; run none")
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
        print_plan(chosen, args.budget_s)
        return
    import torch
    if not torch.cuda.is_available():
        parser.error("no GPU is visible: this check measures the GPU path (--dry-run lists its steps)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tests.jsonl").unlink(missing_ok=True)  # this run's lines only
    given = sys.argv[1:] if argv is None else argv
    report = {"command": shlex.join(["python", "-m", "lent_gpu.check", *given]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit or git_commit(), "budget_s": args.budget_s,
              "worst_case_s": plan(chosen, args.budget_s)[-1]["total"],
              "startup_s": round(time.monotonic() - started, 1),
              # what this process knows without touching the GPU; the versions step adds the device's
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
              "steps": [], "unfinished": "no step has finished yet"}
    with open(out / "log.txt", "w") as log:
        for k, step in enumerate(chosen):
            left = args.budget_s - (time.monotonic() - started) - FINISH_S
            limit = fits(step, left)
            if limit is None:
                need = step.overhead_s + (step.limit_s if step.min_s is None else step.min_s)
                report["steps"].append({"name": step.name, "what": step.what, "ok": False, "skipped": True,
                                        "seconds": 0, "summary": f"not started: its worst case is {need} s, "
                                                                 f"{max(left, 0):.0f} s were left of the budget"})
                print(f"[{k + 1}/{len(chosen)}] {step.name}: skipped, {report['steps'][-1]['summary']}", flush=True)
            else:
                print(f"[{k + 1}/{len(chosen)}] {step.name} (at most {step.startup_s} + {limit} s): {step.what}",
                      flush=True)
                result = run_step(step, limit, log, out)
                report["steps"].append(result)
                if step.name == "versions" and isinstance(result.get("found"), dict):
                    report["versions"].update(result["found"])
                print(f"    {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s: {result['summary']}",
                      flush=True)
            report["unfinished"] = (f"{k + 1} of {len(chosen)} steps done when this was written"
                                    if k + 1 < len(chosen) else None)
            report["seconds"] = round(time.monotonic() - started, 1)
            write_report(report, out)
    report["unfinished"] = None  # every step ran or was skipped, saying why
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(report, out)
    print(f"wrote {out / 'report.md'}, report.json, log.txt in {report['seconds']} s of the {args.budget_s} s budget")
    sys.exit(0 if all(r.get("ok") for r in report["steps"]) else 1)


if __name__ == "__main__":
    main(started=time.monotonic() - process_age())
