"""Parameter initialisation with PyTorch's names and formulas. Every function works in place under no_grad, returns
its tensor, and leaves meta placeholders (built under empty_init) untouched: weights loaded later are never drawn."""
import math
import warnings

import numpy as np

import flame_core as flame
from flame_core.autograd import no_grad

from .parameter import is_meta


def calculate_gain(nonlinearity, param=None):
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
              "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor):
    if tensor.ndim < 2:
        raise ValueError(f"fan in and fan out can not be computed for a tensor with fewer than 2 dimensions "
                         f"(shape {tuple(tensor.shape)})")
    receptive = 1
    for s in tensor.shape[2:]:
        receptive *= s
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _fan(tensor, mode):
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor, a=0.0, b=1.0, generator=None):
    if not is_meta(tensor):
        with no_grad():
            tensor.uniform_(a, b, generator=generator)
    return tensor


def normal_(tensor, mean=0.0, std=1.0, generator=None):
    if not is_meta(tensor):
        with no_grad():
            tensor.normal_(mean, std, generator=generator)
    return tensor


def constant_(tensor, val):
    if not is_meta(tensor):
        with no_grad():
            tensor.fill_(val)
    return tensor


def zeros_(tensor):
    return constant_(tensor, 0.0)


def ones_(tensor):
    return constant_(tensor, 1.0)


def xavier_uniform_(tensor, gain=1.0, generator=None):
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -a, a, generator)


def xavier_normal_(tensor, gain=1.0, generator=None):
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    fan = _fan(tensor, mode)
    if fan == 0:
        return tensor
    bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(fan)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    fan = _fan(tensor, mode)
    if fan == 0:
        return tensor
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(fan), generator)


def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """Normal(mean, std) truncated to [a, b] by redrawing the samples that fall outside."""
    if is_meta(tensor):
        return tensor
    with no_grad():
        tensor.normal_(mean, std, generator=generator)
        for _ in range(100):
            bad = (tensor < a) | (tensor > b)
            if not bool(bad.any()):
                break
            redraw = tensor.new_empty(tuple(tensor.shape)).normal_(mean, std, generator=generator)
            tensor.copy_(flame.where(bad, redraw, tensor))
        tensor.clamp_(a, b)
    return tensor


def orthogonal_(tensor, gain=1.0, generator=None):
    """A (semi-)orthogonal matrix over the tensor viewed as (size(0), numel / size(0)), times `gain`: the Q of a QR
    of a standard normal draw, signs fixed by diag(R) (PyTorch's recipe). The QR runs in NumPy float64 on the
    host (an init-time cost)."""
    if tensor.ndim < 2:
        raise ValueError(f"orthogonal_: only tensors with 2 or more dimensions are supported, got shape "
                         f"{tuple(tensor.shape)}")
    if is_meta(tensor) or tensor.numel() == 0:
        return tensor
    rows = tensor.shape[0]
    cols = tensor.numel() // rows
    with no_grad():
        draw = tensor.new_empty((rows, cols)).normal_(0.0, 1.0, generator=generator).numpy().astype(np.float64)
        if rows < cols:
            draw = draw.T
        q, r = np.linalg.qr(draw)
        q = q * np.sign(np.diag(r))
        if rows < cols:
            q = q.T
        tensor.copy_(flame.tensor(np.ascontiguousarray(q * gain).reshape(tuple(tensor.shape)), dtype=tensor.dtype,
                                  device=tensor.device))
    return tensor


def dirac_(tensor, groups=1):
    """The identity convolution: a 3-, 4- or 5-D weight (out, in, *kernel) of zeros with a 1 at the kernel centre
    of channel d -> d, for the min(out / groups, in) first channels of each of the `groups` output groups."""
    if tensor.ndim not in (3, 4, 5):
        raise ValueError("Only tensors with 3, 4, or 5 dimensions are supported")
    if tensor.shape[0] % groups != 0:
        raise ValueError("dim 0 must be divisible by groups")
    if is_meta(tensor):
        return tensor
    per_group = tensor.shape[0] // groups
    channels = np.arange(min(per_group, tensor.shape[1]))
    out = (np.arange(groups)[:, None] * per_group + channels).reshape(-1)
    centre = tuple(s // 2 for s in tensor.shape[2:])
    with no_grad():
        tensor.zero_()
        index = tuple(flame.tensor(i, device=tensor.device) for i in (out, np.tile(channels, groups)))
        tensor[index + centre] = 1
    return tensor


def eye_(tensor):
    """The identity matrix (ones on the main diagonal of a 2-D tensor of any shape)."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    if not is_meta(tensor):
        with no_grad():
            tensor.copy_(flame.eye(*tensor.shape, dtype=tensor.dtype, device=tensor.device))
    return tensor


def sparse_(tensor, sparsity, std=0.01, generator=None):
    """A 2-D tensor drawn from Normal(0, std) with ceil(sparsity * rows) random entries of every column set to 0."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    if is_meta(tensor):
        return tensor
    rows, cols = tensor.shape
    with no_grad():
        tensor.normal_(0.0, std, generator=generator)
        zeros = min(math.ceil(sparsity * rows), rows)
        if zeros:
            # a random permutation of the rows per column: the order of uniform draws
            order = flame.rand(rows, cols, generator=generator, device=tensor.device).argsort(dim=0)
            tensor.scatter_(0, order[:zeros], 0.0)
    return tensor


def _deprecated(new):
    """PyTorch's old name of `new` (its trailing underscore dropped): calls it after a FutureWarning."""
    old = new.__name__[:-1]

    def alias(*args, **kwargs):
        warnings.warn(f"`nn.init.{old}` is now deprecated in favor of `nn.init.{new.__name__}`.", FutureWarning,
                      stacklevel=2)
        return new(*args, **kwargs)

    alias.__name__, alias.__qualname__ = old, old
    alias.__doc__ = f"Deprecated: use {new.__name__}."
    return alias


normal = _deprecated(normal_)
uniform = _deprecated(uniform_)
constant = _deprecated(constant_)
xavier_uniform = _deprecated(xavier_uniform_)
xavier_normal = _deprecated(xavier_normal_)
kaiming_uniform = _deprecated(kaiming_uniform_)
kaiming_normal = _deprecated(kaiming_normal_)
orthogonal = _deprecated(orthogonal_)
eye = _deprecated(eye_)
dirac = _deprecated(dirac_)
sparse = _deprecated(sparse_)
