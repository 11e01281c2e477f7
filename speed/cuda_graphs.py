"""--cuda-graphs: every training step replayed from one CUDA graph, with --loader device the fast GPU path of
distributed_apex.py (a speed technique: docs/speed.md).

Eager ResNet-18 on a GPU is bound by the host launching its kernels: at a batch of 256 on an H100 its bare
step took 2.6 s per 50,000 images eagerly and 0.8 s under torch.compile(mode="reduce-overhead"), which both fuses
its kernels and replays them from CUDA graphs (a graph records a step's kernels once and launches them all at once).
On an H200 this whole training step took 2.07 s per epoch with its eager kernels replayed and 0.87 s with --compile,
against 2.8 s eager (docs/speed.md). What is captured here is the script's own step: its
train_one_epoch, run on a list of one batch held in static buffers, with a stand-in for the safety net that keeps
the step's loss in a static tensor. So the graph holds forward, loss, backward with DDP's gradient all-reduce (and
SyncBatchNorm's collectives) and the optimizer's step. Per
step, outside the graph: the batch copied into the static buffers, the learning rate copied into the tensor the
optimizer reads (only when the schedule changed it), and the safety net's bookkeeping on the static loss (summed on the
device; the stop agreement; checkpoints).

With --compile the graph holds the compiled kernels: the model is compiled in torch.compile's default mode (fused
kernels, no graphs of its own: CapturedSteps turns inductor's CUDA graphs off, even where TORCHINDUCTOR_CUDAGRAPHS=1
asks for them, since its cudagraph trees manage their memory in Python at each call, which a replay of the outer
graph skips) at the first eager step, and the eager steps launch every compiled kernel before the capture (inductor
tunes some at their first launch), so nothing compiles or tunes at the capture, where torch refuses to compile.
Nothing a guard of the compiled code checks changes at the capture: the same static inputs, grad mode, autocast and
stream at every step; the optimizer, whose learning rate is a tensor here, is not compiled.
tests/test_cuda_graphs_compiled.py counts the compilations on the CPU.

torch's recipe (its CUDA semantics notes: whole-network capture, and usage with DistributedDataParallel):
- (its step "NCCL's asynchronous error handling off" is obsolete since torch 2.1 and not taken: ProcessGroupNCCL
  hands no work issued during a capture to its watchdog, so the eager collectives keep their --dist-timeout);
- DDP built on the side stream the step is warmed up and captured on: from CapturedSteps' creation on, this rank
  works on that stream, so it comes before DDP(...), which registers its gradient hooks on the current stream;
- at least 11 eager DDP steps before the capture (WARMUP_STEPS): DDP rebuilds its buckets after its first step
  and times its first 10;
- static inputs, and gradients at addresses the graph keeps: train_one_epoch's zero_grad(set_to_none=True) runs
  inside the capture, so backward writes them from the graph's private memory pool (or into DDP's buckets);
- the learning rate a tensor that torch's fused SGD kernel reads on the device: a Python number would be fixed
  in the graph at the value of the step that was captured.
Off the GPU the same steps are called directly instead of captured and replayed; tests/test_cuda_graphs.py proves
that path on the CPU, bit for bit against the eager loop.

Every exit of a script, an error's included, releases the graph before the process group is destroyed
(release_captured_graphs, in the `finally` before dist.destroy_process_group): NCCL does not destroy a
communicator that a live graph captured, and the process would hang there (pytorch/pytorch#115388), while an
error's traceback keeps the graph alive until the process ends.
"""
import contextlib
import weakref

import torch
import torch._inductor.config

from utils import flags
from utils.errors import UsageError

WARMUP_STEPS = 11  # torch's notes: at least 11 DDP-enabled eager iterations before capture


def add_flags(parser) -> None:
    """The fast GPU path's flags, among the parser's speed techniques: --loader and --cuda-graphs, with the check of
    --cuda-graphs (why_not) run after parsing."""
    parser.checks.append(why_not)
    add = flags.group(parser, "speed techniques").add_argument
    add("--loader", choices=["dataloader", "device"], default="dataloader",
        help="dataloader: --workers processes per rank load, crop and flip each image on the CPU; device: the whole "
             "set held on the training device, augmented there in batches, no worker processes (fastest on GPU; "
             "CIFAR-shaped data.Images sets only). Both give the same batches")
    add("--cuda-graphs", action="store_true",
        help="capture the whole training step (forward, backward, all-reduce, optimizer step) once in a CUDA graph "
             "and replay it every step: one launch instead of thousands. Needs a GPU, --loader device, and bfloat16 "
             "or float32 (not float16's loss scaling); with --compile the graph holds the compiled kernels")


def why_not(args) -> str | None:
    """Why --cuda-graphs cannot run with these flags (one line), or None: a parser check."""
    if not args.cuda_graphs:
        return None
    reasons = [_no_gpu(args),
               "--cuda-graphs replays the step on batches made on the GPU: add --loader device (DataLoader workers "
               "would feed each replay through the host)" if args.loader != "device" else None,
               "--cuda-graphs cannot capture float16's GradScaler, which reads every step's overflow check back to the "
               "host: add --amp-dtype bfloat16 (or --opt-level O0 for float32)"
               if args.opt_level != "O0" and args.amp_dtype != "bfloat16" else None,
               f"--cuda-graphs steps SGD with torch's fused kernel, which reads the learning rate from a tensor the "
               f"graph sees; drop --optimizer-impl {args.optimizer_impl} (or give fused)"
               if args.optimizer_impl not in ("auto", "fused") else None,
               "--cuda-graphs steps torch's fused SGD; apex's FusedSGD takes the learning rate as a number, which the "
               "graph would keep at its first value: use --optimizer sgd"
               if args.optimizer != "sgd" else None,
               f"--cuda-graphs captures DDP's own all-reduce; --comm-hook {args.comm_hook} runs Python callbacks on "
               "each bucket, which a replay skips: drop one of the two" if args.comm_hook != "none" else None,
               "--profile-steps would record the eager steps before the capture, not the replays (a replay is one "
               "launch, not the step's kernels): profile without --cuda-graphs" if args.profile_steps else None]
    return next((reason for reason in reasons if reason), None)


def _no_gpu(args) -> str | None:
    if args.device == "cpu" or not torch.cuda.is_available():
        return ("--cuda-graphs records the step's CUDA kernels and replays them: it needs a GPU"
                + (" (drop --device cpu)" if args.device == "cpu" else ", and none is visible"))
    return None


class _LossKept:
    """The safety net as the captured step sees it: step_done copies the step's loss into a tensor that outlives
    the step (the graph writes it again at every replay) and never asks to stop."""

    def __init__(self):
        self.loss = self.grad_norm = None

    def step_done(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> bool:
        if self.loss is None:  # made by the first, eager step: outside the graph's memory pool
            self.loss = torch.zeros_like(loss, dtype=torch.float32)
            self.grad_norm = torch.zeros((), device=loss.device) if grad_norm is not None else None
        self.loss.copy_(loss.detach())
        if grad_norm is not None:  # --clip-grad-norm's norm before clipping
            self.grad_norm.copy_(grad_norm.detach())
        return False


class _CalledDirectly:
    """What stands for a CUDA graph off the GPU: the captured step is run at once, and each replay runs it again."""

    def __init__(self, step):
        self.replay = step
        step()

    def reset(self) -> None:
        """As a CUDA graph's reset: the step is let go."""
        self.replay = None


def _capture(graph: torch.cuda.CUDAGraph, step) -> None:
    """The step recorded into `graph` on the current stream (the one DDP was built on), then replayed once: a
    capture records the kernels without running them."""
    # thread_local: NCCL's watchdog thread may query its events while this thread captures
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        step()
    graph.replay()


class CapturedSteps:
    """A script's train_one_epoch(model, criterion, optimizer, loader, device, safety, *extra), called the same way,
    with each step run from static buffers: the first WARMUP_STEPS eagerly, the next captured into a CUDA graph,
    every later one replayed from it (off the GPU each is called directly). Make it before DDP(...): on a GPU this
    rank's work moves here to the stream the step is captured on. close() (release_captured_graphs at the script's
    exit) lets go of the graph; a closed one refuses to step."""

    def __init__(self, train_one_epoch, device: torch.device):
        self.train_one_epoch, self.device = train_one_epoch, device
        self.steps = 0  # steps run so far: eager, captured and replayed
        self.graph = None  # the captured step (a CUDAGraph, or _CalledDirectly off the GPU)
        self.images = self.targets = None  # the static input buffers, made like the first batch
        self.kept = _LossKept()
        self.rates, self.rate_values = None, None  # per parameter group: the tensor the step reads, its value
        self.closed = False  # close() ran: the graph and the buffers are let go, no step runs again
        torch._inductor.config.triton.cudagraphs = False  # --compile's kernels go into this graph, not into inductor's
        _every_captured_steps.add(self)  # for release_captured_graphs at the script's exit
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # what was queued before (the model's copy)
            torch.cuda.set_stream(stream)

    def __call__(self, model, criterion, optimizer, loader, device, safety, *extra):
        """One pass over this rank's batches, as train_one_epoch makes it: each step from the static buffers."""
        if self.closed:
            raise RuntimeError("CapturedSteps called after close(): its graph is released; make a new one")
        for images, targets in loader:
            if self.images is None:
                self.images, self.targets = torch.empty_like(images), torch.empty_like(targets)
            self.images.copy_(images, non_blocking=True)
            self.targets.copy_(targets, non_blocking=True)
            self._copy_rates(optimizer)
            if self.graph is not None:
                self.graph.replay()
            elif self.steps < WARMUP_STEPS:
                self._step(model, criterion, optimizer, device, extra)
            else:
                def step():
                    self._step(model, criterion, optimizer, device, extra)
                if self.device.type == "cuda":
                    self.graph = torch.cuda.CUDAGraph()  # held first: an error in the capture leaves it to close()
                    _capture(self.graph, step)
                else:
                    self.graph = _CalledDirectly(step)
            self.steps += 1
            if safety.step_done(self.kept.loss, self.kept.grad_norm):  # outside the graph: progress, stop, checkpoints
                return

    def close(self) -> None:
        """Let go of the graph and its private memory pool (the gradients keep their part of it until they go), and
        of the static buffers, once the device has run every replay queued: a live graph keeps the NCCL communicator
        it captured, which destroy_process_group then waits on forever. A second call does nothing."""
        if self.graph is not None and self.device.type == "cuda":
            # no replay still running in the memory about to be freed; a device that failed (a sticky CUDA error)
            # raises here again, and the run's own error, already on its way, is the one to report
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(self.device)
        if self.graph is not None:
            self.graph.reset()  # now, not when the last reference goes (an error's traceback holds this object)
        self.graph = self.images = self.targets = self.rates = self.rate_values = None
        self.kept.loss = self.kept.grad_norm = None
        self.closed = True

    def _step(self, model, criterion, optimizer, device, extra) -> None:
        """train_one_epoch on the one batch of the static buffers, its optimizer reading the rate tensors."""
        values = [group["lr"] for group in optimizer.param_groups]
        for group, rate in zip(optimizer.param_groups, self.rates, strict=True):
            group["lr"] = rate
        try:
            self.train_one_epoch(model, criterion, optimizer, [(self.images, self.targets)], device, self.kept,
                                 *extra)
        finally:  # the schedule and the checkpoints see the plain numbers again
            for group, value in zip(optimizer.param_groups, values, strict=True):
                group["lr"] = value

    def _copy_rates(self, optimizer) -> None:
        """The learning rates of the optimizer's groups (numbers, which the schedule sets) into the tensors its step
        reads: float32 on a GPU, where torch's fused SGD kernel reads them so; float64 elsewhere, where it reads a
        double, the number itself. Written only when the schedule changed them."""
        if self.rates is None:
            if not all(group.get("fused") for group in optimizer.param_groups):
                raise UsageError("--cuda-graphs needs torch's fused SGD (speed.techniques.sgd_kernel gives it)")
            dtype = torch.float32 if self.device.type == "cuda" else torch.float64
            self.rates = [torch.zeros((), dtype=dtype, device=self.device) for _ in optimizer.param_groups]
            self.rate_values = [None] * len(self.rates)
        for k, group in enumerate(optimizer.param_groups):
            if group["lr"] != self.rate_values[k]:
                self.rates[k].fill_(group["lr"])
                self.rate_values[k] = group["lr"]


_every_captured_steps = weakref.WeakSet()  # each CapturedSteps this process made and still holds


def release_captured_graphs() -> None:
    """Close every CapturedSteps this process made (see close()): the scripts call it on every exit, just before
    dist.destroy_process_group, which hangs on a communicator that a live graph captured."""
    for steps in list(_every_captured_steps):
        steps.close()
