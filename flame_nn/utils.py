"""Gradient utilities: clip_grad_norm_, clip_grad_value_, zero_grads (one memset per flat buffer when the gradient
pool owns them); parameters_to_vector / vector_to_parameters; and torch.nn.utils' weight_norm / spectral_norm
(flame_nn.norm_reparam)."""
import math

import numpy as np

from flame_core import as_tensor, backend
from flame_core.autograd import no_grad
from flame_core.errors import DeviceError, NonFiniteError
from flame_core.tensor import Tensor

from .norm_reparam import remove_spectral_norm, remove_weight_norm, spectral_norm, weight_norm  # noqa: F401

try:
    from flame_core import grad_pool as _pool
except ImportError:  # gradient pool not in this build: per-tensor gradients
    _pool = None


def _params(parameters):
    if isinstance(parameters, Tensor):
        return [parameters]
    return list(parameters)


def zero_grads(parameters, set_to_none=True):
    """Reset gradients: `.grad = None`, or zero them in place (pooled gradients: one fill per flat buffer)."""
    params = list(_params(parameters))
    if _pool is not None and hasattr(_pool, "zero_grad"):
        # set_to_none: every parameter, with a .grad or not -- a lazy gradient buffer kept while a CUDA graph wrote
        # into it (its .grad already None) is released here once that graph is gone
        params = params if set_to_none else [p for p in params if p._grad is not None]
        if params:
            _pool.zero_grad(params, set_to_none=set_to_none)
        return
    params = [p for p in params if p._grad is not None]
    for p in params:
        if set_to_none:
            p._grad = None
        else:
            g = p._grad
            g.array.fill(0)
            g._version[0] += 1
            g._grad_fn = None


def grad_arrays(params):
    """The gradient arrays of `params` (all with a .grad), as few as possible: a gradient-pool flat buffer whose every
    live parameter is among them (each .grad being its pooled view) stands in for all of their gradients."""
    if _pool is None:
        return [p._grad.array for p in params]
    arrays, by_buf = [], {}
    for p in params:
        g = p._grad
        if _pool.is_registered(p):
            flat = _pool.flat_buffer_of(p)
            off, n = _pool.slice_of(p)
            if g.numel() == n and g.data_ptr() == flat.data_ptr() + off * flat.itemsize:
                by_buf.setdefault(id(flat), (flat, []))[1].append(p)
                continue
        arrays.append(g.array)
    if by_buf:
        live = {id(b.tensor): len(b.live_slots()) for b in _pool.buffers()}
        for flat, members in by_buf.values():
            if live.get(id(flat)) == len(members):
                arrays.append(flat.array)  # gaps between slices are zero: the norm is unchanged
            else:
                arrays.extend(p._grad.array for p in members)
    return arrays


def _sq_norm_sum(arrays, norm_type):
    """Sum of |g|^p (or max |g| for inf) over arrays, in float32 or wider, on the arrays' device."""
    total = None
    for a in arrays:
        xp = backend.xp_of(a)
        acc = a if a.dtype.itemsize >= 4 else a.astype(np.float32)
        if norm_type == math.inf:
            v = xp.abs(acc).max() if acc.size else xp.zeros((), acc.dtype)
            total = v if total is None else xp.maximum(total, v.astype(total.dtype))
        else:
            # p = 2: a dot product, no temporary the size of the gradient (a LoRA's flat gradient buffer is 45 MiB on
            # SD3.5-Large; allocated after the backward in a pool at its budget, it did not fit)
            v = (xp.abs(acc) ** norm_type).sum() if norm_type != 2 else xp.vdot(acc.reshape(-1), acc.reshape(-1))
            total = v if total is None else total + v.astype(total.dtype)
    return total


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale all gradients in place so that their joint `norm_type` norm is at most `max_norm`; returns the norm
    before clipping (a 0-d tensor), as PyTorch. Pooled gradients are reduced over their flat buffers."""
    norm_type = float(norm_type)
    params = [p for p in _params(parameters) if p._grad is not None]
    if not params:
        return as_tensor(np.zeros((), dtype=np.float32))
    grads = [p._grad for p in params]
    arrays = grad_arrays(params)
    devices = {backend.is_cuda_array(a) and a.device.id for a in arrays}
    if len(devices) > 1:
        raise DeviceError("clip_grad_norm_: gradients on several devices are not supported; clip per device")
    s = _sq_norm_sum(arrays, norm_type)
    xp = backend.xp_of(s)
    total = s if norm_type == math.inf else s ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(xp.isfinite(total)):
        raise NonFiniteError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                             f"it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                             f"norm anyway, set `error_if_nonfinite=False`")
    coef = xp.minimum(max_norm / (total + 1e-6), 1.0)
    with no_grad():
        for a in arrays:
            a *= coef.astype(a.dtype)
        for g in grads:
            g._version[0] += 1
    return as_tensor(xp.asarray(total))


def clip_grad_value_(parameters, clip_value, foreach=None):
    """Clamp every gradient in place to [-clip_value, clip_value] (pooled gradients: per flat buffer)."""
    clip_value = float(clip_value)
    params = [p for p in _params(parameters) if p._grad is not None]
    if not params:
        return
    with no_grad():
        for a in grad_arrays(params):
            backend.xp_of(a).clip(a, -clip_value, clip_value, out=a)
        for p in params:
            p._grad._version[0] += 1


def _one_device(op, params):
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise DeviceError(f"{op}: found parameters on different devices ({', '.join(sorted(map(str, devices)))})")


def parameters_to_vector(parameters):
    """All parameters flattened and concatenated into one 1-D tensor (differentiable, as in PyTorch)."""
    from flame_core.ops.shape import cat
    params = _params(parameters)
    _one_device("parameters_to_vector", params)
    return cat([p.reshape(-1) for p in params])


def vector_to_parameters(vec, parameters):
    """Copy consecutive slices of the 1-D `vec` into the parameters, in order. (PyTorch makes each parameter a view of
    `vec`; here the values are copied into the parameters' own storage, which optimizers and the gradient pool hold
    on to.)"""
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected a Tensor for vec, but got {type(vec).__name__}")
    params = _params(parameters)
    _one_device("vector_to_parameters", params + [vec])
    total = sum(p.numel() for p in params)
    if vec.ndim != 1 or vec.numel() != total:
        raise ValueError(f"vector_to_parameters: vec of shape {tuple(vec.shape)} must be 1-D with {total} elements "
                         f"(the parameters' total)")
    with no_grad():
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(vec[offset:offset + n].reshape(tuple(p.shape)))
            offset += n
