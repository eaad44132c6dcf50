"""Gradient clipping, PyTorch's torch.nn.utils.clip_grad: get_total_norm, clip_grads_with_norm_, clip_grad_norm_ (the
two in one), its deprecated alias clip_grad_norm, and clip_grad_value_. Gradients held in the gradient pool are
reduced and scaled over their flat buffers. `foreach` picks one of PyTorch's two implementations, whose results are
the same; FLAME has one, so either value gives that result."""
import math
import warnings

import numpy as np

from flame_core import as_tensor, backend
from flame_core.errors import DeviceError, NonFiniteError
from flame_core.tensor import Tensor

from .grads import as_list, grad_arrays

_CHUNK = 1 << 22   # elements: a larger gradient is reduced a slice at a time (bounded temporaries)


def _reduce(a, norm_type):
    """One array's share of the total norm, in float32 or wider: max |g| (inf), min |g| (-inf), whether any entry is
    nonzero (0: PyTorch's total is the count of tensors with a nonzero norm), or sum |g|^p. An array of more than
    _CHUNK elements is reduced slice by slice, so the float32 copy of a half-precision gradient and the product's
    temporary never exceed a slice (a full fine-tune's 57 M-element weight: 450 MiB of temporaries at once, in a pool
    held at its budget)."""
    xp = backend.xp_of(a)
    if a.size > _CHUNK:
        flat = a.reshape(-1)
        parts = [_reduce(flat[i:i + _CHUNK], norm_type) for i in range(0, flat.size, _CHUNK)]
        if norm_type == math.inf:
            return xp.stack(parts).max()
        if norm_type == -math.inf:
            return xp.stack(parts).min()
        if norm_type == 0:
            return xp.stack(parts).max()
        return xp.stack(parts).sum()
    acc = a if a.dtype.itemsize >= 4 else a.astype(np.float32)
    if norm_type == math.inf:
        return xp.abs(acc).max()
    if norm_type == -math.inf:
        return xp.abs(acc).min()
    if norm_type == 0:
        return (acc != 0).any().astype(acc.dtype)
    if norm_type == 2:
        # a dot product, no temporary the size of the gradient (a LoRA's flat gradient buffer is 45 MiB on
        # SD3.5-Large; allocated after the backward in a pool at its budget, it did not fit)
        return xp.vdot(acc.reshape(-1), acc.reshape(-1))
    return (xp.abs(acc) ** norm_type).sum()


def _total_norm(arrays, norm_type, error_if_nonfinite):
    """The `norm_type` norm of the arrays' norms (PyTorch's definition), as an array on their device."""
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return np.zeros((), dtype=np.float32)
    if len({backend.is_cuda_array(a) and a.device.id for a in arrays}) > 1:
        raise DeviceError("gradient norms: tensors on several devices are not supported; reduce per device")
    xp = backend.xp_of(arrays[0])
    parts = [_reduce(a, norm_type) for a in arrays]
    if norm_type == math.inf:
        total = xp.stack(parts).max()
    elif norm_type == -math.inf:
        total = xp.stack(parts).min()
    else:
        total = sum(parts[1:], parts[0])
        if norm_type != 0:
            total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(xp.isfinite(total)):
        raise NonFiniteError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                             f"it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                             f"norm anyway, set `error_if_nonfinite=False`")
    return xp.asarray(total)


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """The `norm_type` norm of the tensors' norms (as if all were concatenated, for norm_type != 0), a 0-d tensor."""
    return as_tensor(_total_norm([t.array for t in as_list(tensors)], float(norm_type), error_if_nonfinite))


def _with_grad(parameters):
    return [p for p in as_list(parameters) if p._grad is not None]


def _scale_(params, arrays, coef):
    """Multiply the gradient arrays of `params` by the 0-d array `coef` (on their device), in place."""
    for a in arrays:
        a *= coef.astype(a.dtype)
    for p in params:
        p._grad._version[0] += 1


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """Scale the gradients in place by min(max_norm / (total_norm + 1e-6), 1), `total_norm` from get_total_norm."""
    if not isinstance(total_norm, Tensor):
        raise TypeError(f"clip_grads_with_norm_: total_norm must be a Tensor (get_total_norm's result), got "
                        f"{type(total_norm).__name__}")
    params = _with_grad(parameters)
    if not params:
        return
    arrays = grad_arrays(params)
    total = total_norm.to(params[0].device).array
    _scale_(params, arrays, backend.xp_of(total).minimum(max_norm / (total + 1e-6), 1.0))


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale all gradients in place so that their joint `norm_type` norm is at most `max_norm`; returns the norm
    before clipping (a 0-d tensor), as PyTorch."""
    norm_type = float(norm_type)
    params = _with_grad(parameters)
    if not params:
        return as_tensor(np.zeros((), dtype=np.float32))
    # norm_type 0 counts tensors: a flat buffer must not stand for several
    arrays = grad_arrays(params) if norm_type != 0 else [p._grad.array for p in params]
    total = _total_norm(arrays, norm_type, error_if_nonfinite)
    _scale_(params, arrays, backend.xp_of(total).minimum(max_norm / (total + 1e-6), 1.0))
    return as_tensor(total)


def clip_grad_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Deprecated alias of clip_grad_norm_ (a FutureWarning, as PyTorch)."""
    warnings.warn("`flame_nn.utils.clip_grad_norm` is now deprecated in favor of `flame_nn.utils.clip_grad_norm_`.",
                  FutureWarning, stacklevel=2)
    return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(parameters, clip_value, foreach=None):
    """Clamp every gradient in place to [-clip_value, clip_value] (pooled gradients: per flat buffer)."""
    clip_value = float(clip_value)
    params = _with_grad(parameters)
    if not params:
        return
    for a in grad_arrays(params):
        backend.xp_of(a).clip(a, -clip_value, clip_value, out=a)
    for p in params:
        p._grad._version[0] += 1
