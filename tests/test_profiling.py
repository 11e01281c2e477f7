"""--profile-steps (safety_net/profiling.py) and the picture of its traces (tools/timeline.py): every rank's
trace holds its strategy's collectives where they belong, the picture renders, bad values are one line, and a run
without the flag records nothing."""
import json
from types import SimpleNamespace

import pytest
import torch
from script_runs import TINY, check, launcher, run, run_main, stop_handlers_undone
from test_bad_input import assert_one_line_error

from tools import timeline

RUN_TIMEOUT = 180  # one tiny run of 3 steps on 2 ranks: 15-25 s on 2 cores


@pytest.mark.parametrize("value", ["0", "-2"])
def test_steps_not_positive_are_one_line(value, tmp_path, capsys):
    import distributed
    result = run_main(distributed.main, TINY + ["--profile-steps", value, "--output-dir", str(tmp_path)], capsys)
    assert_one_line_error(result, "--profile-steps")


@pytest.mark.parametrize("module", ["distributed", "distributed_mp"])  # before torchrun's ranks, and before spawn
def test_a_profile_folder_that_cannot_be_written_is_one_line(module, tmp_path, capsys):
    import importlib
    (tmp_path / "profile").write_text("mine\n")
    result = run_main(importlib.import_module(module).main,
                      TINY + ["--profile-steps", "1", "--output-dir", str(tmp_path)], capsys)
    assert_one_line_error(result, "profile is a file, not a directory")
    assert (tmp_path / "profile").read_text() == "mine\n"


def test_more_steps_than_the_run_has_is_one_line(tmp_path):
    """TINY trains 3 steps; 2 recorded need 4 with the warm-up: the run says so before its first step."""
    result = run(launcher("python", "distributed.py") + TINY + ["--profile-steps", "2", "--output-dir", str(tmp_path)],
                 timeout=120)
    assert_one_line_error(result, "--profile-steps 2 needs 4 steps")
    assert not (tmp_path / "profile").exists() and not (tmp_path / "checkpoint.pt").exists()


def test_without_the_flag_the_net_makes_no_profiler(tmp_path):
    import distributed
    from safety_net import SafetyNet
    args = distributed.parse_args(TINY + ["--output-dir", str(tmp_path)])
    with stop_handlers_undone():
        safety = SafetyNet.for_flags(args, distributed.__file__)
        with safety.running(SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"), is_main=True)):
            pass
    assert args.profile_steps is None and safety.profiler is None


def made_up_trace(rank: int, world_size: int = 2) -> dict:
    """A trace as torch.profiler writes one (µs): a step with a forward that waits 9 µs for a SyncBatchNorm-like
    all-reduce, a backward that starts a gradient all-reduce which runs on into the optimizer's step."""
    def event(name, ts, dur, tid=1, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [event("ProfilerStep#2", 0, 100, cat="user_annotation"),
              event("DistributedDataParallel.forward", 0, 40, cat="user_annotation"),
              event("aten::conv2d", 0, 20), event("c10d::allreduce_", 20, 1, **{"Input Dims": [[[10]]]}),
              event("aten::batch_norm", 30, 10),
              event("autograd::engine::evaluate_function: ConvolutionBackward0", 50, 30),
              event("aten::mm", 50, 10), event("c10d::_reduce_scatter_base_", 60, 1, **{"Input Dims": [[500], [1000]]}),
              event("aten::mm", 61, 19),
              event("Optimizer.step#SGD.step", 85, 10, cat="user_annotation"), event("aten::add_", 85, 10),
              event("gloo:all_reduce", 21, 9, tid=7, cat="user_annotation", **{"Input Dims": [[10]],
                                                                               "Input type": ["double"]}),
              event("gloo:all_reduce", 61, 29, tid=7, cat="user_annotation", **{"Input Dims": [[1000]],
                                                                                "Input type": ["float"]})]
    return {"distributedInfo": {"rank": rank, "world_size": world_size}, "traceEvents": events}


def test_timeline_reads_compute_collectives_and_their_overlap(tmp_path, capsys):
    lane = timeline.read_lane("rank 0", made_up_trace(0))
    assert lane.compute == {"forward": [(0.0, 0.02), (0.03, 0.04)], "backward": [(0.05, 0.06), (0.061, 0.08)],
                            "optimizer": [(0.085, 0.095)]}  # the wait for the all-reduce is no compute (ms)
    (sync, grads) = lane.collectives
    assert (sync.asked, sync.ran, sync.size) == ("all_reduce", "all_reduce", 80)
    assert (grads.asked, grads.ran, grads.size) == ("reduce_scatter", "all_reduce", 4000)  # gloo's way
    total, (share,) = timeline.overlap([lane])
    assert total == share == pytest.approx((19 + 5) / (9 + 29))  # backward 61-80 and the step 85-90 µs

    folder = tmp_path / "profile"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank{rank}.json").write_text(json.dumps(made_up_trace(rank)))
    (folder / "rank2.json").write_text(json.dumps(made_up_trace(2, world_size=3)))  # an earlier run's: left out
    timeline.main([str(tmp_path)])
    assert capsys.readouterr().out.startswith("communication overlapping compute: 63% (rank 0 63%, rank 1 63%)")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pipelines_idle_share_is_the_time_each_stage_runs_none_of_its_own_work_in_the_schedules_span():
    """GPipe of 2 micro-batches on 2 stages drawn as the theory has it (each forward or backward a slot of 10 ms, no
    time to send): each stage idles 2 slots of 6, (S-1)/(M+S-1) = 1/3. Its optimizer step and the next step's work
    are not its own forward or backward of the step."""
    first = timeline.Lane("rank 0", steps=[(0, 70, "step 1"), (70, 80, "step 2")],
                          compute={"forward": [(0, 20), (71, 72)], "backward": [(40, 60)], "optimizer": [(60, 70)]})
    last = timeline.Lane("rank 1", steps=[(0, 70, "step 1"), (70, 80, "step 2")],
                         compute={"forward": [(10, 30), (72, 73)], "backward": [(30, 50)], "optimizer": [(50, 55)]})
    (step1, step2) = timeline.pipeline_idle([first, last])
    assert step1 == [pytest.approx(1 / 3), pytest.approx(1 / 3)]  # the span: 0 to 60
    assert step2 == [pytest.approx(1 / 2), pytest.approx(1 / 2)]  # 71 to 73, each busy for 1
    assert timeline.idle_text([first, last]) == "idle in the schedule's span (the bubble): rank 0 42%, rank 1 42%"


@pytest.mark.parametrize(("flags", "says"), [(["--microbatches", "2,x"], "comma-separated integers"),
                                            (["--stages", "9"], "9 stages but ResNet-18 splits into at most 8"),
                                            (["--stages", "1"], "--stages 1: a pipeline has 2 stages or more"),
                                            (["--stages", "4", "--microbatches", "2"],
                                             "--microbatches 2 is fewer than the 4 stages"),
                                            (["--microbatches", "3"], "--batch-size 64 does not divide into "
                                                                      "--microbatches 3"),
                                            (["--schedules", "zb"], "--schedules zb: choose from 1f1b, gpipe")])
def test_the_bubble_benchmarks_bad_values_are_one_line_before_any_run(flags, says, tmp_path, capsys):
    from benchmarks import bubble
    result = run_main(bubble.main, flags + ["--output-dir", str(tmp_path / "out")], capsys)
    assert_one_line_error(result, says)
    assert not (tmp_path / "out").exists()


def test_timeline_of_a_folder_without_traces_is_one_line(tmp_path, capsys):
    result = run_main(timeline.main, [str(tmp_path)], capsys)
    assert_one_line_error(result, "holds no profile/rank0.json")


@pytest.mark.slow  # the full suite's shared run (test_end_to_end.py's): in the quick subset this test alone made it
def test_a_run_without_the_flag_records_nothing(runs):
    out = runs("one-process", "python", "distributed.py")  # test_end_to_end.py's run, made once for all workers
    assert not (out / "profile").exists()


def profiled_run(tmp_path, kind: str, script: str, *flags: str):
    """TINY (3 steps) with the last one recorded on each of 2 ranks; returns the run's stdout and its lanes."""
    result = check(run(launcher(kind, script) + TINY + list(flags) + ["--profile-steps", "1", "--output-dir",
                                                                     str(tmp_path)], timeout=RUN_TIMEOUT))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    return result.stdout, timeline.read_run(tmp_path)


def gradient_reductions(lane) -> list:
    """The collectives of whole gradient buckets or units (MBs), not SyncBatchNorm's or the stop flag's (KBs)."""
    return [c for c in lane.collectives if c.size >= 2**20]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_all_reduces_during_backward_and_the_picture_renders(tmp_path, capsys):
    stdout, lanes = profiled_run(tmp_path, "torchrun", "distributed.py")
    last = stdout.strip().splitlines()[-1]
    assert f"{tmp_path}/profile/" in last and "ui.perfetto.dev" in last and "chrome://tracing" in last
    for lane in lanes:
        backward = lane.compute["backward"]
        buckets = gradient_reductions(lane)
        assert buckets and all(c.asked == "all_reduce" for c in buckets)
        assert all(backward[0][0] < c.start for c in buckets)  # after backward began
        assert buckets[0].start < backward[-1][1]  # the first bucket's all-reduce starts before backward ends
    timeline.main([str(tmp_path)])
    assert "communication overlapping compute:" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_accumulation_sends_no_gradients_in_the_no_sync_micro_batches(tmp_path):
    """--no-sync-bn: SyncBatchNorm's all-reduces would run in every micro-batch, by design."""
    _, lanes = profiled_run(tmp_path, "spawn", "distributed_gradient_accumulation.py", "--grad-accu-steps", "2",
                            "--no-sync-bn")
    for lane in lanes:
        first_backward = lane.compute["backward"][0][0]  # the first micro-batch's, under no_sync
        second_forward = next(s for s, _ in lane.compute["forward"] if s > first_backward)
        assert not [c for c in lane.collectives if first_backward <= c.start <= second_forward]
        gradients = gradient_reductions(lane)
        assert gradients and all(c.asked == "all_reduce" and c.start > second_forward for c in gradients)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_fsdp_all_gathers_before_forward_and_reduce_scatters_in_backward(tmp_path):
    _, lanes = profiled_run(tmp_path, "torchrun", "distributed_fsdp.py", "--opt-level", "O0")
    for lane in lanes:
        first_backward = lane.compute["backward"][0][0]
        gathers = [c for c in lane.collectives if c.asked == "all_gather"]
        scatters = [c for c in lane.collectives if c.asked == "reduce_scatter"]
        assert any(c.start < first_backward for c in gathers)  # the units' weights, gathered for their forward
        assert len(scatters) >= 5 and all(c.start > first_backward for c in scatters)  # each unit's gradients
