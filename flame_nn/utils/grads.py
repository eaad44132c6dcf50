"""Gradient storage helpers that know the gradient pool: zero_grads (one memset per flat buffer when the pool owns
the gradients) and grad_arrays (the fewest arrays that hold a set of parameters' gradients)."""
from flame_core.tensor import Tensor

try:
    from flame_core import grad_pool as _pool
except ImportError:  # gradient pool not in this build: per-tensor gradients
    _pool = None


def as_list(parameters):
    """A tensor or an iterable of tensors, as a list."""
    if isinstance(parameters, Tensor):
        return [parameters]
    return list(parameters)


def zero_grads(parameters, set_to_none=True):
    """Reset gradients: `.grad = None`, or zero them in place (pooled gradients: one fill per flat buffer)."""
    params = as_list(parameters)
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
        buf = _pool.buffer_of(p) if _pool.is_registered(p) else None
        if buf is not None and buf.resident:   # (a lazy buffer without storage holds no gradient: not allocated)
            flat = buf.tensor
            off, n = _pool.slice_of(p)
            if g.numel() == n and g.data_ptr() == flat.data_ptr() + off * flat.itemsize:
                by_buf.setdefault(id(buf), (buf, []))[1].append(p)
                continue
        arrays.append(g.array)
    for buf, members in by_buf.values():   # (only these buffers' slots are counted: no walk over every buffer)
        if len(buf.live_slots()) == len(members):
            arrays.append(buf.tensor.array)  # gaps between slices are zero: the norm is unchanged
        else:
            arrays.extend(p._grad.array for p in members)
    return arrays
