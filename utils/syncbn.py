"""SyncBatchNorm: batch statistics over the global batch instead of each rank's share of it.

On GPUs the scripts use torch.nn.SyncBatchNorm. It refuses CPU modules under DDP ("SyncBatchNorm layers
only work with GPU modules"), so for gloo runs CpuSyncBatchNorm below does the same arithmetic with
two all-reduces per layer: the per-channel statistics in forward, the gradient sums in backward.
It subclasses BatchNorm2d, so its state_dict keys are BatchNorm's and checkpoints move freely
between CPU runs, GPU runs and plain BatchNorm.
"""
import torch
import torch.distributed as dist
from torch import nn

from utils import collectives


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics span all ranks of the default process group.

    In eval mode, or in a world of one, it is plain BatchNorm2d and communicates nothing."""

    process_group = None  # None: the default group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        if not self.training or world == 1:
            return super().forward(x)
        self._check_input_dim(x)
        y, mean, var, count = _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps, self.process_group)
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum=None means a cumulative average, as in BatchNorm
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """torch.nn.SyncBatchNorm.convert_sync_batchnorm for CPU modules. Call it on every rank after
        init_process_group: the statistics go over a process group of its own, because a DDP comm hook
        (PowerSGD) issues all-reduces from callback threads, and on a shared group their order against
        these would differ between ranks (a collective mismatch). It waits for a rank as long as the default group
        does (--dist-timeout), not torch's 30 minutes for a new group."""
        group = collectives.new_group_like_world() if dist.is_available() and dist.is_initialized() else None
        return cls.convert(module, group)

    @classmethod
    def convert(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Each BatchNorm2d replaced by a CpuSyncBatchNorm with its values, dtype and device, synchronised over
        `process_group`."""
        if isinstance(module, nn.BatchNorm2d) and not isinstance(module, cls):
            like = module.weight if module.affine else module.running_mean  # a float64 model stays float64
            new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      **({"dtype": like.dtype, "device": like.device} if like is not None else {}))
            new.load_state_dict(module.state_dict())
            new.train(module.training)
            new.process_group = process_group
            return new
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child, process_group))
        return module


class _SyncBatchNormFunction(torch.autograd.Function):
    """Statistics and weights in float32 (float64 for float64 input) whatever x's dtype. torch's CPU
    batch-norm kernels take bfloat16 or float16 input with float32 statistics and weights, computing in
    float32 inside, so under autocast the activations are never copied to float32 (which cost 3x
    BatchNorm's time in bfloat16): only the small correction of the input gradient is done in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        n, channels = x.numel() // x.size(1), x.size(1)
        dtype = torch.promote_types(x.dtype, torch.float32)  # of the statistics and the weights
        # this rank's per-channel mean and (biased) variance by torch's batch-norm statistics kernel, one
        # pass and about 5x faster on the CPU than torch.var_mean over the same dimensions; it returns them
        # in the dtype of the running statistics it is given (here scratch ones, left as they are: momentum 0)
        mean, var = (m.double() for m in torch.batch_norm_update_stats(
            x, torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype), 0.0))
        # One all-reduce of [n, n*mean, n*(var + mean^2)], in float64 from the first operation: the
        # global variance is E[x^2] - mean^2, which cancels when |mean| >> std, and in float32 the
        # variance would be rounded away (off by 1e-3 at mean = 1000 std).
        stats = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=x.device), n * mean,
                           n * (var + mean * mean)])
        dist.all_reduce(stats, group=group)
        count = stats[0]
        mean64 = stats[1:1 + channels] / count
        var64 = (stats[1 + channels:] / count - mean64 * mean64).clamp_min(0)
        mean, var = mean64.to(dtype), var64.to(dtype)
        invstd = torch.rsqrt(var + eps)
        if weight is None:  # affine=False: the same arithmetic with weight 1 and bias 0
            weight_, bias_ = torch.ones_like(mean), torch.zeros_like(mean)
        else:
            weight_, bias_ = weight.to(dtype), bias.to(dtype)
        # the normalisation itself is torch's fused kernel in its eval form, given the global statistics
        y = torch.batch_norm(x, weight_, bias_, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight_, mean, var, invstd)
        ctx.group, ctx.eps, ctx.weight_dtype = group, eps, None if weight is None else weight.dtype
        ctx.count = count  # a tensor: read back to Python, it would cost a host read in every layer and step
        count = count.float().view(1)
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var, _grad_count):
        x, weight, mean, var, invstd = ctx.saved_tensors
        # torch's fused backward of training-mode BatchNorm, given the global mean and invstd, returns
        # the local sums sum(dy * xhat) and sum(dy) (as the weight and bias gradients) and an input
        # gradient that centres dy with the means of this rank's share only; corrected below.
        grad_x, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_y, x, weight, None, None, mean, invstd, True, ctx.eps, [True, True, True])
        # Each rank holds the gradient of its own loss; the input gradient needs the sums over all
        # ranks. The weight and bias gradients stay local: DDP averages them with the others.
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums, group=ctx.group)
        global_dy, global_dy_xhat = sums.chunk(2)
        # grad_x += weight * invstd * (a + xhat * b), a and b the local minus the global means of dy
        # and dy * xhat, xhat = (x - mean) * invstd
        local = x.numel() // x.size(1)
        a = sum_dy / local - global_dy / ctx.count
        b = sum_dy_xhat / local - global_dy_xhat / ctx.count
        if x.dtype == mean.dtype:  # float32, float64: in place, as offset + x * slope per channel
            shape = [1, x.size(1)] + [1] * (x.dim() - 2)
            slope = weight * invstd * invstd * b
            grad_x.addcmul_(x, slope.view(shape)).add_((weight * invstd * a - slope * mean).view(shape))
        else:  # bfloat16, float16: there x * slope would be rounded before the offset cancels most of it, so
            # BatchNorm's eval form, computing in float32, with weight * invstd * b and weight * invstd * a
            grad_x += torch.batch_norm(x, weight * invstd * b, weight * invstd * a, mean, var, False, 0.0, ctx.eps,
                                       False)
        grad_weight = sum_dy_xhat.to(ctx.weight_dtype) if ctx.weight_dtype and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.weight_dtype) if ctx.weight_dtype and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None
