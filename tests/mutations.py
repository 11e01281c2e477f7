"""Does the quick loop catch a broken line? Each mutation below changes one line of a script or shared module in a
temporary copy of this tree, breaking one behaviour the collection claims; the quick subset (pytest -m "not slow")
then runs on the copy, and the mutation is *caught* if a test fails, *survived* if every test passes.

    python tests/mutations.py                 # every mutation: about 1-2 minutes each on 2 cores
    python tests/mutations.py --only zero     # those whose file or claim names "zero"
    python tests/mutations.py --list          # the mutations, without running anything

Not part of the suite (it runs the suite once per mutation): run it after changing a test or a claim, and add a
mutation for each new claim. A survived mutation is a claim no quick test checks.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (file, the text as it is, what it becomes, the behaviour that breaks); the text must occur in the file exactly once,
# and a mutation keeps the file's line count (docs/template.md's copy table counts lines: a test would fail on that)
MUTATIONS = [
    ("distributed.py", "    if not args.no_sync_bn:", "    if False:",
     "SyncBatchNorm never used: BatchNorm statistics per rank, not over the global batch"),
    ("distributed_mp.py", "sampler=range(env.rank, len(test_set), env.world_size)",
     "sampler=torch.utils.data.DistributedSampler(test_set, env.world_size, env.rank, shuffle=False)",
     "the test shards padded as DistributedSampler pads them: some test images counted twice"),
    ("distributed_zero.py", "optimizer_class=torch.optim.SGD, lr=args.lr,",
     "optimizer_class=torch.optim.SGD, lr=args.lr / env.world_size,", "ZeRO-1's rate divided by the world size"),
    ("distributed_apex.py", "        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):",
     "        with torch.autocast(device.type, dtype=amp_dtype, enabled=False):",
     "mixed precision's training forward never under autocast"),
    ("distributed_apex.py", "        scaler.update()", "        None",
     "the GradScaler's scale never lowered after an overflow"),
    ("distributed_apex.py", "sampler=range(env.rank, len(test_set), env.world_size),\n",
     "sampler=range(0, len(test_set), env.world_size),\n", "every rank evaluates rank 0's shard of the test set"),
    ("distributed_gradient_accumulation.py", "loss = criterion(model(x), y) / accu_steps",
     "loss = criterion(model(x), y)", "each micro-batch's loss not divided by their number: k times the gradient"),
    ("distributed_fsdp.py", "    if not args.no_sync_bn:", "    if False:",
     "FSDP's BatchNorm statistics per rank, not over the global batch"),
    ("dataparallel.py", "sampler.set_epoch(epoch, skip=start_step * batch)",
     "sampler.set_epoch(0, skip=start_step * batch)", "every epoch in the first epoch's order"),
    ("distributed_live_recovery.py", "sampler=range(env.rank, len(test_set), env.world_size)",
     "sampler=torch.utils.data.DistributedSampler(test_set, env.world_size, env.rank, shuffle=False)",
     "live recovery's test shards padded: some test images counted twice"),
    ("utils/live_recovery.py", "float(age) * _SECONDS[unit] <= seen_within_s)}", "True)}",
     "a group that stopped a moment ago counted as back: a resumed group stops waiting and may train alone"),
    ("distributed.py", "    train_loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True",
     "    train_loader = DataLoader(train_set, batch_size=batch, shuffle=False, drop_last=True",
     "no DistributedSampler: every rank trains on the same images"),
    ("distributed_pipeline.py", "loss = torch.stack(losses).mean()", "loss = torch.stack(losses).sum()",
     "the pipeline's loss the sum of its micro-batches' losses, not their mean"),
    ("distributed_pipeline.py", "    mine = blocks[stage * len(blocks) // stages:",
     "    mine = blocks[max(stage * len(blocks) // stages - 1, 0):", "a residual block held (and run) by two stages"),
    ("utils/pipelining.py", "totals += metrics.counts(logits[:real], targets)",
     "totals += metrics.counts(logits, padded[1])", "the pipeline's evaluation counts the padding of a short batch"),
    ("distributed_pipeline.py", "            dist.all_reduce(grad_norm, group=grid.pipeline)", "            pass",
     "--clip-grad-norm: each stage clips by its own layers' norm, not the whole model's"),
    ("utils/precision.py", "    scaler.unscale_(optimizer)\n", "    None\n",
     "--clip-grad-norm under float16: the scaled gradients clipped, not the true ones"),
    ("distributed_fsdp.py",
     "        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None",
     "        grad_norm = nn.utils.clip_grad_norm_([p.grad.to_local() for p in model.parameters()], max_norm) "
     "if max_norm else None", "--clip-grad-norm under FSDP: each rank clips its shard by the shard's own norm"),
    ("utils/data.py", "        super().set_epoch(epoch)", "        super().set_epoch(0)",
     "the sampler's set_epoch ignored: every epoch the same order"),
    ("utils/metrics.py", "collectives.all_reduce_sum(totals)", "totals",
     "evaluation's counts not summed over the ranks: rank 0's shard reported as the test set"),
    ("utils/syncbn.py", "unbiased = var * (count / (count - 1).clamp_min(1))", "unbiased = var",
     "CpuSyncBatchNorm's running variance biased"),
    ("distributed_gradient_accumulation.py", "bucket_cap_mb=args.bucket_cap_mb,", "bucket_cap_mb=None,",
     "--bucket-cap-mb ignored: 3 gradient all-reduces an optimizer step, not 1"),
    ("distributed_diloco.py", "        buffer.copy_(mean.view_as(buffer))", "        None",
     "DiLoCo's BatchNorm statistics not averaged at a round: the round's start keeps rank 0's"),
    ("distributed_diloco.py", "nesterov=args.outer_momentum > 0)", "nesterov=False)",
     "DiLoCo's outer SGD with classical momentum, not Nesterov's"),
    ("distributed_diloco.py", "[(start - now).flatten() for start, now in", "[now.flatten() for start, now in",
     "DiLoCo all-reduces the weights, not the pseudo-gradients (round's start - weights now)"),
    ("utils/errors.py", 'and not (_ranks_met or (dist.is_available() and dist.is_initialized())):', ':',
     "an error after the ranks met: the ranks but local rank 0 still wait 30 s to exit"),
]


def copy_tree(into: Path) -> Path:
    """The files git tracks (and those it would track: not ignored), copied into `into`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def quick_subset(tree: Path, timeout: int) -> tuple[str, float, str]:
    """(outcome, seconds, the first failed test) of the quick subset in `tree`, stopping at the first failure."""
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "--maxfail=1",
                                 "-p", "no:cacheprovider", "--cpu-report="], cwd=tree, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error (timed out)", time.monotonic() - started, ""
    seconds = time.monotonic() - started
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", result.stdout, flags=re.MULTILINE)
    if result.returncode == 0:
        return "survived", seconds, ""
    if failed:  # exit status 1, or 2 where xdist stopped the run at the first failure
        return "caught", seconds, failed[0]
    return f"error (pytest exit {result.returncode})", seconds, result.stdout[-500:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/mutations.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", metavar="WORD", help="only the mutations whose file or behaviour contains WORD")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one run of the quick subset")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only in m[0] or args.only in m[3]]
    if not chosen:
        parser.error(f"no mutation's file or behaviour contains {args.only!r}")
    for file, before, _, _ in chosen:
        count = (ROOT / file).read_text().count(before)
        if count != 1:
            parser.error(f"{file}: the mutated text occurs {count} times, not once: {before.strip()!r}")
    if args.list:
        for file, before, after, claim in chosen:
            print(f"{file}: {claim}\n    - {before.strip()}\n    + {after.strip()}")
        return 0
    caught = 0
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        tree = copy_tree(Path(scratch))
        for i, (file, before, after, claim) in enumerate(chosen, 1):
            original = (tree / file).read_text()
            (tree / file).write_text(original.replace(before, after))
            try:
                outcome, seconds, where = quick_subset(tree, args.timeout)
            finally:
                (tree / file).write_text(original)
            caught += outcome == "caught"
            print(f"[{i}/{len(chosen)}] {outcome:9s} {file}: {claim} ({seconds:.0f} s{'; ' + where if where else ''})",
                  flush=True)
    print(f"{caught} of {len(chosen)} caught by the quick subset")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
