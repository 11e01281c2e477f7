"""The pictures of docs/timelines.md: every script run through its launcher on the CPU (gloo, 2 ranks, synthetic
data, float32 where the CPU has no native bfloat16) with --profile-steps 2, each into runs/timelines/<name> (emptied
first), and drawn by tools.timeline into <folder>/<name>.png. distributed_live_recovery.py's two replica groups need
torchft (left out without it).

    python -m benchmarks.timelines docs/timelines                          # every picture: 2 minutes on 2 cores
    python -m benchmarks.timelines docs/timelines --only distributed_zero  # one of them
"""
import shutil
import sys
from pathlib import Path

from benchmarks import harness
from tools import timeline
from utils import flags
from utils.errors import UsageError, exit_on_error

PIPELINE = ["--batch-size", "64", "--train-samples", "256", "--microbatches", "4"]
# name -> (how it starts, script, its own flags): the pictures of docs/timelines.md
EVERY_SCRIPT = {
    "dataparallel": ("python", "dataparallel.py", ["--batch-size", "8"]),  # one process: the per-rank batch
    "distributed": ("torchrun", "distributed.py", []),
    "distributed_no_sync_bn": ("torchrun", "distributed.py", ["--no-sync-bn"]),
    "distributed_mp": ("spawn", "distributed_mp.py", []),
    "distributed_apex": ("spawn", "distributed_apex.py", []),
    "distributed_gradient_accumulation": ("spawn", "distributed_gradient_accumulation.py",
                                          ["--grad-accu-steps", "2", "--no-sync-bn"]),
    "distributed_zero": ("torchrun", "distributed_zero.py", []),
    "distributed_fsdp": ("torchrun", "distributed_fsdp.py", ["--opt-level", "O0"]),
    "distributed_fsdp_hsdp": ("torchrun", "distributed_fsdp.py", ["--opt-level", "O0", "--replicas", "2"]),
    "distributed_live_recovery": ("replica groups", "distributed_live_recovery.py", []),
    # 2 stages, each batch of 64 in 4 micro-batches of 16 (larger than the others': a micro-batch of 4 is mostly the
    # schedule's own overhead on a CPU): 1F1B and GPipe, the bubble measured in the title
    "distributed_pipeline": ("torchrun", "distributed_pipeline.py", PIPELINE),
    "distributed_pipeline_gpipe": ("torchrun", "distributed_pipeline.py", PIPELINE + ["--schedule", "gpipe"]),
}
RANKS = {"distributed_fsdp_hsdp": 4}  # HSDP's 2 x 2 mesh; every other picture has 2 ranks
# 4 steps of a global batch of 16 (8 per rank; 4 on HSDP's 4 ranks): 2 of warm-up, then the 2 recorded
EVERY_SCRIPT_FLAGS = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "64", "--test-samples", "16",
                      "--batch-size", "16", "--epochs", "1", "--workers", "0", "--print-freq", "1000",
                      "--profile-steps", "2"]


def draw_every_script(folder: Path, runs: Path, only: list[str] | None = None) -> None:
    """Each script of EVERY_SCRIPT (or those named in `only`) run on the CPU into runs/<name> (emptied first) and
    drawn into folder/<name>.png."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (start, script, own) in EVERY_SCRIPT.items():
        if only and name not in only:
            continue
        if start == "replica groups" and not harness.importable("torchft"):
            print(f"{name}: left out, it needs torchft (pip install torchft)")
            continue
        out = runs / name
        shutil.rmtree(out, ignore_errors=True)
        row = harness.Row(name, script, start)
        ranks = RANKS.get(name, 2)
        cmd = harness.launch(row, nprocs=ranks) + EVERY_SCRIPT_FLAGS + own + ["--output-dir", str(out)]
        env = harness.threads_env(ranks)
        result = (harness.run_replica_groups(cmd, 2, env) if start == "replica groups"
                  else harness.run_stoppable(cmd, env))
        if result.returncode:
            raise UsageError(f"{name} failed: {harness.why_it_failed(result.stderr)}")
        lanes = timeline.read_run(out)
        ran_as = {"python": "one process", "replica groups": "2 replica groups of one process (gloo)"}.get(
            start, f"{ranks} ranks (gloo)")
        title = f"{script} {' '.join(own)}".strip() + f": 2 recorded steps of {ran_as}"
        timeline.draw(lanes, title, folder / f"{name}.png")
        print(f"{name}: {timeline.summary_text(lanes)} -> {folder / name}.png", flush=True)


def main(argv=None) -> None:
    parser = flags.Parser(prog="python -m benchmarks.timelines", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("folder", type=Path, metavar="FOLDER", help="where the pictures go, each as <name>.png")
    parser.add_argument("--only", action="append", choices=list(EVERY_SCRIPT), metavar="NAME",
                        help=f"only this picture (repeatable): {', '.join(EVERY_SCRIPT)}")
    parser.add_argument("--runs", type=Path, default=Path("runs/timelines"),
                        help="where the runs go, each in a folder of its name (emptied first)")
    args = parser.parse_args(argv)
    with exit_on_error():
        draw_every_script(args.folder, args.runs, args.only)


if __name__ == "__main__":
    main(sys.argv[1:])
