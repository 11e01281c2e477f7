"""--profile-steps N: torch.profiler records N training steps on every rank, after a short warm-up, and each rank
writes its trace to <output-dir>/profile/rank<R>.json. Open one in https://ui.perfetto.dev or chrome://tracing,
or draw them all: python -m tools.timeline <output-dir>.

The safety net makes it in running(), starts it as the first epoch starts (start), steps it in step_done (step) and says
where the traces are at the end (last_line); without the flag it is never made, and torch.profiler not imported.
"""
import os

from safety_net.checkpoint import check_writable
from utils import flags
from utils.errors import UsageError

FOLDER = "profile"  # in <output-dir>
SKIPPED_STEPS = 1  # not recorded: the first step builds DDP's buckets, warms the allocator and gloo's pairs
WARMUP_STEPS = 1  # recorded and thrown away: the profiler's own start-up would otherwise fall on the first step


def add_flag(group) -> None:
    """--profile-steps, in the safety net's group of flags."""
    group.add_argument("--profile-steps", type=flags.positive_int, default=None, metavar="N",
                       help=f"record N training steps with torch.profiler (CPU and CUDA activities) after "
                            f"{SKIPPED_STEPS + WARMUP_STEPS} steps of warm-up, one trace per rank in "
                            f"<output-dir>/{FOLDER}/ (open in https://ui.perfetto.dev or chrome://tracing; draw with "
                            f"python -m tools.timeline <output-dir>). Its cost, on the recorded steps only: "
                            f"each operator and its input shapes recorded (5-10%% slower steps of ResNet-18 on the "
                            f"CPU), and 1-3 MB of trace per rank and step, written in well under a second")


def check_before_start(steps: int | None, evaluate: bool, output_dir: str) -> None:
    """Before any process starts (a UsageError): --profile-steps (`steps`; None: not asked for) has training steps
    to record, and <output-dir>/profile can be written (the output directory itself is checked by the safety net)."""
    if not steps:
        return
    if evaluate:
        raise UsageError("--profile-steps records training steps; --evaluate trains none (drop one of them)")
    if os.path.exists(folder := os.path.join(output_dir, FOLDER)):
        check_writable(folder, "--profile-steps")


def check_steps_left(steps: int, steps_left: int, steps_per_epoch: int) -> None:
    """The recorded steps and their warm-up fit in the steps this run has left (a UsageError)."""
    needed = SKIPPED_STEPS + WARMUP_STEPS + steps
    if needed > steps_left:
        raise UsageError(f"--profile-steps {steps} needs {needed} steps ({SKIPPED_STEPS + WARMUP_STEPS} of warm-up), "
                         f"this run has {steps_left} left ({steps_per_epoch} per epoch): fewer steps, or more "
                         f"--epochs or --train-samples")


class StepProfiler:
    """torch.profiler over steps SKIPPED_STEPS + WARMUP_STEPS + 1 .. + steps of this process's training: this rank's
    trace goes to folder/rank<rank>.json when the last of them is done, and the profiler stops there."""

    def __init__(self, steps: int, folder: str, rank: int, device_type: str):
        self.steps, self.folder, self.rank = steps, folder, rank
        self.device_type = device_type
        self.profiler, self.started, self.done, self.trace = None, False, 0, None

    def start(self) -> None:
        """Before the first step: the profiler waits SKIPPED_STEPS steps, warms up, then records (once a run)."""
        if self.started:
            return
        self.started = True
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, schedule
        # kineto's own log lines (start and stop notes; on a machine without a GPU, a "gpuGetDeviceCount failed"
        # ERROR that means nothing here) are silenced, unless KINETO_LOG_LEVEL is set
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        when = schedule(wait=SKIPPED_STEPS, warmup=WARMUP_STEPS, active=self.steps, repeat=1)
        # record_shapes: the collectives' sizes (tools.timeline); all threads: those a callback starts (PowerSGD's)
        self.profiler = profile(activities=activities, schedule=when, on_trace_ready=self._write, record_shapes=True,
                                experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self.profiler.start()

    def step(self) -> None:
        """After each optimizer step: the profiler's next step; after the last recorded one, the trace is written."""
        if self.profiler is None:
            return
        self.done += 1
        self.profiler.step()  # on the last recorded step, this calls _write
        if self.done == SKIPPED_STEPS + WARMUP_STEPS + self.steps:
            self.close()

    def close(self) -> None:
        """Stops the profiler (a run cut short by a stop signal writes no trace)."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _write(self, profiler) -> None:
        os.makedirs(self.folder, exist_ok=True)
        self.trace = os.path.join(self.folder, f"rank{self.rank}.json")
        profiler.export_chrome_trace(self.trace)

    def last_line(self, output_dir: str, world_size: int) -> str:
        """What rank 0 prints at the end of the run: where the traces are and how to open them."""
        if self.trace is None:
            return f"no profile: the run ended before its {self.steps} recorded steps"
        first = SKIPPED_STEPS + WARMUP_STEPS + 1
        return (f"profile of steps {first}-{first + self.steps - 1}: {world_size} trace(s) in {self.folder}/ "
                f"(rank0.json, ...); open one in https://ui.perfetto.dev or chrome://tracing, or draw them: "
                f"python -m tools.timeline {output_dir}")
