"""CpuSyncBatchNorm on 2 ranks x half a batch == BatchNorm2d on the whole batch."""
import torch
from distributed_helpers import on_ranks
from torch import nn

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
