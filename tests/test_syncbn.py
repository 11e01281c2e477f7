"""CpuSyncBatchNorm on 2 ranks x half a batch == BatchNorm2d on the whole batch."""
import torch
from distributed_helpers import on_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from utils.syncbn import CpuSyncBatchNorm


def batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, 6, 6, generator=g) * 3 + 2  # far from zero mean and unit variance
    upstream = torch.randn(12, 5, 6, 6, generator=g)  # a fixed gradient arriving from above
    return x, upstream


def make_bn(cls, momentum):
    torch.manual_seed(1)
    bn = cls(5, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def sync_on_rank(rank, world_size, momentum):
    x, upstream = batch()
    rows = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    bn = make_bn(CpuSyncBatchNorm, momentum)
    x_local = x[rows].clone().requires_grad_()
    for _ in range(2):  # two steps, so running statistics accumulate
        y = bn(x_local)
    (y * upstream[rows]).sum().backward()
    return {"y": y.detach(), "dx": x_local.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var, "tracked": bn.num_batches_tracked,
            "eval": bn.eval()(x[rows]).detach(), "state_keys": sorted(bn.state_dict())}


def reference(momentum):
    x, upstream = batch()
    bn = make_bn(nn.BatchNorm2d, momentum)
    x = x.clone().requires_grad_()
    for _ in range(2):
        y = bn(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, bn


def test_matches_batchnorm_over_the_whole_batch(tmp_path):
    for momentum in (0.1, None):  # None: a cumulative average
        y, dx, bn = reference(momentum)
        ranks = on_ranks(2, sync_on_rank, momentum, results_dir=tmp_path)
        close = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y, **close)
        torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), dx, **close)
        # each rank keeps its local weight gradient; DDP sums (averages) them, so the sum is BatchNorm's
        torch.testing.assert_close(sum(r["dw"] for r in ranks), bn.weight.grad, **close)
        torch.testing.assert_close(sum(r["db"] for r in ranks), bn.bias.grad, **close)
        for r in ranks:
            torch.testing.assert_close(r["running_mean"], bn.running_mean, **close)
            torch.testing.assert_close(r["running_var"], bn.running_var, **close)
            assert r["tracked"] == bn.num_batches_tracked == 2
            assert r["state_keys"] == sorted(bn.state_dict())
        torch.testing.assert_close(torch.cat([r["eval"] for r in ranks]), bn.eval()(batch()[0]), **close)


def test_convert_replaces_every_batchnorm_and_keeps_the_values():
    from utils.models import resnet18_cifar
    model = resnet18_cifar()
    model.bn1.running_mean.fill_(3.0)
    before = model.state_dict()
    converted = CpuSyncBatchNorm.convert(model)
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    assert sum(isinstance(m, CpuSyncBatchNorm) for m in converted.modules()) == 20
    after = converted.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_world_of_one_is_plain_batchnorm():
    x, _ = batch()
    torch.testing.assert_close(make_bn(CpuSyncBatchNorm, 0.1)(x), make_bn(nn.BatchNorm2d, 0.1)(x))


def low_precision_batch(shift):
    """A batch in bfloat16 (as autocast's convolutions hand it to BatchNorm), far from zero mean by `shift`."""
    x, upstream = batch()
    return (x + shift).bfloat16(), upstream.bfloat16()


class ActivationSizedResults(TorchDispatchMode):
    """The dtypes of the results of every operation that makes a tensor as large as `numel`."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.dtypes = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.dtypes |= {t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() == self.numel}
        return out


def low_precision_on_rank(rank, world_size, shift):
    x, upstream = low_precision_batch(shift)
    rows = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    bn = make_bn(CpuSyncBatchNorm, 0.1)  # float32 weights and statistics, as under autocast
    x_local = x[rows].clone().requires_grad_()
    with ActivationSizedResults(x_local.numel()) as made:
        y = bn(x_local)
        y.backward(upstream[rows])
    return {"y": y.detach(), "dx": x_local.grad, "dw": bn.weight.grad, "running_var": bn.running_var,
            "activation_dtypes": made.dtypes}


def test_bfloat16_input_keeps_the_accuracy_of_torchs_own_batchnorm(tmp_path):
    """bfloat16 activations with float32 weights, as under autocast, read and written in bfloat16: on 2 ranks
    within twice the error of torch's BatchNorm2d on the whole batch, both against float64; also 300 standard
    deviations from zero, where a correction of the input gradient rounded to bfloat16 before it is
    complete would lose it."""
    for shift in (0.0, 1000.0):
        x, upstream = low_precision_batch(shift)
        exact = make_bn(nn.BatchNorm2d, 0.1).double()
        x64 = x.double().requires_grad_()
        y64 = exact(x64)
        y64.backward(upstream.double())
        torchs = make_bn(nn.BatchNorm2d, 0.1)
        x16 = x.clone().requires_grad_()
        y16 = torchs(x16)
        y16.backward(upstream)
        ranks = on_ranks(2, low_precision_on_rank, shift, results_dir=tmp_path / str(shift))
        y, dx = torch.cat([r["y"] for r in ranks]), torch.cat([r["dx"] for r in ranks])
        assert y.dtype == dx.dtype == torch.bfloat16
        # the activations and their gradients are never copied to float32 (which tripled BatchNorm's time)
        assert all(r["activation_dtypes"] == {torch.bfloat16} for r in ranks), [r["activation_dtypes"] for r in ranks]
        for ours, theirs, reference in ((y, y16, y64), (dx, x16.grad, x64.grad)):
            error, their_error = ((t.double() - reference).abs().max().item() for t in (ours, theirs))
            assert error <= 2 * their_error + 1e-6, (shift, error, their_error)
        torch.testing.assert_close(sum(r["dw"] for r in ranks).double(), exact.weight.grad, rtol=1e-2, atol=1e-2)
        for r in ranks:
            torch.testing.assert_close(r["running_var"].double(), exact.running_var, rtol=1e-3, atol=1e-3)
