"""The mixed-precision flags in apex's names (--opt-level, --optimizer apex-fused-sgd) and the autocast
dtype they ask for on this device; the autocast and GradScaler lines themselves stay in the scripts.

apex.amp's O1 is what torch.amp does: autocast around the forward pass, GradScaler for float16. O2 and
O3 (float16 master weights, pure float16) have no torch.amp equivalent and are refused with that reason.
"""
import argparse
import importlib.util
import sys

import torch

from utils import launch
from utils.errors import UsageError

OPT_LEVELS = {"O0": "float32", "O1": "mixed precision (autocast)"}


def opt_level(text: str) -> str:
    """An argparse type: O0 or O1; O2/O3 say where they went."""
    if text in ("O2", "O3"):
        raise argparse.ArgumentTypeError(f"{text} (float16 master weights / pure float16) left apex with apex.amp; "
                                         "torch.amp has autocast only: use O1")
    if text not in OPT_LEVELS:
        raise argparse.ArgumentTypeError(f"expected O0 (float32) or O1 (mixed precision), got {text}")
    return text


def add_flags(parser, apex_optimizer: bool = False, opt_level_default: str = "O1", float16: bool = True) -> None:
    """--opt-level and --amp-dtype (and --optimizer with apex's FusedSGD) in a group of their own,
    checked when the flags are parsed. float16=False: a script without loss scaling (FSDP) offers bfloat16 only."""
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--opt-level", type=opt_level, default=opt_level_default,
                       help="apex's names: O0 = float32, O1 = mixed precision; O2/O3 are gone")
    picks = ("autocast dtype; auto: float16 on GPU (with loss scaling), bfloat16 on a CPU with native bfloat16 "
             "instructions, float32 on other CPUs (where bfloat16 is slower)" if float16 else
             "dtype of the parameters and activations in forward and backward; auto: bfloat16 where the device has "
             "it natively (GPUs since Ampere, CPUs with AVX512-BF16 or AMX), else float32; float16 is not offered, "
             "as it needs loss scaling across the shards")
    group.add_argument("--amp-dtype", choices=["auto", "float16", "bfloat16"] if float16 else ["auto", "bfloat16"],
                       default="auto", help=f"{picks}; a resumed run keeps the precision it trained in")
    parser.checks.append(_check_dtype_with_float32)
    if apex_optimizer:
        group.add_argument("--optimizer", choices=["sgd", "apex-fused-sgd"], default="sgd",
                           help="apex-fused-sgd: apex.optimizers.FusedSGD, if NVIDIA apex is installed")
        parser.checks.append(_check_apex_optimizer)


def _check_dtype_with_float32(args) -> str | None:
    """--amp-dtype named with --opt-level O0 would be ignored: say so rather than train float32 silently."""
    if args.opt_level == "O0" and args.amp_dtype != "auto":
        return (f"--amp-dtype {args.amp_dtype} needs mixed precision, but --opt-level is O0 (float32); "
                "add --opt-level O1, or drop --amp-dtype")
    return None


def _check_apex_optimizer(args) -> str | None:
    """Why --optimizer apex-fused-sgd cannot run here, or None."""
    if args.optimizer != "apex-fused-sgd":
        return None
    if importlib.util.find_spec("apex") is None or importlib.util.find_spec("apex.optimizers") is None:
        return ("--optimizer apex-fused-sgd needs NVIDIA apex, built from github.com/NVIDIA/apex "
                "(the PyPI package named 'apex' is an unrelated project); or use --optimizer sgd")
    if launch.resolve_device(args.device) != "cuda":
        return "--optimizer apex-fused-sgd runs CUDA kernels only; use --optimizer sgd on the CPU"
    if args.optimizer_impl != "auto":
        return f"--optimizer-impl {args.optimizer_impl} applies to torch.optim.SGD; drop it with apex-fused-sgd"
    return None


def optimizer_class(name: str):
    """torch.optim.SGD for --optimizer sgd, or apex's FusedSGD for apex-fused-sgd (checked at parse time)."""
    if name == "sgd":
        return torch.optim.SGD
    from apex.optimizers import FusedSGD
    return FusedSGD


def cpu_has_native_bfloat16() -> bool:
    """AVX512-BF16 or AMX instructions: without them a CPU emulates bfloat16, far slower than float32
    (about 18x on an AMD EPYC of our test machines)."""
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(avx512_bf16() or amx())


def default_precision(device: torch.device, float16: bool = True) -> str:
    """What --amp-dtype auto picks for a new run: float16 on a GPU (bfloat16 where it has it, without
    `float16`), bfloat16 on a CPU with native bfloat16 instructions, float32 on other CPUs."""
    if device.type == "cuda":
        return "float16" if float16 else "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_native_bfloat16() else "float32"


def autocast_dtype(args, device: torch.device, is_main: bool, recorded: tuple[str | None, str | None] = (None, None),
                   float16: bool = True) -> torch.dtype | None:
    """The dtype autocast runs matrix products and convolutions in, None for float32.

    A new run: --opt-level O0 is float32, an explicit --amp-dtype is that dtype, and auto is
    default_precision (rank 0 says in one line when a CPU without native bfloat16 makes it float32).
    A resumed run keeps the precision its checkpoint trained in (`recorded`: that precision and the
    checkpoint's path, from SafetyNet.recorded_precision(); (None, None) for a new run): auto takes it (said
    in one line where this device alone would pick another), and an explicit other one is refused
    (UsageError): it would change the arithmetic mid-run. float16=False: auto never picks float16 (a script
    without loss scaling)."""
    default = default_precision(device, float16)
    asked = "float32" if args.opt_level == "O0" else None if args.amp_dtype == "auto" else args.amp_dtype
    trained, path = recorded
    if trained:
        if asked and asked != trained:
            flag = "--opt-level O0" if asked == "float32" else f"--amp-dtype {asked}"
            raise UsageError(f"{path} trained in {trained}, and {flag} would change its arithmetic mid-run; resume "
                             f"without {flag} (auto continues in {trained}), or start a new run from its weights "
                             f"with --init-from {path} and another --output-dir")
        if trained == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"{path} trained in bfloat16, which this GPU does not support; resume it on one that "
                             "does, or start a new run from its weights with --init-from")
        if asked is None and trained != default and is_main:
            print(f"--amp-dtype auto: continuing in {trained}, the precision {path} trained in (a new run "
                  f"here would pick {default})", file=sys.stderr, flush=True)
        return None if trained == "float32" else getattr(torch, trained)
    if asked:
        return None if asked == "float32" else getattr(torch, asked)
    if default == "float32" and is_main:
        where = "GPU has no native bfloat16" if device.type == "cuda" else \
            "CPU has no native bfloat16 instructions (AVX512-BF16 or AMX)"
        print(f"--amp-dtype auto: this {where}, so bfloat16 would be slower "
              "than float32; training in float32 (--amp-dtype bfloat16 forces it)", file=sys.stderr, flush=True)
    return None if default == "float32" else getattr(torch, default)


def clip_unscaled(parameters, optimizer, scaler: torch.amp.GradScaler, max_norm: float | None):
    """--clip-grad-norm under a GradScaler: the gradients unscaled first (scaler.unscale_, so that MAX bounds the true
    norm, not the scaled one; scaler.step then knows not to unscale again, and still skips a step whose gradients
    overflowed to inf/NaN), then clipped to a norm of at most max_norm. Returns their norm before clipping (None
    without max_norm: nothing done)."""
    if not max_norm:
        return None
    scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
