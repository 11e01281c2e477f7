"""A picture of a run's profiled steps (--profile-steps): per rank, a lane of compute and a lane of communication.

    torchrun --standalone --nproc_per_node=2 distributed.py --device cpu --profile-steps 2   # records the traces
    python -m tools.timeline runs/distributed                      # into runs/distributed/timeline.png

Compute is what each rank's threads run, operator by operator (the innermost ones: a wait for a collective is a
gap), coloured forward, backward (autograd's functions) or optimizer (its step and zero_grad); on a GPU, the
kernels. Communication is each collective as the backend runs it (gloo's threads on the CPU, NCCL's kernels on a
GPU), named as the program asked for it, with its size. The number is the share of communication time during which
the same rank computes (merged intervals, summed over the ranks): HolisticTraceAnalysis's overlap, computed here
because HTA counts only GPU kernels (nothing in a CPU trace) and needs pandas, plotly and jupyterlab.

"""
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from utils import flags
from utils.errors import UsageError, exit_on_error

PROFILE = "profile"  # safety_net.profiling.FOLDER, without importing torch
CATEGORIES = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "data loading": "#c7c7c7"}
COMPUTE = ("forward", "backward", "optimizer")  # what the overlap counts as compute
COLLECTIVE_COLOURS = {"all_reduce": "#8172b3", "broadcast": "#64b5cd", "all_gather": "#ccb974",
                      "reduce_scatter": "#c44e52", "memcpy": "#937860", "send": "#da8bc3", "recv": "#8c8c8c"}
# bytes of an element, by every name a trace gives a dtype: the CPU operators' "Input type" (C++ names), and the
# "dtype" that record_param_comms attaches to a collective's kernels (ScalarType names, or torch's in newer torch)
DTYPE_BYTES = {"float": 4, "double": 8, "int": 4, "long int": 8, "c10::Half": 2, "c10::BFloat16": 2, "bool": 1,
               "unsigned char": 1, "signed char": 1, "short int": 2,
               "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
               "Bool": 1, "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1}
# the element type in an NCCL kernel's name (ncclDevKernel_AllReduce_Sum_bf16_RING_LL), where its args have none
KERNEL_DTYPE_BYTES = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2, "i64": 8, "u64": 8, "i32": 4, "u32": 4, "i8": 1, "u8": 1}
# an NCCL collective's name in a trace (allreduce, _allgather_base, reduce_scatter_tensor_coalesced, AllGather, ...):
# the first of these words it holds, its underscores and case aside, names it (reduce_scatter before reduce)
NCCL_WORDS = (("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
              ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send"),
              ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"))
# the c10d operator a program calls -> the collective's name
ASKED = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
         "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_": "reduce", "gather_": "gather",
         "scatter_": "scatter", "alltoall_base_": "all_to_all", "barrier": "barrier"}


@dataclass
class Collective:
    start: float  # ms from the first recorded step's start
    end: float
    asked: str  # the collective the program called (reduce_scatter)
    ran: str  # what the backend ran (gloo runs a reduce_scatter as an all_reduce)
    size: int  # bytes, 0 where the trace does not say


@dataclass
class Lane:
    """One rank's recorded steps, in ms from the first recorded step's start."""
    name: str
    compute: dict = field(default_factory=dict)  # category -> [(start, end)], merged
    collectives: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # (start, end, "step 3")


def trace_files(run_dir: Path) -> dict[str, Path]:
    """{lane name: trace} of a run's --output-dir: profile/rank<R>.json, or for distributed_live_recovery.py each
    replica group's; a directory without any is a UsageError."""
    found = {}
    for folder in [run_dir / PROFILE] + sorted(run_dir.glob(f"replica_group_*/{PROFILE}")):
        group = f"group {folder.parent.name.rsplit('_', 1)[1]} " if folder.parent != run_dir else ""
        ranks = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
        world = _world_size(ranks[0]) if ranks else 0
        found.update({f"{group}rank {p.stem[4:]}": p for p in ranks
                      if p.stem[4:].isdigit() and int(p.stem[4:]) < world})
    if not found:
        raise UsageError(f"{run_dir} holds no {PROFILE}/rank0.json (was the run started with --profile-steps N?)")
    return found


def _world_size(path: Path) -> int:
    """The world size rank 0's trace records (an earlier run's traces of more ranks are left out)."""
    return int(_load(path).get("distributedInfo", {}).get("world_size", 1))


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path} ({error})") from None


def _category(name: str) -> str | None:
    """The category an event gives itself and what runs inside it, or None: its parent's."""
    if name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith("enumerate(DataLoader)"):
        return "data loading"
    if name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")):
        return "communication"  # the call that hands a collective to the backend, not compute
    return None


def _numel(dims) -> int:
    """The elements of a profiler's "Input Dims" entry (a shape, or a list of shapes)."""
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    total = 1
    for d in dims:
        total *= d
    return total


def _merged(intervals: list, gap: float = 0.0) -> list:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def _length(intervals: list) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list, b: list) -> float:
    """The time two lists of merged intervals share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def read_lane(name: str, trace: dict, origin: float | None = None) -> Lane:
    """A rank's lane from its chrome trace (torch.profiler's export_chrome_trace). origin: the time (µs, absolute)
    that is 0 in the picture; None: this trace's first recorded step."""
    base = trace.get("baseTimeNanoseconds", 0) / 1000
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    for e in events:
        e["start"], e["end"] = e["ts"] + base, e["ts"] + base + e["dur"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["start"])
    if not steps:
        raise UsageError(f"{name}'s trace holds no recorded step (ProfilerStep#)")
    origin = steps[0]["start"] if origin is None else origin
    main = steps[0]["tid"]
    lane = Lane(name, steps=[((s["start"] - origin) / 1000, (s["end"] - origin) / 1000,
                              f"step {int(s['name'].split('#')[1]) + 1}") for s in steps])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    compute, launched = _compute_by_category(events, main)
    if kernels:  # a GPU: the device's kernels are the compute, NCCL's and copies between devices the communication
        compute = {}
        for k in kernels:
            if k.get("cat") == "kernel" and "nccl" not in k["name"].lower():
                what = launched.get(k.get("args", {}).get("correlation"), "forward")
                compute.setdefault(what if what in CATEGORIES else "forward", []).append((k["start"], k["end"]))
    lane.compute = {what: [((s - origin) / 1000, (e - origin) / 1000) for s, e in _merged(intervals)]
                    for what, intervals in compute.items()}
    lane.collectives = [Collective((c.start - origin) / 1000, (c.end - origin) / 1000, c.asked, c.ran, c.size)
                        for c in _collectives(events, kernels)]
    return lane


def _compute_by_category(events: list, main) -> tuple[dict, dict]:
    """({category: [(start, end)]} of every CPU thread's operators, {correlation: category} of the CUDA runtime calls
    that launched kernels). An operator counts whole unless a collective is called inside it (DDP's forward, a
    SyncBatchNorm): then only its own operators count, and the time it waits for the collective is a gap. The
    training thread's outermost operators are forward unless they say otherwise; other threads' count only inside
    what names itself (autograd's functions on a GPU's backward thread)."""
    by_thread = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset", "Trace") and not e["name"].startswith(
                "ProfilerStep#"):
            by_thread.setdefault(e["tid"], []).append(e)
    compute, launched = {}, {}
    for tid, thread in by_thread.items():
        thread.sort(key=lambda e: (e["start"], -e["end"]))
        stack = []  # the events that enclose this one, innermost last
        for e in thread:
            while stack and stack[-1]["end"] <= e["start"]:
                stack.pop()
            e["parent"] = stack[-1] if stack else None
            inherited = stack[-1]["what"] if stack else ("forward" if tid == main else None)
            e["what"] = _category(e["name"]) or inherited
            if e["what"] == "communication":  # every enclosing event waits for (or hands over) a collective
                for outer in stack:
                    outer["calls_a_collective"] = True
            if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
                launched[e["args"]["correlation"]] = e["what"]
            stack.append(e)
        for e in thread:
            outermost = e["parent"] is None or e["parent"].get("calls_a_collective")
            if outermost and not e.get("calls_a_collective") and e["what"] in CATEGORIES:
                compute.setdefault(e["what"], []).append((e["start"], e["end"]))
    return compute, launched


def _collectives(events: list, kernels: list) -> list[Collective]:
    """Each collective as the backend ran it, named as the program asked: a gloo thread's event is paired with the
    first earlier c10d call of a tensor of its size not yet paired; NCCL's kernels and device-to-device copies by
    their own names."""
    calls = sorted((e for e in events if e["name"].startswith("c10d::")), key=lambda e: e["start"])
    paired = set()
    out = []
    for e in sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["start"]):
        ran = e["name"][5:]
        args = e.get("args", {})
        numel = _numel(args.get("Input Dims"))
        width = DTYPE_BYTES.get((args.get("Input type") or ["float"])[0], 4)
        asked = ran
        for i, call in enumerate(calls):
            if call["start"] > e["start"]:
                break
            dims = call.get("args", {}).get("Input Dims") or []
            if i not in paired and numel in [_numel(d) for d in dims if d]:
                paired.add(i)
                op = call["name"][6:]
                asked = ASKED.get(op, op.strip("_"))
                break
        out.append(Collective(e["start"], e["end"], asked, ran, numel * width))
    for k in kernels:
        name, args = k["name"], k.get("args", {})
        if k.get("cat") == "gpu_memcpy" and ("DtoD" in name or "PtoP" in name):  # DataParallel's copies
            out.append(Collective(k["start"], k["end"], "memcpy", "memcpy", int(args.get("bytes", 0))))
        elif k.get("cat") == "kernel" and "nccl" in name.lower():  # ncclDevKernel_AllReduce_Sum_f32_RING_LL
            asked = nccl_collective(str(args.get("Collective name") or name.split("_")[1]))
            # the bytes it moved: the larger of its input and output (an all-gather's output is N inputs)
            numel = max(int(args.get("In msg nelems", 0) or 0), int(args.get("Out msg nelems", 0) or 0))
            out.append(Collective(k["start"], k["end"], asked, asked, numel * nccl_dtype_bytes(name, args)))
    return sorted(out, key=lambda c: c.start)


def nccl_collective(text: str) -> str:
    """The collective a trace's name for an NCCL kernel or its "Collective name" means: all_reduce, all_gather, ..."""
    key = text.lower().replace("_", "")
    return next((name for word, name in NCCL_WORDS if word in key), key)


def nccl_dtype_bytes(kernel_name: str, args: dict) -> int:
    """The bytes of an element of an NCCL kernel: its args' dtype, else the type in its name, else 4."""
    if args.get("dtype") in DTYPE_BYTES:
        return DTYPE_BYTES[args["dtype"]]
    parts = kernel_name.lower().split("_")
    return next((KERNEL_DTYPE_BYTES[p] for p in parts if p in KERNEL_DTYPE_BYTES), 4)


def overlap(lanes: list[Lane]) -> tuple[float, list[float]]:
    """(the share of all ranks' communication time during which their own rank computes, each rank's share);
    NaN where a rank communicated nothing."""
    shares, shared_all, comm_all = [], 0.0, 0.0
    for lane in lanes:
        comm = _merged([(c.start, c.end) for c in lane.collectives])
        compute = _merged([i for c in COMPUTE for i in lane.compute.get(c, [])])
        shared, total = _intersection(comm, compute), _length(comm)
        shares.append(shared / total if total else float("nan"))
        shared_all, comm_all = shared_all + shared, comm_all + total
    return (shared_all / comm_all if comm_all else float("nan")), shares


def pipeline_idle(lanes: list[Lane]) -> list[list[float]]:
    """The pipeline's bubble as measured: for each recorded step, each rank's idle share of the schedule's span (from
    the first forward or backward operator any rank runs in that step to the last one any rank ends), idle being the
    time the rank runs no forward or backward operator of its own in the span: waiting for a neighbour's activations
    or gradients, sending them, or done (its optimizer step is idle here). Theory: (S-1)/(M+S-1) of every rank."""
    steps = min(len(lane.steps) for lane in lanes)
    shares = []
    for k in range(steps):
        work = []  # each rank's forward and backward intervals within its own step k
        for lane in lanes:
            start, end, _ = lane.steps[k]
            work.append(_merged([(max(s, start), min(e, end)) for what in ("forward", "backward")
                                 for s, e in lane.compute.get(what, []) if e > start and s < end]))
        span = (min(w[0][0] for w in work if w), max(w[-1][1] for w in work if w))
        shares.append([1 - _intersection(w, [span]) / (span[1] - span[0]) for w in work])
    return shares


def summary_text(lanes: list[Lane]) -> str:
    """The title's line: the overlap, and for a pipeline (its stages send and receive) the bubble before it."""
    if any(c.asked in ("send", "recv") for lane in lanes for c in lane.collectives):
        return f"{idle_text(lanes)}; {overlap_text(lanes)}"
    return overlap_text(lanes)


def idle_text(lanes: list[Lane]) -> str:
    shares = pipeline_idle(lanes)
    each = ", ".join(f"{lane.name} {sum(s[i] for s in shares) / len(shares):.0%}" for i, lane in enumerate(lanes))
    return f"idle in the schedule's span (the bubble): {each}"


def size_text(size: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def overlap_text(lanes: list[Lane]) -> str:
    total, shares = overlap(lanes)
    if total != total:  # NaN: nothing communicated (one process)
        return "no communication recorded"
    each = ", ".join(f"{lane.name} {share:.0%}" for lane, share in zip(lanes, shares, strict=True))
    return f"communication overlapping compute: {total:.0%} ({each})"


def draw(lanes: list[Lane], title: str, output: Path) -> None:
    """One PNG: two lanes per rank (compute, communication), the steps marked, the overlap (and a pipeline's
    bubble) in the title."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("drawing needs matplotlib: pip install matplotlib (requirements-dev.txt)") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = 2 * len(lanes)
    fig, ax = plt.subplots(figsize=(11, 0.42 * rows))
    end = max([s[1] for lane in lanes for s in lane.steps] + [c.end for lane in lanes for c in lane.collectives])
    asked = {}  # collective -> (count, smallest, largest, what the backend ran)
    for i, lane in enumerate(lanes):
        y_compute, y_comm = rows - 1 - 2 * i, rows - 2 - 2 * i
        for what, intervals in lane.compute.items():
            ax.broken_barh([(s, e - s) for s, e in intervals], (y_compute - 0.35, 0.7), color=CATEGORIES[what],
                           linewidth=0)
        labelled_to = 0.0  # where the last label on this lane ends: two collectives at once get one label
        for c in lane.collectives:
            colour = COLLECTIVE_COLOURS.get(c.asked, "#da8bc3")
            ax.broken_barh([(c.start, max(c.end - c.start, end / 2000))], (y_comm - 0.35, 0.7), color=colour,
                           linewidth=0)
            # its name and size where they fit in the bar (about end/170 per character), else its size alone
            labels = (f"{c.asked} {size_text(c.size)}", size_text(c.size))
            fits = [t for t in labels if len(t) * end / 170 < c.end - c.start]
            if fits and c.start >= labelled_to:
                ax.text((c.start + c.end) / 2, y_comm, fits[0], ha="center", va="center", fontsize=6, color="white")
                labelled_to = c.end
            n, low, high, ran = asked.get(c.asked, (0, c.size, c.size, set()))
            asked[c.asked] = (n + 1, min(low, c.size), max(high, c.size), ran | {c.ran})
        for start, _, label in lane.steps:
            ax.axvline(start, color="black", linewidth=0.6, alpha=0.5)
            if i == 0:
                ax.text(start, rows - 0.45, f" {label}", fontsize=7, va="bottom")
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"{lane.name} {what}" for lane in reversed(lanes) for what in ("comm", "compute")],
                       fontsize=8)
    ax.set_ylim(-0.6, rows - 0.1)
    ax.set_xlim(0, end)
    ax.set_xlabel("ms from the first recorded step", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title}\n{summary_text(lanes)}", fontsize=9)
    handles = [Patch(color=CATEGORIES[c], label=c) for c in CATEGORIES if any(c in lane.compute for lane in lanes)]
    for name, (n, low, high, ran) in sorted(asked.items()):
        sizes = size_text(low) if low == high else f"{size_text(low)}-{size_text(high)}"
        runs_as = f", run by the backend as {'/'.join(sorted(ran))}" if ran != {name} else ""
        handles.append(Patch(color=COLLECTIVE_COLOURS.get(name, "#da8bc3"), label=f"{name} x{n} ({sizes}{runs_as})"))
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.42 * rows)), ncol=3,
              frameon=False)
    _save_small(fig, output)
    plt.close(fig)


def _save_small(fig, output: Path) -> None:
    """The PNG in a palette of 64 colours where Pillow is there (matplotlib needs it): a few tens of KB."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")  # the legend below included
    try:
        from PIL import Image
    except ImportError:
        output.write_bytes(buffer.getvalue())
        return
    Image.open(buffer).convert("RGB").quantize(colors=64).save(output, optimize=True)


def read_run(run_dir: Path) -> list[Lane]:
    """Every rank's lane of a run's --output-dir, on one clock: 0 is the earliest rank's first recorded step."""
    traces = {name: _load(path) for name, path in trace_files(run_dir).items()}
    firsts = []
    for trace in traces.values():
        base = trace.get("baseTimeNanoseconds", 0) / 1000
        firsts += [e["ts"] + base for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    origin = min(firsts) if firsts else None
    return [read_lane(name, trace, origin) for name, trace in traces.items()]


def main(argv=None) -> None:
    parser = flags.Parser(prog="python -m tools.timeline", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("run", type=Path, metavar="RUN_DIR",
                        help="a run's --output-dir, recorded with --profile-steps N")
    parser.add_argument("--output", type=Path, default=None, help="the PNG to write (default: RUN_DIR/timeline.png)")
    parser.add_argument("--title", default=None, help="the picture's title (default: RUN_DIR's name)")
    args = parser.parse_args(argv)
    with exit_on_error():
        lanes = read_run(args.run)
        output = args.output or args.run / "timeline.png"
        if not output.parent.is_dir():
            raise UsageError(f"--output {output}: {output.parent} is not a directory")
        draw(lanes, args.title or args.run.resolve().name, output)
    print(f"{summary_text(lanes)}; drawn into {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
