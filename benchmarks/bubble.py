"""The pipeline's bubble, measured: distributed_pipeline.py profiled at each schedule and number of micro-batches, each
stage's idle share of the schedule's span beside the theory, (S-1)/(M+S-1).

    python -m benchmarks.bubble                          # 2 stages on the CPU, M = 2, 4, 8, both schedules: ~3 min
    python -m benchmarks.bubble --stages 4 --microbatches 4,8,16 --device cuda   # on 4 GPUs

Each measurement is a run of `torchrun --nproc_per_node=S distributed_pipeline.py --profile-steps 3` on synthetic
data: 2 steps of warm-up, 3 recorded (tools.timeline reads their traces), each rank's idle share per recorded
step (tools.timeline.pipeline_idle: the time in the span from the first forward or backward operator of the
step on any rank to the last, during which the rank runs none of its own), the median over the steps. The theory
assumes every stage takes the same time per micro-batch and sending takes none. On the CPU give each stage a core
of its own (S at most the cores): stages sharing a core run while their neighbours wait, and fill the bubble.
Writes <output-dir>/bubble.md and bubble.json, and each run's folder (its traces) under <output-dir>/runs.
"""
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness
from tools import timeline
from utils import flags, pipelining
from utils.errors import UsageError, exit_on_error

RECORDED = 3


def measure(stages: int, schedule: str, microbatches: int, batch: int, device: str, out: Path) -> dict:
    """One profiled run, its idle shares and the median span of its recorded steps."""
    shutil.rmtree(out, ignore_errors=True)
    row = harness.Row(f"pipeline {schedule} M={microbatches}", "distributed_pipeline.py", "torchrun")
    command = harness.launch(row, nprocs=stages) + [
        "--device", device, "--dataset", "synthetic", "--train-samples", str(batch * (2 + RECORDED)),
        "--test-samples", str(batch), "--batch-size", str(batch), "--epochs", "1", "--workers", "0",
        "--print-freq", "1000", "--schedule", schedule, "--microbatches", str(microbatches),
        "--profile-steps", str(RECORDED), "--output-dir", str(out)]
    result = harness.run_stoppable(command, harness.threads_env(stages) if device == "cpu" else dict(os.environ))
    if result.returncode:
        raise UsageError(f"{schedule} with --microbatches {microbatches} failed: "
                         f"{harness.why_it_failed(result.stderr)}")
    lanes = timeline.read_run(out)
    shares = timeline.pipeline_idle(lanes)
    spans = [max(lane.steps[k][1] for lane in lanes) - min(lane.steps[k][0] for lane in lanes)
             for k in range(len(shares))]
    return {"schedule": schedule, "microbatches": microbatches, "stages": stages, "batch": batch,
            "theory": (stages - 1) / (microbatches + stages - 1),
            "idle": [statistics.median(step[i] for step in shares) for i in range(stages)],
            "step_ms": statistics.median(spans)}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['hardware']}; commit {meta['commit']}. Command: `{meta['command']}`.",
             f"{rows[0]['stages']} stages, a batch of {rows[0]['batch']}, float32; each figure the median of "
             f"{RECORDED} recorded steps. Idle: the share of the schedule's span a stage runs none of its own "
             "forward or backward operators.", ""]
    lines += harness.table(["schedule", "micro-batches M", "theory (S-1)/(M+S-1)", "measured idle, each stage", "mean",
                            "step (ms)"],
                           [[r["schedule"], r["microbatches"], f"{r['theory']:.0%}",
                             ", ".join(f"{share:.0%}" for share in r["idle"]), f"{sum(r['idle']) / len(r['idle']):.0%}",
                             f"{r['step_ms']:.0f}"] for r in rows])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = flags.Parser(prog="python -m benchmarks.bubble", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--stages", type=flags.positive_int, default=2,
                        help="ranks, one stage each, on the CPU at most the cores")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated M to measure")
    parser.add_argument("--schedules", default="1f1b,gpipe", help="comma-separated: 1f1b, gpipe")
    parser.add_argument("--batch-size", type=flags.positive_int, default=64,
                        help="the global batch, cut into M micro-batches")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bubble"),
                        help="where bubble.md, bubble.json and the runs go")
    args = parser.parse_args(argv)
    with exit_on_error():
        try:
            counts = [int(m) for m in args.microbatches.split(",")]
        except ValueError:
            raise UsageError(f"--microbatches takes comma-separated integers, got {args.microbatches}") from None
        schedules = args.schedules.split(",")
        if not set(schedules) <= {"1f1b", "gpipe"}:
            raise UsageError(f"--schedules {args.schedules}: choose from 1f1b, gpipe")
        if args.stages < 2:
            raise UsageError(f"--stages {args.stages}: a pipeline has 2 stages or more")
        for m in counts:  # the script's own checks, before any run: each M, the stages, the batch
            pipelining.check_stages(args.stages, 1, m)
            wrong = pipelining.microbatches_divide_the_batch(SimpleNamespace(batch_size=args.batch_size, replicas=1,
                                                                             microbatches=m))
            if wrong:
                raise UsageError(wrong)
        meta = {"hardware": harness.hardware(args.device, args.stages), "commit": harness.git_commit(),
                "command": " ".join(["python -m benchmarks.bubble", *(sys.argv[1:] if argv is None else argv)])}
        plan = [(schedule, m) for schedule in schedules for m in counts]
        rows = []
        try:
            # kill -TERM, a closed terminal: stopped as Ctrl-C (run_stoppable stops the measurement's launcher)
            with harness.stopped_as_ctrl_c():
                for i, (schedule, m) in enumerate(plan, 1):
                    rows.append(measure(args.stages, schedule, m, args.batch_size, args.device,
                                        args.output_dir / "runs" / f"{schedule}-{m}"))
                    write(rows, meta, args.output_dir)  # the rows so far: a run stopped keeps what it measured
                    r = rows[-1]
                    print(f"[{i}/{len(plan)}] {schedule}, M={m}: idle {', '.join(f'{s:.0%}' for s in r['idle'])} "
                          f"(theory {r['theory']:.0%}), step {r['step_ms']:.0f} ms", flush=True)
        except KeyboardInterrupt as stop:
            return harness.stopped_status(stop, f"after {len(rows)} of {len(plan)} measurements" + (
                f": {args.output_dir / 'bubble.md'} has them" if rows else ": nothing written"))
        print(markdown(rows, meta), end="")
    return 0


def write(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bubble.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bubble.md").write_text(markdown(rows, meta))


if __name__ == "__main__":
    sys.exit(main())
