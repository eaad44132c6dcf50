"""Autograd of in-place ops on views (PyTorch's CopySlices semantics).

An in-place op on a view `v` of base `b` is recorded on `b` as b_new = CopySlices(b_old, op(v_old, ...)): backward
gives b's old history the gradient with v's region zeroed, and the op's output the gradient of v's region (from
there it flows through the op to v_old, which is a region of b_old again, and to the op's other inputs). Views of
`b` re-derive their grad_fn from b's (ViewOfBase) when b's history changed. Regions are described by a
ViewGeometry, so any strided view (slices with steps, transposes, reshapes, expands) of any strided base works.
"""
from .. import backend
from ..autograd.function import Function
from ..errors import fmt_shape
from ..tensor import _wrap


def _ptr(a):
    return a.data.ptr if backend.is_cuda_array(a) else a.ctypes.data


def _span(a):
    """(lowest, one past the highest) byte address the elements of array `a` occupy."""
    lo = hi = _ptr(a)
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


class ViewGeometry:
    """Where a view's elements sit in its base's storage: (shape, strides, offset) of the base and of the view, in
    elements, relative to the lowest address the base spans (`extent` elements in all)."""

    __slots__ = ("extent", "base", "view", "dense", "empty")

    def __init__(self, base_arr, view_arr):
        isz = base_arr.itemsize
        self.empty = base_arr.size == 0 or view_arr.size == 0
        self.base = (base_arr.shape, (), 0)
        self.view = (view_arr.shape, (), 0)
        self.extent, self.dense = base_arr.size, True
        if self.empty:
            return
        lo, hi = _span(base_arr)
        vlo, vhi = _span(view_arr)
        if view_arr.itemsize != isz or vlo < lo or vhi > hi or _misaligned(base_arr) or _misaligned(view_arr):
            from ..errors import AutogradError
            raise AutogradError(f"in-place op on a view of shape {fmt_shape(view_arr.shape)} whose storage is no "
                                f"longer part of its base's (shape {fmt_shape(base_arr.shape)}); was .data replaced?")
        self.extent = (hi - lo) // isz
        self.base = (base_arr.shape, _elem_strides(base_arr), (_ptr(base_arr) - lo) // isz)
        self.view = (view_arr.shape, _elem_strides(view_arr), (_ptr(view_arr) - lo) // isz)
        # the base is laid out like a fresh C-contiguous array: a gradient array is its own storage buffer
        self.dense = bool(base_arr.flags.c_contiguous) and self.extent == base_arr.size


def _elem_strides(a):
    """Strides in elements; a dimension of size 1 has no meaningful stride (NumPy may give it any), so 0."""
    return tuple(st // a.itemsize if n > 1 else 0 for n, st in zip(a.shape, a.strides))


def _misaligned(a):
    return any(st % a.itemsize for n, st in zip(a.shape, a.strides) if n > 1)


def _strided(buf, geo):
    shape, strides, off = geo
    isz = buf.itemsize
    return backend.xp_of(buf).lib.stride_tricks.as_strided(buf[off:], shape, tuple(st * isz for st in strides))


def _storage(g, geom, fresh):
    """A flat buffer laid out like the base's storage holding base-shaped array `g` (a new one unless `fresh` is
    False and `g` already is one)."""
    xp = backend.xp_of(g)
    if geom.dense:
        return (g.copy() if fresh else xp.ascontiguousarray(g)).reshape(-1)
    buf = xp.zeros(geom.extent, dtype=g.dtype)
    _strided(buf, geom.base)[...] = g
    return buf


def _as_base(buf, geom):
    if geom.dense:
        return buf.reshape(geom.base[0])
    return backend.xp_of(buf).ascontiguousarray(_strided(buf, geom.base))


class TakeRegion(Function):
    """The view's region of a base-shaped tensor (a copy)."""

    @staticmethod
    def forward(ctx, g, geom):
        ctx.geom = geom
        xp = g._xp()
        if geom.empty:
            return _wrap(xp.zeros(geom.view[0], dtype=g._data.dtype))
        return _wrap(xp.array(_strided(_storage(g._data, geom, False), geom.view)))

    @staticmethod
    def backward(ctx, gg):
        return PutRegion.apply(gg, ctx.geom), None


class PutRegion(Function):
    """A base-shaped tensor of zeros with view-shaped `g` in the view's region (summed where the view repeats an
    element, as expand does)."""

    @staticmethod
    def forward(ctx, g, geom):
        ctx.geom = geom
        a = g._data
        xp = backend.xp_of(a)
        if geom.empty:
            return _wrap(xp.zeros(geom.base[0], dtype=a.dtype))
        buf = xp.zeros(geom.extent, dtype=a.dtype)
        region = _strided(buf, geom.view)
        shape, strides, _ = geom.view
        rep = tuple(i for i, (n, st) in enumerate(zip(shape, strides)) if st == 0 and n > 1)
        if rep:  # an expanded view: every copy of an element adds its gradient to the one element
            a = a.sum(axis=rep, keepdims=True)
            region = region[tuple(slice(0, 1) if i in rep else slice(None) for i in range(len(shape)))]
        region[...] = a
        return _wrap(_as_base(buf, geom))

    @staticmethod
    def backward(ctx, gg):
        return TakeRegion.apply(gg, ctx.geom), None


class ZeroRegion(Function):
    """A base-shaped tensor with the view's region set to zero (the gradient of what an in-place op overwrote)."""

    @staticmethod
    def forward(ctx, g, geom):
        ctx.geom = geom
        if geom.empty:
            return _wrap(g._data.copy())
        buf = _storage(g._data, geom, True)
        _strided(buf, geom.view)[...] = 0
        return _wrap(_as_base(buf, geom))

    @staticmethod
    def backward(ctx, gg):
        return ZeroRegion.apply(gg, ctx.geom), None


class CopySlices(Function):
    """History of a base after an in-place op wrote `src` into the region `geom` of it (`src` None: constants, as
    zero_/fill_/copy_ of a tensor that needs no grad write; `geom` None: the whole tensor). The data is already in
    place: the output only carries the node."""

    @staticmethod
    def forward(ctx, base_old, src, geom, data):
        ctx.geom = geom
        return _carrier(data, base_old)

    @staticmethod
    def backward(ctx, g):
        geom = ctx.geom
        gb = gs = None
        if ctx.needs_input_grad[0]:
            gb = ZeroRegion.apply(g, geom) if geom is not None else _wrap(g._xp().zeros_like(g._data))
        if ctx.needs_input_grad[1]:
            gs = TakeRegion.apply(g, geom) if geom is not None else g
        return gb, gs, None, None


class ViewOfBase(Function):
    """A view re-attached to its base's current history: its gradient goes to its region of the base."""

    @staticmethod
    def forward(ctx, base, geom, data):
        ctx.geom = geom
        return _carrier(data, base)

    @staticmethod
    def backward(ctx, g):
        return PutRegion.apply(g, ctx.geom), None, None


def _carrier(data, like):
    """A throwaway tensor over existing `data` (no new memory) that only carries a node out of Function.apply."""
    t = like._alias()
    t._data = data
    return t


def _with_history(t):
    """A detached alias of `t` carrying `t`'s current autograd edge (the 'old' side of a new node)."""
    a = t._alias()
    a._grad_fn, a._out_idx, a._requires_grad = t._grad_fn, t._out_idx, t._requires_grad
    return a


def view_of_base(base, view_arr):
    """The grad_fn of a view over `view_arr` of `base`, derived from the base's current history."""
    from ..autograd.grad_mode import enable_grad
    with enable_grad():
        out = ViewOfBase.apply(_with_history(base), ViewGeometry(base._data, view_arr), view_arr)
    return out._grad_fn


def record_inplace_on_base(base, view, src):
    """Record on `base` that an in-place op wrote `src` (a Tensor with history, or None for constants) into the
    storage of `view` (a view of `base`, or `base` itself); views of `base` then derive their history again."""
    geom = None if view is base else ViewGeometry(base._data, view._data)
    out = CopySlices.apply(_with_history(base), src, geom, base._data)
    base._grad_fn, base._out_idx = out._grad_fn, 0
    base._graph_gen += 1
