"""Why tensor parallelism does not fit ResNet's convolutions: what torch does with each of ResNet-18's kinds of
convolution when asked to split it over 2 ranks, run and measured (docs/sharding.md).

    python -m benchmarks.tensor_parallel                 # 2 CPU processes over gloo: about 10 s
    python -m benchmarks.tensor_parallel --device cuda   # 2 GPUs over NCCL

Tensor parallelism splits a layer's weights: torch's ColwiseParallel and RowwiseParallel (the Megatron split of a
transformer's Linear layers) split a weight matrix by its rows or columns, so each rank holds and multiplies half.
For a convolution, torch's DTensor offers other splits: of the images by batch (data parallelism) or by width (each
rank a strip of columns, the strips' edges exchanged), always with the whole weight on every rank. Each case below
runs a convolution of the CIFAR ResNet-18 (its shapes: a batch of 8) as a DTensor forward and backward, compares
output and gradients with one process's, and counts what the ranks send (every collective and point-to-point
message that reaches torch's dispatcher) and the weight bytes each rank holds.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from benchmarks import harness

RANKS = 2
BATCH = 8
# (case, layer of ResNet-18, what is split): each layer's convolution as resnet18_cifar builds it
CASES = [
    ("ColwiseParallel, the Linear split", "layer1.0.conv1", "the weight by output channel, as ColwiseParallel"),
    ("weight split by output channel", "layer1.0.conv1", "the weight by output channel (Shard(0)), images whole"),
    ("images split by batch", "layer2.0.conv1", "the images by batch (Shard(0)), the weight whole"),
    ("images split by width, 3x3 stride 1", "layer1.0.conv1", "the images by width (Shard(3)), the weight whole"),
    ("images split by width, 3x3 stride 2", "layer2.0.conv1", "the images by width (Shard(3)), the weight whole"),
    ("images split by width, 1x1 stride 2", "layer2.0.downsample.0",
     "the images by width (Shard(3)), the weight whole"),
]
WIDTH = 32  # the input of layer1 and layer2.0 in a 32x32 image (the CIFAR stem keeps the size; layer2.0 halves it)


class Sent:
    """What a rank sends while on: DTensor's collectives, counted by torch's CommDebugMode, and the point-to-point
    messages of a convolution's edge exchange (dist.batch_isend_irecv, wrapped: CommDebugMode does not see them)."""

    def __init__(self):
        self.calls, self.p2p_bytes = {}, 0

    def __enter__(self):
        self.mode, self.original = CommDebugMode(), dist.batch_isend_irecv

        def counted(ops):
            sends = [op.tensor for op in ops if op.op is dist.isend]
            self.calls["send"] = self.calls.get("send", 0) + len(sends)
            self.p2p_bytes += sum(t.numel() * t.element_size() for t in sends)
            return self.original(ops)
        dist.batch_isend_irecv = counted
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        dist.batch_isend_irecv = self.original
        for op, n in self.mode.get_comm_counts().items():
            name = str(getattr(op, "__name__", op)).split(".")[-1].rstrip("_")
            self.calls[name] = self.calls.get(name, 0) + n


def the_layer(name: str) -> nn.Conv2d:
    from utils.models import resnet18_cifar
    torch.manual_seed(0)
    return resnet18_cifar().get_submodule(name)


def piece(tensor: torch.Tensor, placement, rank: int) -> torch.Tensor:
    """This rank's piece of a whole tensor under `placement` (a Shard(d) splits dimension d evenly; else all)."""
    if not isinstance(placement, Shard):
        return tensor
    return tensor.chunk(RANKS, dim=placement.dim)[rank]


def compared(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Right or wrong on every rank (collective: an all-reduce of the largest difference, relative to the largest
    value, over the ranks; a rank holding a piece of another shape counts as infinitely wrong)."""
    same_shape = got.shape == expected.shape
    difference = (got - expected).abs().max() / expected.abs().max() if same_shape else torch.tensor(float("inf"))
    worst = difference.detach().to(torch.float64).reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst.isinf():
        return f"wrong: a rank holds {tuple(got.shape)}, its piece is {tuple(expected.shape)}" if not same_shape \
            else "wrong: a rank holds a piece of another shape"
    return f"right ({float(worst):.0e})" if worst < 1e-4 else f"wrong ({float(worst):.0e} off)"


def run_case(case: str, layer_name: str, mesh, device: torch.device) -> dict:
    """One case on every rank: what torch does with it, forward and backward, each rank's pieces against one
    process's (relative to the largest value), what rank 0 sent and the weight bytes it held."""
    conv = the_layer(layer_name).to(device)
    rank = dist.get_rank()
    torch.manual_seed(1)
    images = torch.randn(BATCH, conv.in_channels, WIDTH, WIDTH, device=device, requires_grad=True)
    expected = conv(images)
    expected.backward(torch.ones_like(expected))  # the gradient of the output's sum
    by_weight = "output channel" in case
    weight_placement = Shard(0) if by_weight else Replicate()
    input_placement = Shard(0) if "batch" in case else Shard(3) if "width" in case else Replicate()
    output_placement = Shard(1) if by_weight else input_placement  # where each rank's part of the output lies
    result = {"case": case, "layer": layer_name, "split": dict((c[0], c[2]) for c in CASES)[case],
              "conv": f"{conv.kernel_size[0]}x{conv.kernel_size[1]} stride {conv.stride[0]} padding "
                      f"{conv.padding[0]}, {conv.in_channels}->{conv.out_channels}",
              "weight_bytes": conv.weight.numel() * conv.weight.element_size()}
    sent, step = Sent(), "split"
    try:
        if case.startswith("ColwiseParallel"):
            parallelize_module(conv, mesh, ColwiseParallel())
        weight = distribute_tensor(conv.weight.detach(), mesh, [weight_placement]).requires_grad_(True)
        x = distribute_tensor(images.detach(), mesh, [input_placement]).requires_grad_(True)
        result["weight_held"] = _local_bytes(weight)
        step = "forward"
        with sent:
            out = torch.nn.functional.conv2d(x, weight, None, conv.stride, conv.padding)
        result["output"] = f"labelled {out.placements[0]}"
        result["forward"] = compared(out.to_local(), piece(expected.detach(), output_placement, rank))
        step = "backward"
        with sent:
            out.backward(torch.ones_like(out))
            weight_grad = weight.grad.redistribute(placements=[weight_placement])  # summed over the ranks' images
        result["backward"] = "no gradient for the images" if x.grad is None else (
            "images " + compared(x.grad.to_local(), piece(images.grad, input_placement, rank)) + ", weight "
            + compared(weight_grad.to_local(), piece(conv.weight.grad, weight_placement, rank)))
    except Exception as error:  # a refusal or a failure is the finding: where, its type and its first line
        result[step if step != "split" else "refused"] = (
            f"fails: {type(error).__name__}: {str(error).strip().splitlines()[0][:110]}")
    result.update(sent_calls=sent.calls, p2p_bytes=sent.p2p_bytes)
    return result


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def rank_main(rank: int, world_size: int, port: int, device_kind: str) -> dict:
    device = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        results = [run_case(case, layer, mesh, device) for case, layer, _ in CASES]
        return {"torch": torch.__version__, "device": str(device), "rows": results}
    finally:
        dist.destroy_process_group()


def measure(device: str = "cpu") -> dict:
    """Every case on 2 spawned ranks; rank 0's findings."""
    return harness.spawn_ranks(rank_main, RANKS, device)[0]


def activations_and_weights() -> tuple[int, int, int]:
    """(ResNet-18's convolutions, the elements they output for one 32x32 image, the elements of all its weights):
    what splitting every convolution's output channels would have to gather again for the next one, against what
    DDP all-reduces."""
    from utils.models import resnet18_cifar
    model, outputs = resnet18_cifar(), []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_hook(lambda _m, _i, out: outputs.append(out.numel()))
    with torch.no_grad():
        model(torch.zeros(1, 3, WIDTH, WIDTH))
    return len(outputs), sum(outputs), sum(p.numel() for p in model.parameters())


def markdown(found: dict) -> str:
    kb = 2**10
    lines = [f"torch {found['torch']}, {RANKS} ranks ({found['device']}), a batch of {BATCH} images of "
             f"{WIDTH}x{WIDTH}. Command: `python -m benchmarks.tensor_parallel`. Right or wrong: each rank's piece "
             "against one process's, relative to the largest value.", "",
             "| asked for | layer | convolution | weight KB a rank holds (of) | forward | backward | sent by rank 0 |",
             "|---|---|---|---|---|---|---|"]
    for r in found["rows"]:
        held = f"{r['weight_held'] / kb:.0f} (of {r['weight_bytes'] / kb:.0f})" if "weight_held" in r else "-"
        calls = ", ".join(f"{n} {name}" for name, n in sorted(r["sent_calls"].items()))
        sent = (calls + (f" ({r['p2p_bytes'] / kb:.0f} KB)" if r["p2p_bytes"] else "")) if calls else "nothing"
        forward = r.get("refused") or r.get("forward", "") + (f", output {r['output']}" if "output" in r else "")
        lines.append(f"| {r['split']} | `{r['layer']}` | {r['conv']} | {held} | {forward} | {r.get('backward', '-')} "
                     f"| {sent} |")
    convolutions, activations, weights = activations_and_weights()
    lines += ["", f"ResNet-18's {convolutions} convolutions output {activations:,} values for one image "
              f"({activations * 4 / 2**20:.2f} MB in float32); its weights are {weights:,} values "
              f"({weights * 4 / 2**20:.1f} MB). Split by output channel, each convolution needs all the channels "
              f"of the one before, so its outputs would be gathered after every convolution: at a batch of 256 "
              f"they are {activations * 4 * 256 / 2**20:,.0f} MB a forward, of which each of R ranks receives "
              f"the (R-1)/R it did not compute (and their gradients again backward), against the "
              f"{weights * 4 / 2**20:.1f} MB of gradients DDP all-reduces a step."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: 2 processes over gloo (default); cuda: 2 GPUs over NCCL")
    parser.add_argument("--output", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < RANKS:
        parser.error(f"--device cuda needs {RANKS} GPUs; {torch.cuda.device_count()} visible")
    table = markdown(measure(args.device))
    if args.output:
        Path(args.output).write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
