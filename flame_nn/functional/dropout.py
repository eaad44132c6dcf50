"""dropout: zero each element with probability p and scale the survivors by 1/(1-p) (training only);
dropout1d / 2d / 3d: the same per channel; alpha_dropout / feature_alpha_dropout: SELU's self-normalising form."""
import math
import warnings

from flame_core.autograd import no_grad
from flame_core.ops.creation import rand
from flame_core.ops.dropout import fused_dropout


def _drop(input, p, inplace, mask_shape, generator):
    """input times a mask of `mask_shape` (broadcast over the input): 0 with probability p, else 1 / (1 - p). On cuda
    an elementwise (not in-place) dropout is one kernel (flame_core.ops.dropout: the same numbers)."""
    if not inplace and mask_shape == tuple(input.shape):
        out = fused_dropout(input, p, generator)
        if out is not None:
            return out
    with no_grad():
        keep = rand(mask_shape, dtype=input.dtype if input.dtype.itemsize >= 4 else None, device=input.device,
                    generator=generator) >= p
        scale = keep.to(input.dtype) * (0.0 if p == 1.0 else 1.0 / (1.0 - p))
    if inplace:
        return input.mul_(scale)
    return input * scale


def _check_p(name, p):
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}dropout probability has to be between 0 and 1, but got {p}")


def dropout(input, p=0.5, training=True, inplace=False, generator=None):
    _check_p("", p)
    if not training or p == 0.0:
        return input
    return _drop(input, p, inplace, tuple(input.shape), generator)


def _feature_dropout(name, input, p, training, inplace, dims, generator=None):
    """Whole channels zeroed with probability p, the kept ones scaled by 1 / (1 - p): one draw per (sample, channel)
    of an input (N, C, *spatial) with `dims` spatial dimensions, or (C, *spatial) unbatched."""
    _check_p(f"{name}: ", p)
    if input.ndim not in (dims + 1, dims + 2):
        raise ValueError(f"{name}: expected a {dims + 1}-D (unbatched) or {dims + 2}-D input, got shape "
                         f"{tuple(input.shape)}")
    if not training or p == 0.0:
        return input
    return _drop(input, p, inplace, tuple(input.shape[:input.ndim - dims]) + (1,) * dims, generator)


def dropout1d(input, p=0.5, training=True, inplace=False, generator=None):
    """Channel dropout of (N, C, L) or (C, L)."""
    return _feature_dropout("dropout1d", input, p, training, inplace, 1, generator)


def dropout2d(input, p=0.5, training=True, inplace=False, generator=None):
    """Channel dropout of (N, C, H, W). A 3-D input is read as (N, C, L), with PyTorch's warning (PyTorch's present
    behaviour: one draw per (sample, channel) of its first two dimensions)."""
    if input.ndim == 3:
        warnings.warn("dropout2d: Received a 3D input to dropout2d and assuming that channel-wise 1D dropout behavior "
                      "is desired - input is interpreted as shape (N, C, L), where C is the channel dim. To maintain "
                      "the 1D channel-wise dropout behavior, please switch to using dropout1d instead.",
                      UserWarning, stacklevel=2)
        return _feature_dropout("dropout2d", input, p, training, inplace, 1, generator)
    return _feature_dropout("dropout2d", input, p, training, inplace, 2, generator)


def dropout3d(input, p=0.5, training=True, inplace=False, generator=None):
    """Channel dropout of (N, C, D, H, W) or (C, D, H, W)."""
    return _feature_dropout("dropout3d", input, p, training, inplace, 3, generator)


# alpha dropout (Klambauer et al. 2017): a dropped unit takes SELU's negative saturation -scale * alpha, then an affine
# map a x + b restores zero mean and unit variance; PyTorch's constants
_SELU_SATURATION = 1.7580993408473766


def _alpha_drop(name, input, p, training, inplace, mask_shape):
    _check_p(f"{name}: ", p)
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    a = 1.0 / math.sqrt((_SELU_SATURATION ** 2 * p + 1.0) * (1.0 - p))
    with no_grad():
        keep = (rand(mask_shape, dtype=input.dtype, device=input.device) >= p).to(input.dtype)
        shift = (keep - 1.0) * (_SELU_SATURATION * a) + _SELU_SATURATION * a * p
        keep = keep * a
    return input.mul_(keep).add_(shift) if inplace else input * keep + shift


def alpha_dropout(input, p=0.5, training=False, inplace=False):
    """Each element kept with probability 1 - p, else set to SELU's saturation value, then a x + b: the input's
    mean and variance are kept for SELU activations (identity in eval or at p = 0)."""
    return _alpha_drop("alpha_dropout", input, p, training, inplace, tuple(input.shape))


def feature_alpha_dropout(input, p=0.5, training=False, inplace=False):
    """alpha_dropout of whole channels: one draw per (sample, channel) of an input (N, C, *)."""
    if training and 0.0 < p <= 1.0 and input.ndim < 2:
        raise ValueError(f"feature_alpha_dropout: Feature dropout requires at least 2 dimensions in the input, got "
                         f"shape {tuple(input.shape)}")
    return _alpha_drop("feature_alpha_dropout", input, p, training, inplace,
                       tuple(input.shape[:2]) + (1,) * (input.ndim - 2))
