"""In-place ops and the version counter: what autograd forbids (PyTorch's rules), recording an in-place op on a
tensor or on a view's base, the no-grad fast path of add_ / mul_ / ..., and the in-place Tensor methods."""
from .. import backend
from .. import dtypes as D
from ..autograd.function import broadcast_error
from ..autograd.grad_mode import state
from ..errors import AutogradError, DTypeError
from ..tensor import Tensor, _wrap
from .promotion import _F8, _fp8_storage_only


def _validate_inplace(t):
    """Raise for the in-place ops autograd forbids (PyTorch's rules); only matters while grad is recorded."""
    if not state.enabled:
        return
    if t._requires_grad and t._grad_fn is None:
        raise AutogradError(f"a leaf tensor of shape {tuple(t.shape)} that requires grad is being used in an "
                            f"in-place operation (wrap it in flame.no_grad() or use an out-of-place op)")
    base = t._base
    if base is None:
        return
    if base._requires_grad and base._grad_fn is None:
        raise AutogradError(f"a view of a leaf tensor that requires grad is being used in an in-place operation "
                            f"(view of shape {tuple(t.shape)}, leaf of shape {tuple(base.shape)}); wrap it in "
                            f"flame.no_grad() or use an out-of-place op")
    if t._grad_fn is None and base.requires_grad:
        raise AutogradError(f"a view of shape {tuple(t.shape)} was created in no_grad mode and is being modified "
                            f"in-place with grad mode enabled; its base (shape {tuple(base.shape)}) requires grad, so "
                            f"the change could not be tracked. Make the view with grad mode enabled, or modify it "
                            f"under no_grad")
    if 0 in t._data.strides:
        from ..errors import ShapeError
        if any(st == 0 and n > 1 for n, st in zip(t._data.shape, t._data.strides)):
            raise ShapeError(f"in-place op on an expanded tensor of shape {tuple(t.shape)}: more than one element "
                             f"refers to the same memory location; clone() it first")


def _check_inplace(t):
    """Before an in-place op that overwrites `t` with values that don't depend on its old ones and need no grad
    (zero_, fill_, uniform_, normal_, copy_ of a constant): validate, and record the overwrite for autograd (the
    gradient of what was overwritten is zero; views and the base see the change)."""
    _validate_inplace(t)
    if not state.enabled:
        return
    base = t._base
    if base is None:
        if t._grad_fn is not None:
            from .views import record_inplace_on_base
            record_inplace_on_base(t, t, None)
    elif base.requires_grad:
        from .views import record_inplace_on_base
        record_inplace_on_base(base, t, None)


def apply_inplace(t, fn, *args):
    """t <- fn(t, *args) in t's own storage (views see it); recorded for autograd when grads flow.

    On a view, the op is recorded on the base (CopySlices): backward through the base, or through any view of it,
    sees the change."""
    _validate_inplace(t)
    recording = state.enabled and (t._grad_fn is not None or any(
        isinstance(a, Tensor) and a.requires_grad for a in args))
    if recording:
        prev = _wrap(t._data.copy())  # the old value, for the new node's backward
        prev._grad_fn, prev._out_idx, prev._requires_grad = t._grad_fn, t._out_idx, t._requires_grad
        out = fn(prev, *args)
    else:
        from ..autograd.grad_mode import no_grad
        with no_grad():
            out = fn(t, *args)
    res = out._data
    if res.dtype != t._data.dtype:
        if D.promote_types(D.dtype_of(res.dtype), t.dtype) != t.dtype:
            raise DTypeError(f"result type {D.dtype_of(res.dtype)} can't be cast to the desired output type "
                             f"{t.dtype} of an in-place op")
        res = res.astype(t._data.dtype)
    if res.shape != t._data.shape:
        from ..errors import ShapeError
        raise ShapeError(f"output with shape {tuple(t.shape)} doesn't match the broadcast shape {res.shape}")
    t._data[...] = res
    t._version[0] += 1
    if recording:
        base = t._base
        t._grad_fn, t._out_idx = out._grad_fn, out._out_idx
        if base is not None:
            from .views import record_inplace_on_base
            record_inplace_on_base(base, t, out)
            if out._grad_fn is not None:
                t._gen = base._graph_gen  # t's new history (out's) is current; other views of base derive theirs
        else:
            t._graph_gen += 1  # views of t taken earlier derive their history again
    return t


def _fast_inplace(t, ufunc_name, other):
    """No-grad fast path for add_/mul_/...: one ufunc with out=, no temporary."""
    if state.enabled:
        if t.requires_grad or (isinstance(other, Tensor) and other.requires_grad):
            return None
        if t._base is not None:
            _validate_inplace(t)
    xo = other._data if isinstance(other, Tensor) else other
    if t._f8 or t._data.dtype is _F8:
        _fp8_storage_only(ufunc_name)
    if isinstance(other, Tensor):
        if other._f8 or xo.dtype is _F8:
            _fp8_storage_only(ufunc_name)
        if type(xo) is not type(t._data):
            return None
        if xo.dtype != t._data.dtype:
            if D.promote_types(other.dtype, t.dtype) != t.dtype:
                return None
            xo = xo.astype(t._data.dtype)
    elif not isinstance(other, (int, float, bool)) or (isinstance(other, float) and t._data.dtype.kind != "f"
                                                          and t._data.dtype != D.bfloat16.np):
        return None
    try:
        getattr(backend.xp_of(t._data), ufunc_name)(t._data, xo, out=t._data)
    except ValueError as e:
        if "broadcast" not in str(e):
            raise
        raise broadcast_error(f"{ufunc_name}_", (t, other), e) from e
    t._version[0] += 1
    return t



# ----------------------------------------------------------------------------- the in-place Tensor methods
def _inplace(ufunc_name, fn):
    def method(self, other, *args, **kwargs):
        if not args and not kwargs:
            r = _fast_inplace(self, ufunc_name, other)
            if r is not None:
                return r
        return apply_inplace(self, lambda t, o: fn(t, o, *args, **kwargs), other)
    method.__name__ = fn.__name__ + "_"
    return method


def zero_(self):
    _check_inplace(self)
    self._data.fill(0)
    self._version[0] += 1  # _check_inplace recorded the overwrite: gradients behind it are zero (PyTorch)
    return self


def fill_(self, value):
    _check_inplace(self)
    if isinstance(value, Tensor):
        value = value.item()
    self._data.fill(value)
    self._version[0] += 1
    return self


def copy_(self, src, non_blocking=False):
    if isinstance(src, Tensor) and src.requires_grad and state.enabled:
        from .conversion import CopyFrom
        return apply_inplace(self, lambda t, s: CopyFrom.apply(t, s), src)
    _check_inplace(self)
    a = src._data if isinstance(src, Tensor) else src
    if isinstance(src, Tensor) and type(a) is not type(self._data):
        a = backend.to_numpy(a) if not backend.is_cuda_array(self._data) else backend.xp_of(
            self._data).asarray(a)
    self._data[...] = a.astype(self._data.dtype, copy=False) if hasattr(a, "astype") else a
    self._version[0] += 1
    return self


def uniform_(self, a=0.0, b=1.0, generator=None):
    from .creation import rand
    _check_inplace(self)
    r = rand(self.shape, dtype=self.dtype, device=self.device, generator=generator)
    self._data[...] = (r._data * (b - a) + a).astype(self._data.dtype)
    self._version[0] += 1
    return self


def normal_(self, mean=0.0, std=1.0, generator=None):
    from .creation import randn
    _check_inplace(self)
    r = randn(self.shape, dtype=self.dtype, device=self.device, generator=generator)
    self._data[...] = (r._data * std + mean).astype(self._data.dtype)
    self._version[0] += 1
    return self


def install_methods(T, plain):
    """Install the in-place Tensor methods; `plain` maps method names to their out-of-place ops."""
    from . import elementwise as E
    from . import indexing as I
    T.add_ = _inplace("add", lambda t, o, alpha=1: E.add(t, o, alpha=alpha))
    T.sub_ = _inplace("subtract", lambda t, o, alpha=1: E.sub(t, o, alpha=alpha))
    T.mul_ = _inplace("multiply", E.mul)
    T.div_ = _inplace("true_divide", E.div)
    T.pow_ = _inplace("power", E.pow)
    T.clamp_ = lambda self, min=None, max=None: apply_inplace(self, lambda t: E.clamp(t, min, max))
    T.lerp_ = lambda self, end, weight: apply_inplace(self, lambda t, e: E.lerp(t, e, weight), end)
    T.masked_fill_ = lambda self, mask, value: apply_inplace(self, lambda t: I.masked_fill(t, mask, value))
    for name in ("exp", "log", "sqrt", "neg", "abs", "sigmoid", "tanh", "relu", "floor", "round", "sign", "sin",
                 "cos", "rsqrt", "reciprocal", "silu", "square"):
        setattr(T, name + "_", (lambda f: lambda self: apply_inplace(self, f))(plain[name]))
    T.zero_, T.fill_, T.copy_, T.uniform_, T.normal_ = zero_, fill_, copy_, uniform_, normal_
