"""What distributed_diloco.py sends, counted, and what it costs in learning, against distributed.py's DDP.

    python -m benchmarks.diloco               # the counts only: 2 ranks; DDP, then H = 1, 4, 16, 64; 64 steps each
    python -m benchmarks.diloco --learning    # and 4 training runs (DDP, H = 4, 16, 64), minutes each
    python -m benchmarks.diloco --ranks 4 --sync-every 1,8 --steps 32

The counts: each rank runs the scripts' own train_one_epoch (distributed_diloco.py's with its end_round) over random
images while torch.distributed's collectives are counted (benchmarks.ladder's CountedCollectives), step by step. DDP
is built as distributed.py --no-sync-bn builds it (no SyncBatchNorm, whose 40 small all-reduces a step DiLoCo has no
use for; gradients as bucket views; torch's bucket size), with torch's allreduce_hook registered: DDP's own all-reduce
calls gloo from C++, the hook calls dist.all_reduce, which the counter sees, on the same buckets. The images are 8x8:
what is sent does not depend on their size.

The learning runs (--learning): distributed.py --no-sync-bn and distributed_diloco.py at each --learning-sync-every H,
each a real run through torchrun (python -m torch.distributed.run --standalone --nproc_per_node=2) on the learnable
synthetic set, each in a temporary --output-dir; its held-out top-1 and loss after each epoch and its last epoch's
training loss are read from its metrics.jsonl, and its wall time is measured here. A run still going after
--run-timeout seconds is stopped and recorded as failed.

Writes <output-dir>/diloco.md (the tables) and diloco.json, each replaced whole after the counts and after every run,
so a benchmark stopped (Ctrl-C, SIGTERM, SIGHUP) keeps what it measured, marked unfinished; a run stopped meanwhile
gets SIGTERM, which torchrun passes to its ranks, and whatever of it still runs after 30 s is killed
(benchmarks.run's run_stoppable, which also ends a run past --run-timeout).
"""
import copy
import functools
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import distributed_diloco
from benchmarks import harness, network
from benchmarks.ladder import CountedCollectives
from utils import flags, models

CPU = torch.device("cpu")
DDP_COUNTED = ("DDP: distributed.py --no-sync-bn's wrapping and train_one_epoch, "
               "all-reducing through torch's allreduce_hook")
# the learning runs' workload, in the order the page's command gives it (after the script's own flag)
TEST_SAMPLES, GLOBAL_BATCH, LR = 500, 32, 0.05


class NoStop:
    """The safety net as train_one_epoch sees it: no stop ever comes."""

    def step_done(self, loss, grad_norm=None) -> bool:
        return False


def steps_counted(loader, counted: CountedCollectives, per_step: list[int]):
    """The loader's batches; after each step (when the next batch is asked for, or the loop ends) the all-reduces
    that step made are appended to per_step."""
    for batch in loader:
        before = counted.calls.get("all_reduce", 0)
        yield batch
        per_step.append(counted.calls.get("all_reduce", 0) - before)


def count(rank: int, world_size: int, sync_every: int | None, steps: int, batch: int = 2) -> dict:
    """On a process group already made: `steps` steps of DDP (sync_every None) or of DiLoCo with that H, each rank
    on random images of its own; the all-reduces and their bytes (rank 0's, the same on every rank), and the
    all-reduces of each step."""
    torch.manual_seed(0)
    model = models.resnet18_cifar()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 100, (batch,), generator=g))
               for _ in range(steps)]
    counted, per_step = CountedCollectives(), []
    loader = steps_counted(batches, counted, per_step)
    if sync_every is None:
        model = DDP(model, gradient_as_bucket_view=True)  # as distributed.py's defaults build it
        model.register_comm_hook(None, default_hooks.allreduce_hook)  # dist.all_reduce on each bucket: counted
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with counted:
            distributed.train_one_epoch(model, nn.CrossEntropyLoss(), optimizer, loader, CPU, NoStop())
    else:
        outer_model = copy.deepcopy(model)
        outer_optimizer = torch.optim.SGD(outer_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with counted:
            distributed_diloco.train_one_epoch(
                model, nn.CrossEntropyLoss(), optimizer, loader, CPU, NoStop(), sync_every=sync_every, steps=steps,
                end_round=functools.partial(distributed_diloco.end_round, model, outer_model, outer_optimizer,
                                            optimizer, world_size))
    return {"all_reduces": counted.calls.get("all_reduce", 0), "bytes": counted.bytes.get("all_reduce", 0),
            "other": {k: v for k, v in counted.calls.items() if k != "all_reduce"}, "steps": steps,
            "all_reduces_per_step": per_step}


def _rank(rank: int, world_size: int, port: int, plan: list, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        return [{"sync_every": h, **count(rank, world_size, h, steps)} for h in plan]
    finally:
        dist.destroy_process_group()


def counts_on_ranks(ranks: int, plan: list, steps: int) -> list[dict]:
    """count() for each H of `plan` (None: DDP) on `ranks` spawned processes: rank 0's (the same on every rank)."""
    return harness.spawn_ranks(_rank, ranks, plan, steps)[0]


# ---- the learning runs ----

def learning_rows(sync_every: list[int]) -> list[dict]:
    """DDP as the page compares it (distributed.py without SyncBatchNorm: BatchNorm per rank, as in DiLoCo), then
    distributed_diloco.py at each H."""
    return [{"name": "DDP", "script": "distributed.py", "flags": ["--no-sync-bn"]}] + [
        {"name": f"DiLoCo H = {h}", "script": "distributed_diloco.py", "flags": ["--sync-every", str(h)]}
        for h in sync_every]


def workload(train_samples: int, epochs: int) -> list[str]:
    """The flags every learning run gets after its own."""
    return ["--device", "cpu", "--dataset", "synthetic", "--train-samples", str(train_samples), "--test-samples",
            str(TEST_SAMPLES), "--batch-size", str(GLOBAL_BATCH), "--lr", str(LR), "--epochs", str(epochs),
            "--no-augment", "--workers", "0"]


def as_typed(row: dict, train_samples: int, epochs: int) -> str:
    """The run's command as a reader types it (torchrun for python -m torch.distributed.run; --output-dir left out:
    the benchmark gives each run a temporary one)."""
    return shlex.join(["torchrun", "--standalone", "--nproc_per_node=2", row["script"], *row["flags"],
                       *workload(train_samples, epochs)])


def read_epochs(output_dir: Path) -> list[dict]:
    """Each epoch's line of a run's metrics.jsonl (safety_net/metrics_log.py): the epoch (from 1), the held-out top-1
    and loss after it, the mean training loss over its steps and ranks, and its time."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [{key: record[key] for key in ("epoch", "top1", "test_loss", "train_loss", "epoch_time_s")}
            for record in map(json.loads, lines) if record]


def learn(row: dict, args) -> dict:
    """One learning run (torchrun, 2 ranks): what its metrics.jsonl says after each epoch, and its wall time."""
    said = {**row, "command": as_typed(row, args.train_samples, args.epochs)}
    with tempfile.TemporaryDirectory() as out:
        command = harness.launch(harness.Row(row["name"], row["script"], "torchrun"), 2) + row["flags"] + \
            workload(args.train_samples, args.epochs) + ["--output-dir", out]
        started = time.perf_counter()
        result = harness.run_stoppable(command, harness.threads_env(2), limit_s=args.run_timeout)
        said["wall_s"] = time.perf_counter() - started
        if result.returncode:
            return {**said, "error": f"still running after {args.run_timeout} s: stopped" if result.returncode == 124
                    else harness.why_it_failed(result.stderr)}
        epochs = read_epochs(Path(out))
    if len(epochs) != args.epochs:
        return {**said, "error": f"metrics.jsonl has {len(epochs)} epochs, not {args.epochs}"}
    return {**said, "epochs": epochs}


# ---- the tables ----

def count_name(r: dict) -> str:
    return DDP_COUNTED if r["sync_every"] is None else f"`distributed_diloco.py --sync-every {r['sync_every']}`"


def step_runs(per_step: list[int]) -> str:
    """[1, 3, 3, 3]: "1 in step 1, 3 in each of steps 2-4"."""
    said, start = [], 0
    for i in range(1, len(per_step) + 1):
        if i == len(per_step) or per_step[i] != per_step[start]:
            steps = f"step {start + 1}" if i == start + 1 else f"each of steps {start + 1}-{i}"
            said.append(f"{per_step[start]} in {steps}")
            start = i
    return ", ".join(said)


def counts_table(results: dict) -> list[str]:
    counts = results["counts"]
    if not counts:
        return []
    meta = results["meta"]
    ddp = next(r for r in counts if r["sync_every"] is None)
    lines = ["### What it sends, counted", "",
             f"{meta['ranks']} ranks (torch.multiprocessing.spawn, gloo), float32, {counts[0]['steps']} steps each, "
             "each rank's batch 2 random 8x8 images.", "", *harness.table(
                 ["what is counted", "all-reduces / step", "MB sent in them / step", "bytes vs DDP"],
                 [[count_name(r), f"{r['all_reduces'] / r['steps']:.4g}", f"{r['bytes'] / r['steps'] / 2**20:.3f}",
                   f"{r['bytes'] / ddp['bytes']:.4f}"] for r in counts])]
    lines += ["", f"DDP's all-reduces, step by step: {step_runs(ddp['all_reduces_per_step'])}."]
    other = {k: v for r in counts for k, v in r["other"].items()}
    lines += [f"Other collectives counted: {other}." if other else "No other collective was called.", ""]
    return lines


def run_name(r: dict) -> str:
    return f"`{' '.join([r['script'], *r['flags']])}`" + (" (DDP)" if r["name"] == "DDP" else "")


def learning_table(results: dict) -> list[str]:
    meta = results["meta"]
    if not meta.get("learning"):
        return []
    learning = meta["learning"]
    per_epoch = learning["train_samples"] // GLOBAL_BATCH
    steps = [per_epoch * (e + 1) for e in range(learning["epochs"])]
    lines = ["### What it costs in learning", "",
             f"2 ranks under torchrun (`python -m torch.distributed.run --standalone --nproc_per_node=2`, "
             f"OMP_NUM_THREADS={learning['omp_num_threads']}), float32, the synthetic set: "
             f"{learning['train_samples']} training images in global "
             f"batches of {GLOBAL_BATCH} ({per_epoch} steps an epoch), {learning['epochs']} epochs, `--lr {LR}` on "
             f"the scripts' cosine, {TEST_SAMPLES} held-out images; each script's other flags at their defaults. "
             "Held-out top-1 and loss after each epoch and the last epoch's training loss (the mean over its steps "
             "and both ranks, each rank's loss on its own batches) from each run's metrics.jsonl; wall s: the whole "
             "run (start-up, training, evaluation), timed by this benchmark.", ""]
    done, cells = {r["name"]: r for r in results["learning"]}, []
    for row in learning["rows"]:
        r = done.get(row["name"])
        if r is None:
            cells.append([run_name(row), "not measured: the benchmark was stopped before this run ended",
                          *[""] * (len(steps) + 1)])
        elif "error" in r:
            cells.append([run_name(r), f"failed: {r['error']}", *[""] * len(steps), f"{r['wall_s']:.0f}"])
        else:
            cells.append([run_name(r), *(f"{e['top1']:.1f}% ({e['test_loss']:.3g})" for e in r["epochs"]),
                          f"{r['epochs'][-1]['train_loss']:.3g}", f"{r['wall_s']:.0f}"])
    lines += harness.table(["run", *(f"held-out top-1 (loss) after {s} steps" if i == 0 else f"after {s}"
                                     for i, s in enumerate(steps)), "last epoch's training loss", "wall s"], cells)
    lines += ["", "Commands (each run also given `--output-dir`, a temporary folder):", "", "```"]
    lines += [as_typed(row, learning["train_samples"], learning["epochs"]) for row in learning["rows"]]
    return lines + ["```", ""]


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"Hardware: {meta['hardware']}. Command: `{meta['command']}`, at commit {meta['commit']}.", ""]
    if meta.get("unfinished"):
        lines += [f"**Unfinished:** {meta['unfinished']}", ""]
    return "\n".join(lines + counts_table(results) + learning_table(results))


def write(results: dict, out: Path) -> None:
    """diloco.json and diloco.md, each replaced whole (benchmarks.run's write_whole)."""
    harness.write_whole(out, {"diloco.json": json.dumps(results, indent=1), "diloco.md": markdown(results)})


def machine_folder() -> str:
    """The full run's results folder, named as benchmarks.network names its own: benchmarks/results/cpu-<processor's
    family>-diloco."""
    return network.machine_folder().removesuffix("-network") + "-diloco"


def sync_every_list(text: str) -> list[int]:
    return [flags.positive_int(word) for word in text.split(",")]


def parse_args(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.diloco", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--ranks", type=flags.positive_int, default=2, help="processes of the counts (gloo, CPU)")
    parser.add_argument("--sync-every", type=sync_every_list, default=[1, 4, 16, 64], metavar="H,H,...",
                        help="the counts' values of H, comma-separated positive integers (default: 1,4,16,64)")
    parser.add_argument("--steps", type=flags.positive_int, default=64, help="optimizer steps counted for each")
    parser.add_argument("--learning", action="store_true",
                        help="also the learning runs: DDP and DiLoCo at each --learning-sync-every, 2 ranks each "
                             "(390-509 s a run at the default size in benchmarks/results/cpu-epyc-diloco, 2 cores "
                             "shared with other jobs)")
    parser.add_argument("--learning-sync-every", type=sync_every_list, default=[4, 16, 64], metavar="H,H,...",
                        help="the learning runs' values of H (default: 4,16,64)")
    parser.add_argument("--train-samples", type=flags.positive_int, default=2048,
                        help=f"the learning runs' training images, at least one global batch of {GLOBAL_BATCH}")
    parser.add_argument("--epochs", type=flags.positive_int, default=3, help="the learning runs' epochs")
    parser.add_argument("--run-timeout", type=flags.positive_int, default=1800, metavar="S",
                        help="a learning run still going after S seconds is stopped and recorded as failed")
    parser.add_argument("--output-dir", default=None,
                        help="where diloco.md and diloco.json go (default: runs/diloco, or with --learning "
                             f"{machine_folder()}, the folder of this machine's results)")
    args = parser.parse_args(argv)  # a bad value: one line, exit status 2
    if args.train_samples < GLOBAL_BATCH:
        parser.error(f"--train-samples {args.train_samples}: fewer than one global batch of {GLOBAL_BATCH}")
    args.output_dir = args.output_dir or (machine_folder() if args.learning else "runs/diloco")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        parser.error(f"--output-dir {args.output_dir} is a file")
    return args


def main(argv=None):
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.diloco", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    hardware = harness.hardware("cpu", args.ranks)
    rows = learning_rows(args.learning_sync_every) if args.learning else []
    meta = {"hardware": hardware, "processor": harness.processor(),
            "torch": torch.__version__, "command": command, "commit": harness.git_commit(), "ranks": args.ranks,
            "learning": {"rows": rows, "train_samples": args.train_samples, "epochs": args.epochs,
                         "run_timeout_s": args.run_timeout,
                         "omp_num_threads": harness.threads_env(2)["OMP_NUM_THREADS"]} if rows else None}
    results = {"meta": meta, "counts": [], "learning": []}
    progress = harness.Progress(1 + len(rows), write=lambda line: print(line, flush=True))

    print(f"{hardware}; writing {out}", flush=True)
    try:
        with harness.stopped_as_ctrl_c():
            results["counts"] = counts_on_ranks(args.ranks, [None, *args.sync_every], args.steps)
            meta["unfinished"] = (f"0 of {len(rows)} learning runs done when this was written; the benchmark did not "
                                  "finish." if rows else None)
            write(results, out)
            progress.done(f"counted: DDP and H = {', '.join(map(str, args.sync_every))}, {args.steps} steps each")
            for i, row in enumerate(rows, start=2):
                print(f"[{i}/{progress.stages}] {row['name']}: {as_typed(row, args.train_samples, args.epochs)}",
                      flush=True)
                results["learning"].append(learn(row, args))
                meta["unfinished"] = (f"{len(results['learning'])} of {len(rows)} learning runs done when this was "
                                      "written; the benchmark did not finish.")
                write(results, out)
                r = results["learning"][-1]
                progress.done(f"{row['name']}: " + (f"held-out top-1 {r['epochs'][-1]['top1']:.1f}% after "
                                                    f"{args.epochs} epochs, {r['wall_s']:.0f} s" if "epochs" in r
                                                    else f"failed: {r['error']}"))
    except KeyboardInterrupt as stopped:
        sys.exit(harness.stopped_status(stopped, f"after {len(results['learning'])} of {len(rows)} learning runs: "
                                        f"{out / 'diloco.md'} has what was measured" if results["counts"] else
                                        "before the counts were done: nothing written"))
    meta.pop("unfinished", None)
    write(results, out)
    print(markdown(results))
    print(f"wrote {out / 'diloco.md'}, {out / 'diloco.json'}")
    if any("error" in r for r in results["learning"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
