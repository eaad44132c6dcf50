"""InstanceNorm1d / 2d / 3d with PyTorch's defaults (no affine, no running statistics), parameters, buffers and
state_dict keys (as BatchNorm's). Batched or unbatched inputs; with track_running_stats the running statistics are
used in eval mode. momentum=None leaves them where they are (PyTorch passes 0 then; instance norm counts no
batches)."""
import warnings

from .. import functional as F
from .batchnorm import _BatchNorm


class _InstanceNorm(_BatchNorm):
    _spatial = 0

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False, device=None,
                 dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def forward(self, input):
        n = self._spatial
        if input.ndim not in (n + 1, n + 2):
            raise ValueError(f"{type(self).__name__}: expected {n + 1}D (unbatched) or {n + 2}D input (got "
                             f"{input.ndim}D input of shape {tuple(input.shape)})")
        batched = input.ndim == n + 2
        x = input if batched else input.unsqueeze(0)
        if x.shape[1] != self.num_features:
            if self.affine:
                raise ValueError(f"{type(self).__name__}: expected input's size at dim 1 ({x.shape[1]}) to match "
                                 f"num_features ({self.num_features})")
            warnings.warn(f"{type(self).__name__}: input's size at dim 1 ({x.shape[1]}) does not match num_features "
                          f"({self.num_features}); with affine=False it is not used", UserWarning, stacklevel=2)
        use_stats = self.training or not self.track_running_stats
        y = F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias, use_stats,
                            0.0 if self.momentum is None else self.momentum, self.eps)
        return y if batched else y.squeeze(0)


class InstanceNorm1d(_InstanceNorm):
    """Input (N, C, L) or (C, L)."""
    _spatial = 1


class InstanceNorm2d(_InstanceNorm):
    """Input (N, C, H, W) or (C, H, W)."""
    _spatial = 2


class InstanceNorm3d(_InstanceNorm):
    """Input (N, C, D, H, W) or (C, D, H, W)."""
    _spatial = 3
