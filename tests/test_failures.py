"""The failure programs (failures/), each run both ways: the broken form shows its symptom within seconds (the
error, the hang cut short and the rank or collective named, or the wrong number next to the right one), the
fixed form ends clean, and no process is left behind. The runs all start in one module fixture, three at a time:
a hang spends its 5 s waiting, while the others use the cores; skipped_collective.py alone runs in its own test,
followed by the reader of the flight recorder's dumps it writes."""
import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
from markers import gpu_test
from script_runs import ROOT, subprocess_env

from examples.local_processes import group_members

FAILURES = ROOT / "failures"
READER = "read_flight_recorder.py"  # the tool that reads the flight recorder's dumps, not a failure
PROGRAMS = sorted(path.name for path in FAILURES.glob("[!_]*.py") if path.name != READER)
RUN_ALONE = {"skipped_collective.py"}  # its own test runs it, then the reader on the files it wrote
RUNS = [  # (program, arguments, extra environment): every program both ways, and the tools that name the cause
    ("eval_on_rank0.py", (), {}), ("eval_on_rank0.py", ("--fixed",), {}),
    ("uneven_inputs.py", (), {}), ("uneven_inputs.py", ("--fixed",), {}),
    ("uneven_inputs.py", ("--fixed", "sampler"), {}),
    ("unused_parameter.py", (), {}), ("unused_parameter.py", (), {"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
    ("unused_parameter.py", ("--fixed",), {}), ("unused_parameter.py", ("--fixed", "static_graph"), {}),
    ("collective_mismatch.py", (), {}), ("collective_mismatch.py", (), {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    ("collective_mismatch.py", ("--fixed",), {}),
    ("one_rank_raises.py", (), {}), ("one_rank_raises.py", ("--fixed",), {}),
    ("set_epoch_forgotten.py", (), {}), ("set_epoch_forgotten.py", ("--fixed",), {}),
    ("padded_test_sampler.py", (), {}), ("padded_test_sampler.py", ("--fixed",), {}),
    ("same_augmentation.py", (), {}), ("same_augmentation.py", ("--fixed",), {}),
    ("gradient_accumulation.py", (), {}), ("gradient_accumulation.py", ("--fixed",), {}),
    ("every_rank_saves.py", (), {}), ("every_rank_saves.py", ("--fixed",), {}),
    ("port_in_use.py", (), {}), ("port_in_use.py", ("--fixed",), {}),
    ("zero_state_dict_on_rank0.py", (), {}), ("zero_state_dict_on_rank0.py", ("--fixed",), {}),
]
# gloo's 5 s timeout in the words of the rank whose own timeout fired first: the other rank may only see the pair
# it shared closed ("Connection closed by peer"), so which of the two appears depends on the race between them
TIMED_OUT = ("Timed out waiting 5000ms", "Application timeout caused pair closure")
LIMIT = 60  # seconds for one run; the slowest takes about 8 (a 5 s timeout and 2.5 s of start)
RUNS_TIMEOUT = 300  # pytest-timeout for a test using the fixture: the first one waits for every run


@dataclass
class Ran:
    returncode: int
    output: str  # stdout and stderr, interleaved as a terminal shows them
    seconds: float
    left: list[int] = field(default_factory=list)  # processes of the run still alive after it ended


def run_program(program: str, args: tuple, env: dict, limit: int = LIMIT) -> Ran:
    """The program as a user runs it, in a session of its own, so that every process it starts can be found."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(FAILURES / program), *args], cwd=ROOT, env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=limit)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(killed after {limit} s)"
    ran = Ran(proc.returncode, output, time.monotonic() - start, group_members(proc.pid))
    for pid in ran.left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return ran


@pytest.fixture(scope="module")
def ran():
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {(program, args, tuple(env.items())): pool.submit(run_program, program, args, env)
                   for program, args, env in RUNS}
        results = {key: future.result() for key, future in futures.items()}

    def get(program: str, *args: str, **env: str) -> Ran:
        return results[(program, args, tuple(env.items()))]

    return get


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_every_program_ran_both_ways_and_left_no_process(ran):
    assert {program for program, _, _ in RUNS} | RUN_ALONE == set(PROGRAMS)
    for program, args, env in RUNS:
        result = ran(program, *args, **env)
        assert not result.left, f"{program} {args}: processes left running {result.left}\n{result.output}"
        assert "(killed after" not in result.output, result.output


# where a rank waits whose partner called a collective that it does not call: at the barrier after it
RANK_1_AT_THE_BARRIER = r"rank 1 still waiting after 3 s, .*\(dist.barrier\(\).*in barrier\(\)"


def assert_hung_until_the_timeout(broken: Ran, not_reached: str) -> None:
    """The broken form waited for gloo's 5 s timeout and then failed (exit status 1), before saying `not_reached`."""
    assert broken.returncode == 1 and any(words in broken.output for words in TIMED_OUT), broken.output
    assert broken.seconds > 5 and not_reached not in broken.output, broken.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_evaluation_through_ddp_on_rank0_hangs_in_the_buffer_broadcast(ran):
    broken, fixed = ran("eval_on_rank0.py"), ran("eval_on_rank0.py", "--fixed")
    assert_hung_until_the_timeout(broken, "epoch 0: accuracy")
    # where each rank waits: rank 0 in the forward's broadcast of buffers, rank 1 at the barrier
    assert re.search(r"rank 0 still waiting after 3 s, at eval_on_rank0.py line \d+ \(accuracy = \(evaluated\(x\)"
                     r".*in _distributed_broadcast_coalesced\(\)", broken.output), broken.output
    assert re.search(RANK_1_AT_THE_BARRIER, broken.output), broken.output
    # the flight recorder: the same collective number is a broadcast (of 32 floats) on rank 0, a barrier on rank 1
    number = re.search(r"rank 0 called last: .*#(\d+) gloo:broadcast \[\[32\]\]", broken.output).group(1)
    assert re.search(rf"rank 1 called last: .*#{number} gloo:barrier \[\]", broken.output), broken.output
    assert fixed.returncode == 0 and "epoch 2: accuracy" in fixed.output, fixed.output
    assert "rank 0: done" in fixed.output and "rank 1: done" in fixed.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_uneven_inputs_name_the_late_rank_and_join_or_an_even_sampler_fix_them(ran):
    broken = ran("uneven_inputs.py")
    assert broken.returncode == 1 and "Rank 1 failed to pass monitoredBarrier in 4000 ms" in broken.output
    assert "rank 0: 16 samples, 4 steps" in broken.output and "rank 1: 17 samples" not in broken.output
    joined, sampled = ran("uneven_inputs.py", "--fixed"), ran("uneven_inputs.py", "--fixed", "sampler")
    assert joined.returncode == 0, joined.output
    assert "rank 0: 16 samples, 4 steps" in joined.output and "rank 1: 17 samples, 5 steps" in joined.output
    assert sampled.returncode == 0, sampled.output
    assert "rank 0: 16 samples, 4 steps" in sampled.output and "rank 1: 16 samples, 4 steps" in sampled.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_an_unused_parameter_fails_the_second_step_and_debug_info_names_it(ran):
    broken, named = ran("unused_parameter.py"), ran("unused_parameter.py", TORCH_DISTRIBUTED_DEBUG="INFO")
    for result in (broken, named):
        assert result.returncode == 1, result.output
        assert "Expected to have finished reduction in the prior iteration" in result.output
        assert "step 0" in result.output and "step 1" not in result.output
    assert "did not receive grad for rank 0: 4 5" in broken.output and "aux_head" not in broken.output
    assert "Parameters which did not receive grad for rank 0: aux_head.bias, aux_head.weight" in named.output
    for fixed in (ran("unused_parameter.py", "--fixed"), ran("unused_parameter.py", "--fixed", "static_graph")):
        assert fixed.returncode == 0 and "rank 0: step 2" in fixed.output and "rank 1: step 2" in fixed.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_an_all_gather_of_other_shapes_aborts_and_debug_detail_names_the_shapes(ran):
    broken = ran("collective_mismatch.py")
    # one rank aborts; the launcher names the rank that ended first, which is a race: the aborted one (SIGABRT), or
    # the other, whose gather then failed on the closed connection (seen once in CI: exit code 1)
    assert broken.returncode == 1 and "gloo::EnforceNotMet" in broken.output, broken.output
    assert "terminated with signal SIGABRT" in broken.output or "Connection reset by peer" in broken.output, \
        broken.output
    named = ran("collective_mismatch.py", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    assert named.returncode == 1 and "Detected mismatch between collectives on ranks" in named.output
    assert "OpType=ALLGATHER, TensorShape=[11]" in named.output and "TensorShape=[10]" in named.output
    fixed = ran("collective_mismatch.py", "--fixed")
    assert fixed.returncode == 0, fixed.output
    for rank in (0, 1):
        assert f"rank {rank}: 21 predictions, every test sample once: True" in fixed.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_one_rank_raising_hangs_the_job_until_the_timeout_and_the_fix_ends_it_with_that_error(ran):
    broken, fixed = ran("one_rank_raises.py"), ran("one_rank_raises.py", "--fixed")
    assert broken.returncode == 1 and any(words in broken.output for words in TIMED_OUT), broken.output
    assert broken.seconds > 5
    assert re.search(RANK_1_AT_THE_BARRIER, broken.output), broken.output
    assert re.search(r"rank 0 still waiting after 3 s, .*\.backward\(\).*", broken.output), broken.output
    # fixed: the job still fails, at once, with rank 1's own error and nothing that waited
    assert fixed.returncode == 1 and "rank 1: Traceback" in fixed.output, fixed.output
    assert "ValueError: cannot decode sample 1234" in fixed.output
    assert "Timed out" not in fixed.output and "still waiting" not in fixed.output


def epoch_orders(output: str) -> list[list[int]]:
    return [json.loads(order) for order in re.findall(r"rank 0, epoch \d: samples (\[.*\])", output)]


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_without_set_epoch_every_epoch_has_the_same_order(ran):
    broken, fixed = ran("set_epoch_forgotten.py"), ran("set_epoch_forgotten.py", "--fixed")
    assert broken.returncode == 0 and fixed.returncode == 0
    broken_orders, fixed_orders = epoch_orders(broken.output), epoch_orders(fixed.output)
    assert len(broken_orders) == len(fixed_orders) == 3
    assert all(order == broken_orders[0] for order in broken_orders)
    assert len({tuple(order) for order in fixed_orders}) == 3
    assert broken_orders[0] == fixed_orders[0]  # epoch 0 is the same: only the later epochs differ
    assert "same order every epoch: True" in broken.output and "same order every epoch: False" in fixed.output


def accuracies(output: str) -> tuple[float, float]:
    reported, exact = re.search(r"test accuracy ([\d.]+); exact, on one process: ([\d.]+)", output).groups()
    return float(reported), float(exact)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_the_padded_test_sampler_reports_a_wrong_accuracy(ran):
    broken, fixed = ran("padded_test_sampler.py"), ran("padded_test_sampler.py", "--fixed")
    assert broken.returncode == 0 and fixed.returncode == 0
    reported, exact = accuracies(broken.output)
    assert abs(reported - exact) > 0.01, broken.output
    assert accuracies(fixed.output) == (exact, exact), fixed.output


def crop_corners(output: str) -> list[str]:
    return re.findall(r"rank \d crops its 4 images at corners (\[.*\])", output)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_the_same_seed_on_every_rank_draws_the_same_augmentations(ran):
    broken, fixed = ran("same_augmentation.py"), ran("same_augmentation.py", "--fixed")
    assert broken.returncode == 0 and fixed.returncode == 0
    same, different = crop_corners(broken.output), crop_corners(fixed.output)
    assert len(same) == len(different) == 2
    assert same[0] == same[1] and different[0] != different[1], (broken.output, fixed.output)


def accumulation(output: str) -> tuple[int, float, float]:
    all_reduces = re.search(r"(\d+) gradient all-reduce\(s\) for one optimizer step of 4 micro-batches", output)
    ratio, difference = re.search(r"gradient: ([\d.]+) \(largest difference ([\d.e+-]+)\)", output).groups()
    return int(all_reduces.group(1)), float(ratio), float(difference)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_accumulation_without_no_sync_all_reduces_every_micro_batch_and_an_unscaled_loss_multiplies_the_gradient(ran):
    broken, fixed = ran("gradient_accumulation.py"), ran("gradient_accumulation.py", "--fixed")
    assert broken.returncode == 0 and fixed.returncode == 0
    all_reduces, ratio, _ = accumulation(broken.output)
    assert all_reduces == 4 and ratio == pytest.approx(4, rel=1e-4), broken.output
    all_reduces, ratio, difference = accumulation(fixed.output)
    assert all_reduces == 1 and ratio == pytest.approx(1, rel=1e-4) and difference < 1e-6, fixed.output


def checkpoint_counts(output: str) -> tuple[int, int, int]:
    counts = re.search(r"10 checkpoints: (\d+) writes of checkpoint.pt, (\d+) failed renames, (\d+) failed loads",
                       output)
    return tuple(int(count) for count in counts.groups())


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_every_rank_writing_the_checkpoint_writes_it_twice(ran):
    broken, fixed = ran("every_rank_saves.py"), ran("every_rank_saves.py", "--fixed")
    assert broken.returncode == 0 and fixed.returncode == 0, (broken.output, fixed.output)
    assert checkpoint_counts(broken.output)[0] == 20  # the races (failed renames and loads) come now and then
    assert checkpoint_counts(fixed.output) == (10, 0, 0)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_a_port_in_use_is_refused_and_a_free_port_works(ran):
    broken, fixed = ran("port_in_use.py"), ran("port_in_use.py", "--fixed")
    assert broken.returncode == 1 and "EADDRINUSE" in broken.output and "address already in use" in broken.output
    assert fixed.returncode == 0, fixed.output
    assert "rank 0 of 2: joined the process group" in fixed.output and "rank 1 of 2: joined" in fixed.output


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_zero1_state_consolidated_on_rank0_alone_hangs_and_every_rank_consolidating_saves_it_whole(ran):
    broken, fixed = ran("zero_state_dict_on_rank0.py"), ran("zero_state_dict_on_rank0.py", "--fixed")
    assert_hung_until_the_timeout(broken, "checkpoint 0")
    assert re.search(r"rank 0 still waiting after 3 s, .*\(optimizer.consolidate_state_dict\(to=0\).*in broadcast\(\)",
                     broken.output), broken.output
    assert re.search(RANK_1_AT_THE_BARRIER, broken.output), broken.output
    assert fixed.returncode == 0 and "rank 0: done" in fixed.output and "rank 1: done" in fixed.output, fixed.output
    assert fixed.output.count("the momentum of 4 of 4 parameters") == 3  # each checkpoint holds the whole state
    held = [int(n) for n in re.findall(r"rank \d: step 0, holds the momentum of (\d) of 4", fixed.output)]
    assert sorted(held) == [1, 3], fixed.output  # whole parameters dealt to the ranks, each held once


ALONE_LIMIT = 30  # seconds for one run of the test below; the broken form takes about 9 (2 s importing, a 5 s wait)


def line_of(program: str, code: str) -> int:
    return next(number for number, line in enumerate((FAILURES / program).read_text().splitlines(), 1)
                if code in line)


@pytest.mark.slow
@pytest.mark.timeout(4 * ALONE_LIMIT)  # 3 runs, each stopped at ALONE_LIMIT: about 15 s together
def test_a_skipped_collective_hangs_and_the_flight_recorder_names_the_rank_the_collective_and_the_line(tmp_path):
    broken = run_program("skipped_collective.py", (), {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/broken/rank_"},
                         ALONE_LIMIT)
    assert not broken.left and "(killed after" not in broken.output, broken.output
    assert_hung_until_the_timeout(broken, "every rank finished the epoch")
    assert "rank 1, step 4: loss nan, step skipped" in broken.output
    line = line_of("skipped_collective.py", "dist.all_reduce(loss)")
    assert re.search(rf"rank 0 still waiting after 3 s, at skipped_collective.py line {line} ", broken.output)
    # each rank wrote its flight recorder, from the timer thread, while rank 0 waited
    assert sorted(os.listdir(tmp_path / "broken")) == ["rank_0", "rank_1"], broken.output
    read = subprocess.run([sys.executable, str(FAILURES / READER), str(tmp_path / "broken")], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=ALONE_LIMIT)
    report = read.stdout + read.stderr
    assert read.returncode == 0, report
    # collective 6 (1: the launcher's barrier, then the all_reduces): rank 0 called it, at that line; rank 1 did not
    assert "Not all ranks joining collective, sequence number: 6" in report, report
    assert "collective: gloo:all_reduce" in report and "missing ranks: {1}" in report, report
    assert f"main at {FAILURES / 'skipped_collective.py'}:{line}\n" in report, report
    fixed = run_program("skipped_collective.py", ("--fixed",), {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fixed/rank_"},
                        ALONE_LIMIT)
    assert fixed.returncode == 0 and not fixed.left, fixed.output
    assert "rank 0, step 4: loss 4.0, step skipped" in fixed.output and "rank 1, step 4: loss nan" in fixed.output
    assert fixed.output.count("every rank finished the epoch") == 2, fixed.output
    assert not (tmp_path / "fixed").exists(), fixed.output  # no dump: every rank ended the epoch within 1 s


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_reads_alone(program):
    """A whole program a learner copies with _launch.py: torch and the standard library only, under 80 lines, and a
    docstring that gives the symptom, the cause, how to find it, the fix, and both command lines."""
    source = (FAILURES / program).read_text()
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"torch", "_launch"} | sys.stdlib_module_names, imported
    assert len(source.splitlines()) <= 80
    doc = ast.get_docstring(tree)
    for part in ("Symptom:", "Cause:", "Find it:", "Fix:", f"python failures/{program}", "--fixed"):
        assert part in doc, part
    assert "args.fixed" in source


needs_gpu = gpu_test(not torch.cuda.is_available(), "needs a GPU")
needs_2_gpus = gpu_test(torch.cuda.device_count() < 2, "needs 2 GPUs")
LOAD = "import sys, torch; print(torch.load(sys.argv[1]{})['weight'].device)"  # in a process that sees no GPU


@needs_gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_saved_on_a_gpu_loads_where_no_gpu_is_only_with_map_location(tmp_path):
    """torch.load puts each tensor back on the device it was saved from, unless map_location says otherwise."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"weight": torch.ones(3, device="cuda:0")}, path)
    without = subprocess.run([sys.executable, "-c", LOAD.format(""), str(path)], env=subprocess_env(),
                             capture_output=True, text=True, timeout=LIMIT)
    assert without.returncode == 1, without.stdout + without.stderr
    assert "Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False" in without.stderr
    mapped = subprocess.run([sys.executable, "-c", LOAD.format(", map_location='cpu'"), str(path)],
                            env=subprocess_env(), capture_output=True, text=True, timeout=LIMIT)
    assert mapped.returncode == 0 and mapped.stdout.strip() == "cpu", mapped.stdout + mapped.stderr


@needs_2_gpus
def test_without_map_location_rank_1_loads_rank_0s_checkpoint_onto_gpu_0(tmp_path):
    """Rank 0 saved from cuda:0; rank 1 (on cuda:1) loading it without map_location fills GPU 0, not its own."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"weight": torch.ones(3, device="cuda:0")}, path)
    torch.cuda.set_device(1)  # what rank 1 runs
    try:
        assert torch.load(path)["weight"].device == torch.device("cuda:0")
        assert torch.load(path, map_location="cuda:1")["weight"].device == torch.device("cuda:1")
    finally:
        torch.cuda.set_device(0)
