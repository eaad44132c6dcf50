"""BatchNorm1d / 2d / 3d with PyTorch's parameters, buffers (running_mean, running_var, num_batches_tracked) and
state_dict keys.

momentum=None keeps a cumulative average: the running statistics move by 1 / num_batches_tracked each step.
"""
import flame_core as flame

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module


class _BatchNorm(Module):
    _dims = ()

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None,
                 dtype=None, *, bias=True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = new_parameter((num_features,), dtype, device)
            self.register_parameter("bias", new_parameter((num_features,), dtype, device) if bias else None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            dt = self.weight.dtype if affine else dtype
            self.register_buffer("running_mean", flame.zeros(num_features, dtype=dt, device=device))
            self.register_buffer("running_var", flame.ones(num_features, dtype=dt, device=device))
            self.register_buffer("num_batches_tracked", flame.tensor(0, dtype=flame.int64, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self):
        if self.track_running_stats:
            with flame.no_grad():
                self.running_mean.zero_()
                self.running_var.fill_(1.0)
                self.num_batches_tracked.zero_()

    def reset_parameters(self):
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def _check_input_dim(self, input):
        if input.ndim not in self._dims:
            want = " or ".join(f"{d}D" for d in self._dims)
            raise ValueError(f"{type(self).__name__}: expected {want} input (got {input.ndim}D input of shape "
                             f"{tuple(input.shape)})")
        if input.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}: expected {self.num_features} channels in dim 1, got input of "
                             f"shape {tuple(input.shape)}")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with flame.no_grad():
                self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked.item()) if self.momentum is None else self.momentum
        # batch statistics in training, and in eval when there are no running statistics to use
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return F.batch_norm(input, self.running_mean if track else None, self.running_var if track else None,
                            self.weight, self.bias, use_batch, factor, self.eps)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Input (N, C) or (N, C, L)."""
    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Input (N, C, H, W)."""
    _dims = (4,)


class BatchNorm3d(_BatchNorm):
    """Input (N, C, D, H, W)."""
    _dims = (5,)
