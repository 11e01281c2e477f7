"""Each script's own lines under test: every script, started as torchrun starts it (tests/distributed_helpers.py's
script_on_ranks: its ranks forked from a server that imported torch once), trains on the same global batches the
weights, BatchNorm statistics and momentum that one process of distributed.py trains, and counts every test image
once. What runs is the script itself: its flags, SyncBatchNorm conversion, DDP (or ZeRO-1, FSDP, DataParallel) wrap,
sampler, DataLoaders, optimizer and schedule, safety net and checkpoint; only its model computes in float64 on 8x8
averages of the images (float32 cannot compare world sizes: two summation orders drift apart chaotically within a
few steps, in float64 they stay within 1e-7 here), and for accumulation has GroupNorm for BatchNorm (whose statistics
per micro-batch differ from the whole batch's by design). Live recovery's replica groups (each group its ranks' own
process group, a torchft lighthouse of the run's own) are forked alike, each group as its own torchrun would start it;
two groups of one rank normalise each its own share, as DDP without SyncBatchNorm: the weights and momentum of that.

2 epochs of one step of a global batch of 12 (momentum and the cosine schedule both act on the second), 23 test images
(no world size of 2 or 3 divides them: a padded shard would count one twice).
"""
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed_helpers import script_on_ranks

from examples import own_lighthouse
from safety_net.sharded_checkpoint import to_single_file

TEST_IMAGES = 23
ARGS = ["--device", "cpu", "--dataset", "synthetic", "--train-samples", "12", "--test-samples", str(TEST_IMAGES),
        "--batch-size", "12", "--epochs", "2", "--lr", "0.1", "--workers", "0", "--print-freq", "100"]
LIVE_RECOVERY = "distributed_live_recovery.py"
CLIP = ["--clip-grad-norm", "0.1"]  # below every step's norm here (about 1 to 30): every step is clipped
RUNS = {  # name: script, world size, model (distributed_helpers.MODELS), its own flags
    "one process": ("distributed.py", 1, "float64", []),
    "distributed.py on 3 ranks": ("distributed.py", 3, "float64", []),
    # the same with --clip-grad-norm: each script's clipping where its strategy needs it (after the average; after
    # the last micro-batch; the unscaled gradients; the norm over FSDP's shards, over the pipeline's stages)
    "one process, clipped": ("distributed.py", 1, "float64", CLIP),
    "distributed_mp.py on 2 ranks": ("distributed_mp.py", 2, "float64", CLIP),
    "distributed_apex.py on 2 ranks": ("distributed_apex.py", 2, "float64", ["--opt-level", "O0", *CLIP]),
    # one epoch, against the reference's first (checkpoint.1.pt): each checkpoint of ZeRO-1 gathers the optimizer
    # state on rank 0 first, 3 s here
    "distributed_zero.py on 2 ranks": ("distributed_zero.py", 2, "float64", ["--epochs", "1", *CLIP]),
    "distributed_fsdp.py on 2 ranks": ("distributed_fsdp.py", 2, "float64", ["--opt-level", "O0", *CLIP]),
    "dataparallel.py": ("dataparallel.py", 1, "float64", CLIP),
    "accumulation of 2 on 2 ranks": ("distributed_gradient_accumulation.py", 2, "float64-groupnorm",
                                     ["--grad-accu-steps", "2", *CLIP]),
    "no accumulation in one process": ("distributed_gradient_accumulation.py", 1, "float64-groupnorm",
                                       ["--grad-accu-steps", "1", *CLIP]),
    # the pipeline: its micro-batches against one process accumulating the same ones (BatchNorm per micro-batch)
    "pipeline, 1F1B on 2 stages": ("distributed_pipeline.py", 2, "float64", ["--microbatches", "4", *CLIP]),
    "pipeline, GPipe on 3 stages": ("distributed_pipeline.py", 3, "float64", ["--microbatches", "4", "--schedule",
                                                                              "gpipe", *CLIP]),
    "4 micro-batches in one process": ("distributed_gradient_accumulation.py", 1, "float64",
                                       ["--grad-accu-steps", "4", *CLIP]),
    # 2 replicas of a 2-stage pipeline against DDP on 2 ranks accumulating the same micro-batches, BatchNorm per rank
    "pipeline, 2 replicas of 2 stages": ("distributed_pipeline.py", 4, "float64", ["--microbatches", "2", "--replicas",
                                                                                 "2", *CLIP]),
    "2 micro-batches on 2 ranks": ("distributed_gradient_accumulation.py", 2, "float64",
                                   ["--grad-accu-steps", "2", "--no-sync-bn", *CLIP]),
    # live recovery (torchft): each replica group a torchrun of its own (its own process group), a lighthouse of the
    # run's own, and a quorum of every group at each step. One group of 2 ranks: SyncBatchNorm over the global batch,
    # one process's weights. Two groups of one rank: each group normalises its own share (SyncBatchNorm syncs a
    # group's ranks, not the groups), as DDP without SyncBatchNorm does, and their running statistics are averaged
    "live recovery, 1 group of 2 ranks": (LIVE_RECOVERY, 2, "float64", ["--replica-groups", "1", *CLIP]),
    "live recovery, 2 groups of 1 rank": (LIVE_RECOVERY, 1, "float64", ["--replica-groups", "2", *CLIP]),
    "distributed.py on 2 ranks, no SyncBatchNorm": ("distributed.py", 2, "float64", ["--no-sync-bn", *CLIP]),
    # float16 is slow on a CPU: batches of 4, 3 steps an epoch (the first overflow: the scale comes down), 5 test images
    "float16": ("distributed_apex.py", 1, "float32-8x8", ["--amp-dtype", "float16", "--batch-size", "4",
                                                          "--test-samples", "5", *CLIP]),
}
SAME_AS_ONE_PROCESS = [name for name, (script, _, model, flags) in RUNS.items() if model == "float64" and not (
    name == "one process" or script == "distributed_pipeline.py" or "--grad-accu-steps" in flags
    or "--no-sync-bn" in flags or name == "live recovery, 2 groups of 1 rank")]  # the last two: BatchNorm per share
# 6 processes, 3 more stages, live recovery (its lighthouse, 2 runs of 2 processes, and their reference), and the two
# scripts whose training lines are distributed.py's under another launcher or flag (spawn's, --opt-level O0): in the
# full suite only, so that the quick subset stays under 2 minutes
SLOW = {"pipeline, 2 replicas of 2 stages", "2 micro-batches on 2 ranks", "pipeline, GPipe on 3 stages",
        "live recovery, 1 group of 2 ranks", "live recovery, 2 groups of 1 rank",
        "distributed.py on 2 ranks, no SyncBatchNorm", "distributed_mp.py on 2 ranks", "distributed_apex.py on 2 ranks"}
# float64 in two summation orders (world sizes) after 4 steps: about 1e-7 apart at most here; a changed line (no
# SyncBatchNorm, another rate, a sample counted twice) moves them by 1e-3 or more
RTOL, ATOL = 1e-6, 1e-9


@pytest.fixture(scope="module")
def run(module_dir):
    """run(name): the folder of RUNS[name], made once for the module (in order of asking)."""
    out = module_dir("scripts-equal")

    @functools.cache
    def made(name: str) -> Path:
        script, world_size, model, flags = RUNS[name]
        folder = out / name.replace(" ", "-")
        argv, ranks = ARGS + flags + ["--output-dir", str(folder)], out / f"{name.replace(' ', '-')}-ranks"
        if script != LIVE_RECOVERY:
            statuses = script_on_ranks(world_size, script, argv, ranks, model)
            assert statuses == [0] * world_size, f"{name}: exit statuses {statuses}"
            return folder
        pytest.importorskip("torchft")
        groups = last("--replica-groups", name)
        # no quorum, so no step, without every group (and no commit either): each step is all groups' average
        with own_lighthouse.on_a_free_port(min_replicas=groups) as lighthouse:
            statuses = script_on_ranks(world_size, script, argv + ["--lighthouse", lighthouse, "--min-replica-groups",
                                                                   str(groups)], ranks, model, replica_groups=groups)
        assert statuses == [0] * (world_size * groups), f"{name}: exit statuses {statuses}"
        return folder / "replica_group_0"  # group 0's checkpoints and metrics.jsonl; each other group's beside it
    return made


def last(flag: str, name: str) -> int:
    """The value of the last `flag` on the command line of RUNS[name], as argparse reads it."""
    flags = ARGS + RUNS[name][3]
    return int(flags[len(flags) - flags[::-1].index(flag)])


def saved(folder: Path) -> dict:
    """The run's checkpoint: checkpoint.pt, or FSDP's sharded one as one file (its own converter)."""
    if (folder / "checkpoint.dcp").is_dir():
        return to_single_file(str(folder / "checkpoint.dcp"), str(folder / "converted.pt"))
    return torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's: in the state_dict, not parameters


def momentum_by_name(checkpoint: dict, name: str) -> dict[str, torch.Tensor]:
    """Each parameter's momentum buffer in a run's checkpoint, by parameter name, from any of the forms the scripts
    save: torch's optimizer state_dict keyed by index (model.parameters()'s order: the model's state_dict keys less
    BatchNorm's buffers), one keyed by name (FSDP's, converted), or the pipeline's flat "state.<name>.momentum_buffer".
    A form not read here, or a parameter without its momentum, fails the test."""
    parameters = [key for key in checkpoint["model"] if not key.endswith(BUFFERS)]
    optimizer = checkpoint["optimizer"]
    state = optimizer.get("state")
    if any(key.startswith("state.") for key in optimizer):  # the pipeline's: one flat dict
        found = {key[len("state."):-len(".momentum_buffer")]: value for key, value in optimizer.items()
                 if key.startswith("state.") and key.endswith(".momentum_buffer")}
    elif isinstance(state, dict) and state and all(isinstance(key, int) for key in state):  # torch's, by index
        indices = [index for group in optimizer["param_groups"] for index in group["params"]]
        assert indices == list(range(len(parameters))), f"{name}: parameter indices {indices} for {len(parameters)}"
        found = {parameters[index]: entry.get("momentum_buffer") for index, entry in state.items()}
    elif isinstance(state, dict) and state and all(isinstance(key, str) for key in state):  # by name
        found = {key: entry.get("momentum_buffer") for key, entry in state.items()}
    else:
        pytest.fail(f"{name}: an optimizer state of no form read here: {sorted(map(str, optimizer))[:5]}")
    missing, extra = sorted(set(parameters) - set(found)), sorted(set(found) - set(parameters))
    assert not missing and not extra, f"{name}: momentum missing for {missing[:5]}, for no parameter: {extra[:5]}"
    without = [key for key, value in found.items() if not isinstance(value, torch.Tensor)]
    assert not without, f"{name}: no momentum buffer for {without[:5]}"
    return found


def assert_same_training(got: dict, expected: dict, name: str) -> None:
    """Weights and BatchNorm buffers equal, and every parameter's momentum (read by name from either's form)."""
    assert got["model"].keys() == expected["model"].keys(), name
    for key, value in expected["model"].items():
        torch.testing.assert_close(got["model"][key], value, rtol=RTOL, atol=ATOL, msg=f"{name}: {key}")
    momentum = momentum_by_name(got, name)
    for key, value in momentum_by_name(expected, f"{name}'s reference").items():
        torch.testing.assert_close(momentum[key], value, rtol=RTOL, atol=ATOL, msg=f"{name}: momentum of {key}")


def without_running_statistics(state: dict) -> dict:
    """The checkpoint less BatchNorm's running statistics (its count of batches kept)."""
    return {**state, "model": {key: value for key, value in state["model"].items()
                               if not key.endswith(("running_mean", "running_var"))}}


def test_the_reference_trained_every_step(run):
    """The one-process run moved its weights (a step of rate 0.1, then one of 0.05: the cosine's second epoch), so the
    comparisons below can fail."""
    one = saved(run("one process"))
    assert (one["epoch"], one["world_size"]) == (2, 1)
    assert [m["lr"] for m in metrics(run("one process"))] == [0.1, pytest.approx(0.05)]
    assert moved(run("one process")) > 1e-3


def moved(folder: Path) -> float:
    """How far the second epoch moved conv1's weights: from the checkpoint it kept of the first (checkpoint.1.pt)."""
    first, last = (torch.load(folder / name, weights_only=True) for name in ("checkpoint.1.pt", "checkpoint.pt"))
    return float((first["model"]["conv1.weight"] - last["model"]["conv1.weight"]).abs().max())


def slow_marked(names) -> list:
    """pytest.param of each of names, those in SLOW marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in names]


@pytest.mark.parametrize("name", slow_marked(SAME_AS_ONE_PROCESS))
def test_each_script_trains_the_weights_of_one_process(name, run):
    """DDP with SyncBatchNorm on 3 ranks and launched by spawn's worker on 2, mixed precision's script in float32,
    ZeRO-1, FSDP, DataParallel and live recovery's one replica group of 2 ranks: each the weights, BatchNorm
    statistics, momentum and losses of one process (with --clip-grad-norm: of one process clipped, and the same norm
    before clipping: FSDP's over its shards)."""
    one = run("one process, clipped" if "--clip-grad-norm" in RUNS[name][3] else "one process")
    epochs = metrics(run(name))
    expected = saved(one) if len(epochs) == 2 else torch.load(one / "checkpoint.1.pt", weights_only=True)
    assert_same_training(saved(run(name)), expected, name)
    for epoch, expected in zip(epochs, metrics(one), strict=False):
        for key in ("train_loss", "test_loss", "top1", "top5", "lr", "grad_norm"):
            want = expected.get(key)
            assert epoch.get(key) == (want if want is None else pytest.approx(want, rel=RTOL)), (name, key, epoch)


def test_every_step_was_clipped_and_the_norms_are_logged(run):
    """--clip-grad-norm 0.1 clipped every step of the runs above (its norm before, the epoch's one step, logged by
    rank 0 in metrics.jsonl, is above 0.1), and a run without it logs no norm: the same weights as before the flag."""
    for name, (_, _, model, flags) in RUNS.items():
        if name in SLOW:
            continue
        norms = [epoch.get("grad_norm") for epoch in metrics(run(name))]
        if "--clip-grad-norm" not in flags:
            assert norms == [None] * len(norms), name
        elif model.startswith("float64"):
            assert all(norm > 0.1 for norm in norms), (name, norms)


@pytest.mark.parametrize("name", slow_marked(RUNS))
def test_each_script_evaluates_every_test_image_once(name, run):
    """At 1, 2 and 3 ranks, each script's own test loader (and FSDP's padded shard) counts each of the 23 test
    images once, every epoch."""
    assert [epoch["samples"] for epoch in metrics(run(name))] == [last("--test-samples", name)] * last("--epochs", name)


def test_accumulating_two_micro_batches_on_two_ranks_equals_the_whole_batch_in_one_process(run):
    """distributed_gradient_accumulation.py: each rank's 6 images in 2 micro-batches of 3 under no_sync, on 2 ranks,
    train the weights of the whole batch of 12 at once in one process (GroupNorm: no batch statistics), and log the
    same losses (every micro-batch's)."""
    accumulated, whole = run("accumulation of 2 on 2 ranks"), run("no accumulation in one process")
    assert_same_training(saved(accumulated), saved(whole), "accumulation")
    for epoch, expected in zip(metrics(accumulated), metrics(whole), strict=True):
        for key in ("train_loss", "grad_norm"):  # clipped after the last micro-batch: the whole batch's norm
            assert epoch[key] == pytest.approx(expected[key], rel=RTOL), (key, epoch, expected)


def test_mixed_precision_runs_autocast_and_scales_the_loss_as_the_script_builds_them(run):
    """distributed_apex.py --amp-dtype float16, its model in float32: the convolutions computed in float16 in
    training and evaluation (autocast), and the GradScaler's scale came down from 65536 (its update() after a step
    whose scaled gradients overflowed, a step it skipped: the first steps of this model do), while the run stayed
    finite and trained on."""
    folder = run("float16")
    seen = (folder.parent / "float16-ranks" / "seen-0").read_text()
    assert seen == "eval float16 train float16", seen
    state = saved(folder)
    assert state["resolved"]["precision"] == "float16" and state["resolved"]["loss_scaling"], state["resolved"]
    assert state["scaler"]["scale"] < 65536.0, state["scaler"]
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert moved(folder) > 1e-4  # a step of the second epoch was taken, unscaled
    # --clip-grad-norm on the unscaled gradients: their norm (about 1 to 30 here), not the scaled one (x 4096 and more)
    norms = [epoch["grad_norm"] for epoch in metrics(folder) if epoch["grad_norm"] is not None]  # None: all skipped
    assert norms and all(0.1 < norm < 1000 for norm in norms), norms


@pytest.mark.parametrize("name", ["pipeline, 1F1B on 2 stages",
                                  pytest.param("pipeline, GPipe on 3 stages", marks=pytest.mark.slow)])
def test_a_pipeline_trains_the_weights_of_one_process_accumulating_its_micro_batches(name, run):
    """distributed_pipeline.py, each stage on its own rank holding its own layers: the weights, BatchNorm statistics
    and losses of distributed_gradient_accumulation.py in one process cutting each batch into the same 4
    micro-batches (BatchNorm normalises each micro-batch alone, in both). Its checkpoint, written a stage a rank,
    holds the whole model under distributed.py's names."""
    pipeline, reference = saved(run(name)), saved(run("4 micro-batches in one process"))
    assert_same_training(pipeline, reference, name)  # momentum: by name here, by index there
    for epoch, expected in zip(metrics(run(name)), metrics(run("4 micro-batches in one process")), strict=True):
        for key in ("train_loss", "test_loss", "top1", "lr", "grad_norm"):  # the norm over all stages: the model's
            assert epoch[key] == pytest.approx(expected[key], rel=RTOL), (name, key, epoch, expected)


@pytest.mark.slow  # 5 processes: the quick subset keeps 1F1B on 2 stages
@pytest.mark.parametrize("name, stages", [("pipeline, 1F1B on 2 stages", 3), ("pipeline, GPipe on 3 stages", 2)])
def test_a_pipeline_resumed_at_another_stage_count_ends_on_the_weights_of_a_run_never_stopped(name, stages, run,
                                                                                              tmp_path):
    """The run's checkpoint after its first epoch (each stage wrote its layers' part), continued by the same command
    on another number of stages (each reads the layers it now holds, optimizer state included): the weights,
    BatchNorm statistics and momentum the run reached without stopping. Its second step is then 1F1B's on 3 stages,
    or GPipe's on 2: with the whole runs above, each schedule at 2 and at 3 stages equals one process accumulating."""
    never_stopped = run(name)
    shutil.copytree(never_stopped / "checkpoint.1.dcp", tmp_path / "run" / "checkpoint.dcp")
    _, _, model, flags = RUNS[name]
    statuses = script_on_ranks(stages, "distributed_pipeline.py",
                               ARGS + flags + ["--output-dir", str(tmp_path / "run")], tmp_path / "ranks", model)
    assert statuses == [0] * stages
    resumed = saved(tmp_path / "run")
    assert (resumed["epoch"], resumed["world_size"]) == (2, stages)
    assert_same_training(resumed, saved(never_stopped), f"resumed on {stages} stages")  # every parameter's momentum


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_pipeline_train_the_weights_of_ddp_accumulating_their_micro_batches(run):
    """--replicas 2 on 4 ranks (a 2 x 2 mesh): each copy of the pipeline trains on its share of every batch (the
    sampler deals them to the copies as to DDP's ranks), each stage's gradients averaged over the copies, and the
    clipping norm summed over one copy's stages: the weights, momentum, norms and losses of
    distributed_gradient_accumulation.py on 2 ranks cutting their shares into the same micro-batches (BatchNorm per
    rank and micro-batch, rank 0's statistics kept)."""
    pipeline, reference = saved(run("pipeline, 2 replicas of 2 stages")), saved(run("2 micro-batches on 2 ranks"))
    assert_same_training(pipeline, reference, "2 x 2")
    two_by_two, ddp = metrics(run("pipeline, 2 replicas of 2 stages")), metrics(run("2 micro-batches on 2 ranks"))
    for epoch, expected in zip(two_by_two, ddp, strict=True):
        # not the test loss: DDP's ranks each evaluate with their own BatchNorm statistics (rank 0's, plus their
        # last micro-batch's update), the pipeline's copies with the first copy's
        for key in ("train_loss", "lr", "grad_norm", "samples"):
            assert epoch[key] == pytest.approx(expected[key], rel=RTOL), (key, epoch, expected)


@pytest.mark.slow
def test_two_live_recovery_replica_groups_train_the_weights_of_ddp_without_syncbatchnorm(run):
    """distributed_live_recovery.py, 2 replica groups of one rank each, both in every step's quorum: the gradients
    averaged over the groups by torchft's manager, each group's BatchNorm normalising its own share of the batch. Each
    group ends on the weights, momentum, clipping norms and step count of distributed.py on 2 ranks without
    SyncBatchNorm (the same shares: the deal of the sampler over all groups' processes), its train loss the mean of
    the groups'; and the groups end bit for bit alike, BatchNorm's running statistics included: each group's, averaged
    over the groups after the epoch's last step (DDP keeps rank 0's: those are not compared), so both evaluate one
    model on all 23 test images."""
    name, ddp = "live recovery, 2 groups of 1 rank", "distributed.py on 2 ranks, no SyncBatchNorm"
    groups = [run(name), run(name).parent / "replica_group_1"]
    first, second = (saved(folder) for folder in groups)
    assert_same_training(without_running_statistics(first), without_running_statistics(saved(run(ddp))), name)
    for state in (first, second):  # every step committed, by both groups
        assert state["manager"] == {"step": 2, "batches_committed": 4, "groups": 2}, state["manager"]
    assert second["model"].keys() == first["model"].keys()
    differing = [key for key, value in second["model"].items() if not torch.equal(value, first["model"][key])]
    assert not differing, f"replica group 1 differs from group 0 in {differing[:5]}"
    group_1, group_0 = momentum_by_name(second, "group 1"), momentum_by_name(first, "group 0")
    assert all(torch.equal(group_1[key], value) for key, value in group_0.items()), "group 1's momentum differs"
    for epoch, expected in zip(zip(*map(metrics, groups), strict=True), metrics(run(ddp)), strict=True):
        assert sum(e["train_loss"] for e in epoch) / 2 == pytest.approx(expected["train_loss"], rel=RTOL), epoch
        for key in ("lr", "grad_norm"):
            assert [e[key] for e in epoch] == [pytest.approx(expected[key], rel=RTOL)] * 2, (key, epoch, expected)
        assert [(e["samples"], e["test_loss"]) for e in epoch] == [(TEST_IMAGES, epoch[0]["test_loss"])] * 2, epoch
