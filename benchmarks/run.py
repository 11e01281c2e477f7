"""Every script and every speed technique on one synthetic workload, against the ideal, in one run.

    python -m benchmarks.run --quick                    # the CPU: 2 processes, a few minutes
    python -m benchmarks.run                            # all visible GPUs (or the CPU), longer runs
    python -m benchmarks.run --only "DDP (torchrun),no SyncBatchNorm"   # the rows whose name contains these
    python -m benchmarks.run --quick --only seed        # the seed's four rows: DataParallel and DDP, +- mixed precision
    python -m benchmarks.run --quick --only peers       # DDP beside a plain tutorial loop and Lightning
    python -m benchmarks.run --only others              # every row that seed and peers leave out
    python -m benchmarks.run --only "DDP + bfloat16, CUDA graphs" --only peers   # a whole name with commas, then more

Each row runs a real script through its real launcher on CIFAR-100-shaped synthetic data for a
fixed number of steps per epoch; the first epoch (start-up, compilation) is not counted and the
median images/s of the others is reported, with the peak memory that the script writes to
metrics.jsonl. On the CPU the rows load their batches in the
rank (--workers 0: the cores compute) but two, which start the scripts' default DataLoader workers under
torchrun and under spawn, the data path users run. The ideal is measured in the same run:
N independent processes of the bare training step (benchmarks/bare_step.py: no process group,
no data loading), one per device, with the same per-rank batch, side by side; its images/s is
their sum. "vs ideal" is a row's images/s over the ideal of its precision. Technique rows change
one flag of the DDP row, so their "vs DDP" column says what that flag buys on this machine. The "seed
table" repeats the four rows of the seed project's comparison (DataParallel and DDP, each with and
without mixed precision: float16 on GPUs, bfloat16 on a CPU). The "peers" table measures the same job
written as others write it, through torchrun with the same processes, batch, steps and --workers:
a plain tutorial DDP loop (benchmarks/peers/plain_ddp.py) and PyTorch Lightning's Trainer with its
DDP strategy (benchmarks/peers/lightning_ddp.py; left out, saying so, where lightning is not installed),
each in float32 beside DDP (torchrun) and in bfloat16 autocast beside DDP + bfloat16 autocast,
and the bare step's ceilings: eager (the ideal), compiled (torch.compile; not in --quick on a CPU)
and in CUDA graphs (GPUs only).

With --quick on a CPU without native bfloat16 instructions (where bfloat16 is emulated, some 18x slower
than float32), the bfloat16 rows, ideal and peak are left out, and the output says so.

Writes <output-dir>/benchmark.md (the tables), benchmark.png (a bar chart) and benchmark.json; the tables
after every row, so a run stopped (Ctrl-C, SIGTERM, SIGHUP: the row being measured is stopped too) or killed
keeps the rows it measured, marked unfinished.
"""
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import harness
from benchmarks.bare_step import flops_per_image
from benchmarks.harness import EPOCH_IMAGES, ROOT, Row
from utils import flags, precision

WORKERS = "4"  # the scripts' default --workers
BARE_STEP = "benchmarks/bare_step.py"
PLAIN, LIGHTNING = "benchmarks/peers/plain_ddp.py", "benchmarks/peers/lightning_ddp.py"
PLAIN_LOOP, PLAIN_LOOP_BF16 = "plain tutorial DDP loop", "plain tutorial DDP loop + bfloat16 autocast"
# the same loop as a careful user tunes it (peers/plain_ddp.py --tuned): torch.compile, channels-last, fused SGD
TUNED_LOOP_BF16 = "tuned tutorial DDP loop + bfloat16 autocast (compiled, channels-last, fused SGD)"


def mixed_dtype(device: str) -> str:
    """The mixed precision of the seed table's "+ apex" rows: apex's float16 on GPUs, bfloat16 on a CPU."""
    return "float16" if device == "cuda" else "bfloat16"


def seed_rows(device: str) -> dict[str, str]:
    """The seed project's four rows, and the rows of ours that measure the same thing."""
    mixed = "DDP + float16 autocast + GradScaler" if device == "cuda" else "DDP + bfloat16 autocast"
    return {"DataParallel": "DataParallel", "DataParallel + apex": "DataParallel + mixed precision",
            "DDP": "DDP (torchrun)", "DDP + apex": mixed}


def rows(device: str) -> list[Row]:
    gpu, mixed = device == "cuda", mixed_dtype(device)
    return [
        Row("DataParallel", "dataparallel.py", "python"),
        Row("DataParallel + mixed precision", "dataparallel.py", "python",
            ["--opt-level", "O1", "--amp-dtype", mixed], amp=mixed),
        Row("DDP (torchrun)", "distributed.py", "torchrun"),
        Row("DDP (spawn)", "distributed_mp.py", "spawn"),
        # a replica group per process under a torchft lighthouse: each step's quorum and commit (compare with
        # "no SyncBatchNorm": a group of one process has no BatchNorm to synchronise)
        Row("DDP, live recovery (torchft, a replica group per process)", "distributed_live_recovery.py",
            "replica groups", needs="torchft"),
        # the data path users run: the other rows load in the rank on the CPU (--workers 0, the cores compute)
        *([] if gpu else [Row(f"DDP, {WORKERS} DataLoader workers ({start})", script, start, ["--workers", WORKERS])
                          for start, script in (("torchrun", "distributed.py"), ("spawn", "distributed_mp.py"))]),
        Row("DDP + bfloat16 autocast", "distributed_apex.py", "spawn", ["--amp-dtype", "bfloat16"], amp="bfloat16"),
        # on the CPU the peers keep per-rank BatchNorm (torch's SyncBatchNorm is GPU-only): the row like them
        *([] if gpu else [Row("DDP + bfloat16 autocast, no SyncBatchNorm", "distributed_apex.py", "spawn",
                              ["--amp-dtype", "bfloat16", "--no-sync-bn"], amp="bfloat16")]),
        Row("DDP + float16 autocast + GradScaler", "distributed_apex.py", "spawn", ["--amp-dtype", "float16"],
            amp="float16", gpu_only=True),
        Row("DDP + gradient accumulation (k=4)", "distributed_gradient_accumulation.py", "spawn",
            ["--grad-accu-steps", "4"]),
        Row("DDP + gradient accumulation (k=4, one bucket)", "distributed_gradient_accumulation.py", "spawn",
            ["--grad-accu-steps", "4", "--bucket-cap-mb", "64"]),
        Row("FSDP (fully_shard)", "distributed_fsdp.py", "torchrun", ["--opt-level", "O0"]),
        Row("FSDP, no reshard after forward", "distributed_fsdp.py", "torchrun",
            ["--opt-level", "O0", "--no-reshard-after-forward"]),
        Row("FSDP + bfloat16 policy", "distributed_fsdp.py", "torchrun", ["--amp-dtype", "bfloat16"], amp="bfloat16"),
        # the whole model one FSDP unit under bfloat16 autocast: a fraction of the stages' host time (docs/sharding.md)
        Row("FSDP + bfloat16 autocast, one unit", "distributed_fsdp.py", "torchrun",
            ["--units", "model", "--amp-dtype", "bfloat16"], amp="bfloat16"),
        # the layers split instead of the batch: a stage per process (one stage on one GPU: accumulation's arithmetic
        # through the schedule), the same global batch in 4 micro-batches (docs/sharding.md)
        Row("Pipeline (1F1B, 4 micro-batches)", "distributed_pipeline.py", "torchrun", ["--microbatches", "4"],
            full_only=True),
        Row("DDP + bfloat16, all techniques", "distributed_apex.py", "spawn",
            ["--amp-dtype", "bfloat16", "--loader", "device", "--channels-last", "--optimizer-impl",
             "fused" if gpu else "auto"] + (["--compile"] if gpu else []), amp="bfloat16"),
        # the whole step replayed from one CUDA graph (speed/cuda_graphs.py): with and without SyncBatchNorm, and
        # with the model's kernels compiled (torch.compile's default mode) inside the graph
        *[Row(f"DDP + bfloat16, CUDA graphs{name}", "distributed_apex.py", "torchrun",
              ["--amp-dtype", "bfloat16", "--loader", "device", "--cuda-graphs", *extra], amp="bfloat16", gpu_only=True)
          for name, extra in (("", []), (", no SyncBatchNorm", ["--no-sync-bn"]), (", compiled", ["--compile"]))],
        # the techniques: each changes one flag of "DDP (torchrun)"
        Row("a host sync every step", "distributed.py", "torchrun", ["--print-freq", "1"], "technique"),
        Row("gradients copied into buckets", "distributed.py", "torchrun", ["--no-gradient-as-bucket-view"],
            "technique"),
        Row("static graph", "distributed.py", "torchrun", ["--static-graph"], "technique"),
        Row("one 64 MB bucket", "distributed.py", "torchrun", ["--bucket-cap-mb", "64"], "technique"),
        Row("fp16 gradient compression", "distributed.py", "torchrun", ["--comm-hook", "fp16"], "technique"),
        Row("bf16 gradient compression", "distributed.py", "torchrun", ["--comm-hook", "bf16"], "technique"),
        Row("PowerSGD (rank 2)", "distributed.py", "torchrun", ["--comm-hook", "powersgd"], "technique"),
        Row("channels-last", "distributed.py", "torchrun", ["--channels-last"], "technique"),
        Row("torch.compile", "distributed.py", "torchrun", ["--compile"], "technique", full_only=not gpu),
        Row("foreach SGD step", "distributed.py", "torchrun", ["--optimizer-impl", "foreach"], "technique"),
        Row("fused SGD step", "distributed.py", "torchrun", ["--optimizer-impl", "fused"], "technique"),
        # --loader device is distributed_apex.py's alone; in float32 (--opt-level O0) it trains as distributed.py
        Row("device-side data path", "distributed_apex.py", "torchrun", ["--opt-level", "O0", "--loader", "device"],
            "technique"),
        Row("no SyncBatchNorm", "distributed.py", "torchrun", ["--no-sync-bn"], "technique"),
        # the peers: the same job as others write it, and the bare step's ceilings once compiled
        Row(PLAIN_LOOP, PLAIN, "torchrun", table="peer"),
        Row("Lightning Trainer, DDP", LIGHTNING, "torchrun", table="peer", needs="lightning"),
        # and in their mixed precision, beside "DDP + bfloat16 autocast"
        Row(PLAIN_LOOP_BF16, PLAIN, "torchrun", ["--precision", "bfloat16"], "peer",
            amp="bfloat16"),
        Row(TUNED_LOOP_BF16, PLAIN, "torchrun", ["--precision", "bfloat16", "--tuned"], "peer", amp="bfloat16",
            full_only=not gpu),  # compiling ResNet-18 takes most of a minute on the CPU
        Row("Lightning Trainer, DDP, bf16-mixed", LIGHTNING, "torchrun", ["--precision", "bfloat16"], "peer",
            amp="bfloat16", needs="lightning"),
        Row("bare step, compiled", BARE_STEP, "side by side", ["--compile", "default"], "peer",
            full_only=not gpu),
        Row("bare step, CUDA graphs", BARE_STEP, "side by side", ["--compile", "reduce-overhead"],
            "peer", gpu_only=True),
    ]


def ours_beside_peers(device: str) -> dict[str, str]:
    """The rows of ours that the peers table puts beside the peers, each with the plain loop of its precision;
    on the CPU, where the peers keep per-rank BatchNorm, also our rows without SyncBatchNorm, which are like them."""
    pairs = {"DDP (torchrun)": PLAIN_LOOP, "DDP + bfloat16 autocast": PLAIN_LOOP_BF16}
    if device == "cuda":  # our fastest path, in bfloat16
        pairs |= {"DDP + bfloat16, CUDA graphs": PLAIN_LOOP_BF16,
                  "DDP + bfloat16, CUDA graphs, no SyncBatchNorm": PLAIN_LOOP_BF16,
                  "DDP + bfloat16, CUDA graphs, compiled": TUNED_LOOP_BF16}  # compiled beside compiled
    if device == "cpu":
        pairs |= {"no SyncBatchNorm": PLAIN_LOOP, "DDP + bfloat16 autocast, no SyncBatchNorm": PLAIN_LOOP_BF16}
    return pairs


def keyword_rows(device: str) -> dict[str, set[str]]:
    """The row names that a word of --only stands for: seed, the seed table's four; peers, the peers table's
    rows and the rows of ours they are compared with (ours_beside_peers); others, every row those two leave out,
    with DDP (torchrun), which the technique rows are compared with. "seed,peers" then "others": every row, in
    two runs (on a GPU, each well within a 10-minute limit: docs/speed.md)."""
    seed = set(seed_rows(device).values())
    peers = {r.name for r in rows(device) if r.table == "peer"} | set(ours_beside_peers(device))
    others = {r.name for r in rows(device)} - seed - peers | {"DDP (torchrun)"}
    return {"seed": seed, "peers": peers, "others": others}


def rows_named(only: list[str] | None, device: str) -> list[Row] | str:
    """The rows that the --only values name, in the order named (harness.rows_named), with the keywords of
    keyword_rows."""
    return harness.rows_named(rows(device), only, keyword_rows(device))


def why_left_out(row: Row, args) -> str | None:
    """Why `row` cannot run in this benchmark run, or None when it can."""
    if row.gpu_only and args.device != "cuda":
        return "it needs a GPU"
    if row.full_only and args.quick:
        return "not in --quick (compiling takes minutes on a CPU); run without --quick to measure it"
    if row.needs and not harness.importable(row.needs):
        return f"`{row.needs}` is not installed (an optional dependency: pip install {row.needs})"
    return None


def run_row(row: Row, args) -> dict:
    if row.start == "side by side":
        return ceiling(row, args)
    if row.table == "peer":
        return run_peer(row, args)
    processes = 1 if row.start == "python" else args.nprocs
    global_batch = args.batch_size * args.nprocs  # DataParallel: one process, the same global batch
    with tempfile.TemporaryDirectory() as out:
        cmd = harness.launch(row, args.nprocs) + [
            "--dataset", "synthetic", "--train-samples", str(args.steps * global_batch),
            "--test-samples", str(global_batch), "--batch-size", str(global_batch), "--epochs", str(args.epochs),
            "--workers", str(args.workers), "--device", args.device, "--print-freq", "1000000",
            "--output-dir", out] + row.flags
        started = time.perf_counter()
        if row.start == "replica groups":
            processes = args.nprocs
            result = harness.run_replica_groups(cmd, args.nprocs, harness.threads_env(processes))
            out = Path(out, "replica_group_0")
        else:
            result = harness.run_stoppable(cmd, harness.threads_env(processes))
        if result.returncode != 0:
            return {"error": harness.why_it_failed(result.stderr),
                    "command": " ".join(cmd)}
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]
    return {"processes": processes, "images_per_s": statistics.median(r["images_per_s"] for r in timed),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in records),
            "wall_s": time.perf_counter() - started}


def peer_command(row: Row, args) -> list[str]:
    """A peer program under torchrun, on the workload of our rows: the same per-rank batch, steps, epochs, workers."""
    return harness.launch(row, args.nprocs) + [
        "--device", args.device, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--epochs", str(args.epochs), "--workers", str(args.workers)] + row.flags


def peer_epochs(stdout: str) -> list[dict]:
    """The JSON line a peer program's rank 0 prints per epoch, among whatever else it prints (Lightning does)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"epoch"')]


def run_peer(row: Row, args) -> dict:
    cmd = peer_command(row, args)
    started = time.perf_counter()
    result = harness.run_stoppable(cmd, harness.threads_env(args.nprocs))
    epochs = peer_epochs(result.stdout)
    if result.returncode != 0 or len(epochs) != args.epochs:
        error = ((result.stderr.strip().splitlines() or ["no output"])[-1][:200] if result.returncode else
                 f"printed {len(epochs)} epoch lines for {args.epochs} epochs")
        return {"error": error, "command": " ".join(cmd)}
    computed = {e.get("outputs") for e in epochs}
    if computed != {row.amp or "float32"}:  # the row measures the precision its name says, or nothing
        return {"error": f"its model's outputs were {', '.join(map(str, sorted(computed, key=str)))}, "
                         f"not {row.amp or 'float32'}", "command": " ".join(cmd)}
    return {"processes": epochs[-1]["world_size"],
            "images_per_s": statistics.median(e["images_per_s"] for e in epochs[1:]),
            "wall_s": time.perf_counter() - started}


def side_by_side(args, extra: list[str]) -> list[dict] | None:
    """N bare-step processes at once, one per device (or per share of the cores): what each printed, or None
    if one failed (its error went to stderr)."""
    command = [sys.executable, "-m", "benchmarks.bare_step", "--batch-size", str(args.batch_size), "--steps",
               str(args.steps * (args.epochs - 1)), "--warmup", str(args.steps), *extra]
    devices = [f"cuda:{i}" if args.device == "cuda" else "cpu" for i in range(args.nprocs)]
    return harness.last_json_lines([[*command, "--device", device] for device in devices],
                                   [harness.threads_env(args.nprocs)] * args.nprocs)


def ideal(args, amp: str | None) -> dict:
    """N bare-step processes side by side: their images/s summed."""
    results = side_by_side(args, ["--amp-dtype", amp] if amp else [])
    if results is None:
        raise SystemExit("the bare step failed; run python -m benchmarks.bare_step to see why")
    return {"images_per_s": sum(r["images_per_s"] for r in results),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in results)}


def ceiling(row: Row, args) -> dict:
    """The ideal of a compiled bare step (row.flags): what the step itself reaches once compiled."""
    started = time.perf_counter()
    results = side_by_side(args, row.flags)
    if results is None:
        return {"error": f"the bare step failed; run python -m benchmarks.bare_step {' '.join(row.flags)} to see why"}
    return {"processes": args.nprocs, "images_per_s": sum(r["images_per_s"] for r in results),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in results), "wall_s": time.perf_counter() - started}


def device_peak(args, dtype: str) -> float:
    """TFLOP/s of one device (on the CPU: all cores, one process): the faster of large matrix products
    and large convolutions (benchmarks/bare_step.py)."""
    device = "cuda:0" if args.device == "cuda" else "cpu"
    out = subprocess.run([sys.executable, "-m", "benchmarks.bare_step", "--device", device, "--peak", dtype],
                         cwd=ROOT, env=harness.threads_env(1), capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_tflops"]


def markdown(results: dict) -> str:
    meta = results["meta"]
    base = next((r for r in results["rows"] if r["name"] == "DDP (torchrun)" and "images_per_s" in r), None)
    lines = [f"Hardware: {meta['hardware']}. Command: `{meta['command']}`, at commit {meta.get('commit', 'unknown')}.",
             f"Per-rank batch {meta['batch_size']}, {meta['nprocs']} device(s) ({meta['device']}), "
             f"{meta['steps']} steps per epoch, median of epochs 2-{meta['epochs']}; "
             f"{meta['flops_per_image'] / 1e9:.2f} GFLOP per image (forward + backward, counted).",
             "Ideal (bare step x N, side by side): " + ", ".join(
                 f"{k} {v['images_per_s']:.1f} images/s" + (f" (mean of {v['before']:.1f} before the rows and "
                                                            f"{v['after']:.1f} after)" if "after" in v else "")
                 for k, v in meta["ideal"].items()) + ".",
             "Peak of one device (the faster of large matmuls and convolutions): " + ", ".join(
                 f"{k} {v:.2f} TFLOP/s" for k, v in meta["peak_tflops"].items()) + ".", ""]
    if meta.get("unfinished"):
        lines += [f"**Unfinished:** {meta['unfinished']}", ""]
    for line in meta.get("left_out") or []:
        lines += [line, ""]
    lines += seed_table(results)
    lines += peers_table(results)
    for table, title in (("method", "Methods"), ("technique", "Techniques (one flag changed on DDP (torchrun))")):
        if not any(r["table"] == table for r in results["rows"]):
            continue
        cells = []
        for r in (r for r in results["rows"] if r["table"] == table):
            what = f"`{harness.script_and_flags(r)}`"
            if "images_per_s" not in r:
                cells.append([r["name"], what, "", r.get("error", "not run"), "", "", "", "", ""])
                continue
            rate, peak = r["images_per_s"], meta["peak_tflops"].get(r["amp"] or "float32")
            tflops = rate * meta["flops_per_image"] / 1e12
            ideal_rate = meta["ideal"].get(r["amp"] or "float32", {}).get("images_per_s")
            versus_ideal = f"{rate / ideal_rate:.2f}" if ideal_rate else ""  # each left blank where not measured
            versus_ddp = f"{rate / base['images_per_s']:.2f}" if base else ""
            share = f" ({100 * tflops / peak:.0f}%)" if peak else ""
            cells.append([r["name"], what, r["processes"], f"{rate:.1f}", f"{EPOCH_IMAGES / rate:.1f}", versus_ideal,
                          versus_ddp, f"{r['peak_memory_mb']:.0f}", f"{tflops:.3g}{share}"])
        lines += [f"### {title}", "", *harness.table(
            ["row", "script + flags", "processes", "images/s", "s per 50,000-image epoch", "vs ideal", "vs DDP",
             "peak MB / process", "TFLOP/s (% of peak)"], cells)]
        lines.append("")
    return "\n".join(lines)


def seed_table(results: dict) -> list[str]:
    """The seed project's four rows, as measured in this run (those that ran)."""
    measured = {r["name"]: r for r in results["rows"] if "images_per_s" in r}
    pairs = [(seed, measured[ours]) for seed, ours in seed_rows(results["meta"]["device"]).items() if ours in measured]
    if not pairs:
        return []
    first = pairs[0][1]["images_per_s"] if pairs[0][0] == "DataParallel" else None
    lines = ["### Seed table (the seed project's four rows, measured in this run)", "", *harness.table(
        ["seed's row", "our row", "script + flags", "s per 50,000-image epoch", "speed vs DataParallel"],
        [[seed, r["name"], f"`{harness.script_and_flags(r)}`", f"{EPOCH_IMAGES / r['images_per_s']:.1f}",
          f"{r['images_per_s'] / first:.2f}" if first else ""] for seed, r in pairs])]
    return lines + [""]


def program(r: dict, n: int) -> str:
    """How a row of the peers table was started, as one would type it."""
    if r["script"] == BARE_STEP:
        return f"`{harness.script_and_flags(r)}`, {n} side by side"
    launcher = (["python", r["script"], "--nprocs", str(n)] if r.get("start") == "spawn" else
                ["torchrun", f"--nproc_per_node={n}", *harness.launch_target(r["script"], Path())])
    return f"`{' '.join(launcher + r['flags'])}`"


def peers_table(results: dict) -> list[str]:
    """The bare step's ceilings, our rows beside the peers and the peer programs, then how ours compare with
    the peer of their precision."""
    meta = results["meta"]
    peers = [r for r in results["rows"] if r["table"] == "peer"]
    if not peers:
        return []
    n, ideals = meta["nprocs"], meta["ideal"]
    measured = {r["name"]: r for r in results["rows"] if "images_per_s" in r}
    base = measured.get("DDP (torchrun)")
    beside = ours_beside_peers(meta["device"])
    ours = [measured[name] for name in beside if name in measured]
    # each ideal measured, named by its precision: a bfloat16 row's "vs ideal" is against the bfloat16 one
    eager = [{"name": f"bare step, eager {dtype} (the {dtype} ideal)", "script": BARE_STEP,
              "flags": [] if dtype == "float32" else ["--amp-dtype", dtype],
              "amp": None if dtype == "float32" else dtype, "processes": n, "images_per_s": ideal["images_per_s"]}
             for dtype, ideal in ideals.items()]
    ceilings = eager + [r for r in peers if r["script"] == BARE_STEP]
    programs = [r for r in peers if r["script"] != BARE_STEP]
    cells = []
    for r in ceilings + ours + programs:
        if "images_per_s" not in r:
            cells.append([r["name"], program(r, n), "", r.get("error", "not run"), "", "", ""])
            continue
        rate, ideal_rate = r["images_per_s"], ideals.get(r["amp"] or "float32", {}).get("images_per_s")
        versus_ideal = f"{rate / ideal_rate:.2f}" if ideal_rate else ""
        versus_ddp = f"{rate / base['images_per_s']:.2f}" if base else ""
        cells.append([r["name"], program(r, n), r["processes"], f"{rate:.1f}", f"{EPOCH_IMAGES / rate:.1f}",
                      versus_ideal, versus_ddp])
    lines = ["### Peers (the same job written as others write it, and the bare step's ceilings)", "", *harness.table(
        ["row", "program + launcher", "processes", "images/s", "s per 50,000-image epoch", "vs ideal",
         "vs DDP (torchrun)"], cells)]
    lines.append("")
    ran = {r["name"]: r["images_per_s"] for r in programs if "images_per_s" in r}
    for r in ours:
        if (peer := beside[r["name"]]) in ran:
            lines.append(f"`{harness.script_and_flags(r)}` ({r['name']}) runs at "
                         f"{r['images_per_s'] / ran[peer]:.2f}x the {peer}.")
    best = max((r for r in results["rows"] if r["table"] != "peer" and "images_per_s" in r),
               key=lambda r: r["images_per_s"], default=None)
    if best and ran:
        peer = max(ran, key=ran.get)
        lines.append(f"Our fastest row in this run, {best['name']}, is {best['images_per_s'] / ran[peer]:.2f}x the "
                     f"fastest peer, {peer}.")
    if meta["device"] == "cpu":
        lines.append("On the CPU the peers keep per-rank BatchNorm (torch's SyncBatchNorm refuses CPU tensors) where "
                     "our DDP rows synchronise it (CpuSyncBatchNorm): the rows of ours without SyncBatchNorm are the "
                     "ones like them.")
    return lines + [""]


def write_tables(results: dict, out: Path) -> None:
    """benchmark.json and benchmark.md, each replaced whole."""
    harness.write_whole(out, {"benchmark.json": json.dumps(results, indent=1), "benchmark.md": markdown(results)})


def chart(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results["rows"] if "images_per_s" in r]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(done) + 1.6))
    names = [r["name"] for r in done][::-1]
    rates = [r["images_per_s"] for r in done][::-1]
    colours = [{"method": "tab:blue", "technique": "tab:orange"}.get(r["table"], "tab:green") for r in done][::-1]
    ax.barh(names, rates, color=colours)
    ideal_rate = results["meta"]["ideal"]["float32"]["images_per_s"]
    ax.axvline(ideal_rate, color="black", linestyle="--", label=f"ideal, float32 ({ideal_rate:.1f} images/s)")
    ax.set_xlabel("images/s (higher is better)")
    ax.set_title(results["meta"]["hardware"], fontsize=8)
    ax.legend(loc="lower right", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes on the CPU: small batch, few steps, no torch.compile row")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when a GPU is visible")
    parser.add_argument("--nprocs", type=flags.positive_int, default=None,
                        help="devices (processes); default: every GPU, or 2")
    parser.add_argument("--batch-size", type=flags.positive_int, default=None,
                        help="per-rank batch; default: 256 on GPU, 32 on the CPU, 16 with --quick")
    parser.add_argument("--steps", type=flags.positive_int, default=None,
                        help="steps per epoch; default: 40 on GPU, 6 on the CPU, 4 with --quick")
    parser.add_argument("--epochs", type=flags.positive_int, default=None,
                        help="epochs per row; the first is not counted (default: 3, 2 with --quick)")
    parser.add_argument("--workers", type=flags.non_negative_int, default=None,
                        help="DataLoader workers per process; default: 0 on the CPU (the cores compute; two rows "
                             f"use {WORKERS}), 8 on GPU")
    parser.add_argument("--only", action="append", default=None, metavar="ROWS",
                        help="run only the rows whose name contains this text, or the one row whose whole name "
                             "it is, in the order given (several: separated by commas, or --only again for a whole "
                             "name that has commas; seed: the seed table's four rows; peers: the peers table and "
                             "our rows beside it; others: the rows those two leave out, with DDP (torchrun))")
    parser.add_argument("--output-dir", default="runs/benchmark", help="where benchmark.md/.png/.json go")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    gpu = args.device == "cuda"
    args.nprocs = args.nprocs or (torch.cuda.device_count() if gpu else 2)
    args.batch_size = args.batch_size or (256 if gpu else 16 if args.quick else 32)
    args.steps = args.steps or (40 if gpu else 4 if args.quick else 6)
    args.epochs = args.epochs or (2 if args.quick else 3)
    args.workers = args.workers if args.workers is not None else (8 if gpu else 0)
    if args.epochs < 2:
        parser.error("--epochs must be 2 or more: the first epoch is not counted")
    if args.batch_size % 4:
        parser.error("--batch-size must be divisible by 4 (the accumulation rows split it in 4 micro-batches)")
    wanted = rows_named(args.only, args.device)
    if isinstance(wanted, str):
        parser.error(wanted)
    selected, left_out = [], []
    for r in wanted:
        reason = why_left_out(r, args)
        if reason is None:
            selected.append(r)
        elif r.table == "peer":  # the other tables leave out GPU rows and --quick's omissions without a word
            left_out.append(f"{r.name}: left out, {reason}.")
    if args.quick and not gpu and not precision.cpu_has_native_bfloat16():
        emulated = [r.name for r in selected if r.amp == "bfloat16"]
        selected = [r for r in selected if r.amp != "bfloat16"]
        if emulated:
            left_out.append(f"--quick left out {len(emulated)} bfloat16 row(s) ({', '.join(emulated)}): this CPU has "
                            "no native bfloat16 instructions (AVX512-BF16 or AMX), so bfloat16 is emulated, some 18x "
                            "slower than float32; run without --quick to measure them anyway")
        if not selected and emulated:
            parser.error(f"--only {','.join(args.only)!r}: only bfloat16 rows, which --quick leaves out on this CPU")
    if not selected:
        parser.error(f"--only {','.join(args.only)!r}: every row it names is left out here" +
                     (f" ({' '.join(left_out)})" if left_out else ""))
    for line in left_out:
        print(line, flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    meta = {"hardware": harness.hardware(args.device, args.nprocs), "device": args.device, "nprocs": args.nprocs,
            "batch_size": args.batch_size, "steps": args.steps, "epochs": args.epochs,
            "command": shlex.join(["python", "-m", "benchmarks.run", *(sys.argv[1:] if argv is None else argv)]),
            "commit": harness.git_commit(), "flops_per_image": flops_per_image(),
            "ideal": {}, "peak_tflops": {}, "left_out": left_out}
    print(f"{meta['hardware']}; {len(selected)} rows", flush=True)
    dtypes = list(dict.fromkeys([None] + [r.amp for r in selected]))
    # one stage per ideal, per row and the float32 ideal again at the end; the bar (on a terminal) names the
    # current stage and estimates the time left from the stages done; each stage done also prints one line
    stages = len(dtypes) + len(selected) + 1
    bar = tqdm(total=stages, unit="stage", dynamic_ncols=True, disable=None,
               bar_format="{desc}: {n_fmt}/{total_fmt} stages [{elapsed}, about {remaining} left]")
    progress = harness.Progress(stages, write=bar.write)

    def done(text: str) -> None:
        bar.update()
        progress.done(text)

    results = {"meta": meta, "rows": []}
    try:
        with harness.stopped_as_ctrl_c():  # kill -TERM, a closed terminal: stopped as Ctrl-C stops it
            for amp in dtypes:
                bar.set_description(f"ideal and peak, {amp or 'float32'}")
                meta["ideal"][amp or "float32"] = ideal(args, amp)
                meta["peak_tflops"][amp or "float32"] = device_peak(args, amp or "float32")
                done(f"ideal {amp or 'float32'}: {meta['ideal'][amp or 'float32']['images_per_s']:.1f} images/s; "
                     f"peak {meta['peak_tflops'][amp or 'float32']:.2f} TFLOP/s")
            for row in selected:
                bar.set_description(row.name)
                measured = run_row(row, args)
                results["rows"].append({"name": row.name, "script": row.script, "start": row.start, "flags": row.flags,
                                        "table": row.table, "amp": row.amp, **measured})
                # the tables so far after every row: a run stopped or killed keeps the rows it measured
                meta["unfinished"] = (f"{len(results['rows'])} of {len(selected)} rows measured when this was "
                                      "written; the run did not finish, and the float32 ideal was measured before "
                                      "the rows only.")
                write_tables(results, out)
                done(f"{row.name}: " + (f"{measured['images_per_s']:.1f} images/s ({measured['wall_s']:.0f} s)"
                                        if "images_per_s" in measured else f"failed: {measured['error']}"))
            # the float32 ideal again at the end, so that the machine's drift during the run shows
            bar.set_description("ideal float32, again")
            again = ideal(args, None)["images_per_s"]
    except KeyboardInterrupt as stop:  # the rows measured so far are in the files, said to be unfinished
        bar.close()  # (the row being measured was stopped by run_stoppable)
        sys.exit(harness.stopped_status(stop, f"after {len(results['rows'])} of {len(selected)} rows: "
                                        f"{out / 'benchmark.md'} has the rows measured" if results["rows"] else
                                        "before any row was measured: nothing written"))
    done(f"ideal float32 again: {again:.1f} images/s")
    bar.close()
    meta.pop("unfinished", None)
    first = meta["ideal"]["float32"]["images_per_s"]
    meta["ideal"]["float32"].update(images_per_s=(first + again) / 2, before=first, after=again)
    write_tables(results, out)
    chart(results, out / "benchmark.png")
    print(markdown(results))
    print(f"wrote {out / 'benchmark.md'}, {out / 'benchmark.png'}, {out / 'benchmark.json'}")
    if any("error" in r for r in results["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
