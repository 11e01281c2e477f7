"""The bare training step of one process, the yardstick of benchmarks.run; and the device's matrix peak.

    python -m benchmarks.bare_step --device cpu --batch-size 32 --steps 8      # images/s of the bare step
    python -m benchmarks.bare_step --device cpu --compile default              # ... with torch.compile's model
    python -m benchmarks.bare_step --device cuda --compile reduce-overhead     # ... compiled, in CUDA graphs
    python -m benchmarks.bare_step --device cuda --peak bfloat16               # the device's TFLOP/s peak

The bare step is what every script does per step, minus everything that distribution and data
loading add: ResNet-18 (32x32 stem), SGD with momentum, one batch made once on the device, no
process group, no DataLoader, no SyncBatchNorm. N of these running side by side, one per device,
are the ideal that a method on N devices is measured against. With --compile the model is torch.compile'd
(default mode; reduce-overhead also records its steps as CUDA graphs, GPUs only): the ceilings of the
benchmark's peers table, what the step itself can reach once compiled. Prints one JSON line.
"""
import json
import time

import torch
from torch import nn

from safety_net.progress import peak_memory_mb
from utils import flags, models
from utils.data import NUM_CLASSES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step_rate(device, batch_size, steps, warmup, amp_dtype=None, compile_mode=None, phases=False) -> dict:
    """images/s of `steps` training steps after `warmup` untimed ones (which, compiled, do the compiling); with
    `phases`, also the seconds per step of its three (on a GPU each then ends in a synchronize, to time it): the
    forward with the loss, the backward, and the optimizer's step with zero_grad."""
    torch.manual_seed(0)
    model = models.resnet18_cifar().to(device)
    if compile_mode:
        model = torch.compile(model, mode=compile_mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()
    images = torch.randn(batch_size, 3, 32, 32, device=device)
    targets = torch.randint(0, NUM_CLASSES, (batch_size,), device=device)
    model.train()
    times = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}

    def ended(phase: str, since: float) -> float:  # with `phases`, the phase's time added once the warm-up is over
        if not phases:
            return since
        synchronize(device)
        now = time.perf_counter()
        if step >= warmup:
            times[phase] += now - since
        return now

    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        began = time.perf_counter()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(images), targets)
        began = ended("forward_s", began)
        loss.backward()
        began = ended("backward_s", began)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended("optimizer_s", began)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"images_per_s": steps * batch_size / seconds, "peak_memory_mb": peak_memory_mb(device),
            **({phase: total / steps for phase, total in times.items()} if phases else {})}


def _rate(work, flops: float, device: torch.device, seconds: float) -> float:
    """TFLOP/s of `work` (which does `flops`), repeated for `seconds` after a warm-up."""
    for _ in range(3):
        work()
    synchronize(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            work()
        synchronize(device)
        count += 10
    return flops * count / (time.perf_counter() - start) / 1e12


def device_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> dict:
    """TFLOP/s of large square matrix products and of large 3x3 convolutions; the peak is the faster of
    the two. A matmul alone under-reads some CPUs: on an AMD EPYC, torch's float32 matmul ran at 0.2
    TFLOP/s where oneDNN's convolutions ran at 0.48, and ResNet-18's own steps beat the matmul."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    matmul = _rate(lambda: a @ b, 2 * n**3, device, seconds)
    batch, channels, size = (256, 256, 32) if device.type == "cuda" else (32, 256, 16)
    x = torch.randn(batch, channels, size, size, device=device).to(dtype)
    w = torch.randn(channels, channels, 3, 3, device=device).to(dtype)
    conv = _rate(lambda: torch.nn.functional.conv2d(x, w, padding=1), 2 * batch * channels**2 * 9 * size**2,
                 device, seconds)
    return {"peak_tflops": max(matmul, conv), "matmul_tflops": matmul, "conv_tflops": conv,
            "dtype": str(dtype).removeprefix("torch.")}


def flops_per_image() -> float:
    """Forward + backward FLOPs of one 32x32 image through the model, counted by torch's FlopCounterMode
    (matrix products and convolutions; the element-wise work is a small remainder, not counted)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = models.resnet18_cifar()
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
    return counter.get_total_flops() / 2


def main(argv=None):
    parser = flags.Parser(prog="python -m benchmarks.bare_step", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--batch-size", type=flags.positive_int, default=32, help="images per step")
    parser.add_argument("--steps", type=flags.positive_int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=flags.non_negative_int, default=2, help="untimed steps first")
    parser.add_argument("--amp-dtype", choices=["bfloat16", "float16"], default=None, help="autocast dtype")
    parser.add_argument("--compile", choices=["default", "reduce-overhead"], default=None,
                        help="torch.compile the model in this mode (reduce-overhead: CUDA graphs, GPUs only); "
                             "the warm-up steps compile it")
    parser.add_argument("--phases", action="store_true",
                        help="also time the forward, the backward and the optimizer's step (on a GPU: a "
                             "synchronize after each)")
    parser.add_argument("--peak", choices=list(DTYPES), default=None,
                        help="instead: measure the TFLOP/s of large matrix products and convolutions in this dtype")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but no GPU is visible")
    if args.compile == "reduce-overhead" and device.type != "cuda":
        parser.error("--compile reduce-overhead records CUDA graphs: it needs --device cuda")
    if args.peak:
        result = device_peak(device, DTYPES[args.peak])
    else:
        result = bare_step_rate(device, args.batch_size, args.steps, args.warmup,
                                DTYPES[args.amp_dtype] if args.amp_dtype else None, args.compile, args.phases)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
