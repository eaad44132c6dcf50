"""Shape ops. Views (reshape of contiguous data, permute, expand, squeeze, narrow, ...) share storage and version."""
import builtins

import numpy as np

from .. import backend
from .. import memory_formats as MF
from ..autograd.function import Function
from ..autograd.grad_mode import is_grad_enabled
from ..errors import ShapeError, fmt_shape
from ..kernels import copy_rows as _copy_rows
from ..kernels import loader as _kernels
from ..tensor import Tensor, _view_of, _wrap, check_same_device
from .dtype_view import view_dtype


def _norm_dim(d, ndim, op):
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise IndexError(f"{op}: dimension {d} out of range for a tensor of {ndim} dims")
    return d % max(ndim, 1)


def _size_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    for s in shape:  # a tuple of ints (the common case) is used as it is
        if type(s) is not int:
            return tuple(int(s) for s in shape)
    return shape if type(shape) is tuple else tuple(shape)


def _infer(shape, numel, op, in_shape):
    if -1 not in shape:  # the common case: every size given; their product must be numel
        n = 1
        for s in shape:
            n *= s
        if n == numel:
            return shape
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"{op}: only one dimension can be inferred, got {shape}")
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        if known == 0 or numel % known:
            raise ShapeError(f"{op}: shape {fmt_shape(shape)} is invalid for input of size {numel} "
                             f"(shape {fmt_shape(in_shape)})")
        shape[shape.index(-1)] = numel // known
    n = 1
    for s in shape:
        n *= s
    if n != numel:
        raise ShapeError(f"{op}: shape {fmt_shape(shape)} is invalid for input of size {numel} "
                         f"(shape {fmt_shape(in_shape)})")
    return tuple(shape)


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape, need_view):
        a = x._data
        ctx.in_shape = a.shape
        if a.flags.c_contiguous:
            return _view_of(a.reshape(shape), x)
        if need_view:
            if backend.is_cuda_array(a):
                raise ShapeError(f"view size is not compatible with input tensor's size and stride (shape "
                                 f"{fmt_shape(a.shape)}); use .reshape(...) instead")
            v = a.view()
            try:
                v.shape = shape
            except AttributeError:
                raise ShapeError(f"view size is not compatible with input tensor's size and stride (shape "
                                 f"{fmt_shape(a.shape)} -> {fmt_shape(shape)}); use .reshape(...) instead") from None
            return _view_of(v, x)
        r = a.reshape(shape)  # a view when the strides allow one (NumPy and CuPy decide), else a copy
        return _view_of(r, x) if backend.xp_of(a).may_share_memory(r, a) else _wrap(r)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.in_shape), None, None


def reshape(x, *shape):
    return _reshaped(x, _infer(_size_arg(shape), x._data.size, "reshape", x._data.shape))


def _reshaped(x, shape):
    """reshape to `shape`, a tuple of ints with x's element count (checked by the caller, or so by construction)."""
    if shape == x._data.shape and not x.requires_grad:
        return _view_of(x._data, x)
    return Reshape.apply(x, shape, False)


def ravel(x):
    """x flattened to 1-D (a view where the strides allow, as reshape)."""
    return reshape(x, -1)


def view(x, *shape):
    if len(shape) == 1 and not isinstance(shape[0], (tuple, list, int)):
        return view_dtype(x, shape[0])  # the same bytes as another dtype
    shape = _infer(_size_arg(shape), x.numel(), "view", x.shape)
    return Reshape.apply(x, shape, True)


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return reshape(x, 1)
    s = _norm_dim(start_dim, x.ndim, "flatten")
    e = _norm_dim(end_dim, x.ndim, "flatten")
    if s > e:
        raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    shape = x._data.shape
    n = 1
    for d in shape[s:e + 1]:
        n *= d
    return _reshaped(x, shape[:s] + (n,) + shape[e + 1:])


def unflatten(x, dim, sizes):
    d = _norm_dim(dim, x.ndim, "unflatten")
    sizes = _infer(tuple(sizes), x.shape[d], "unflatten", x.shape)
    return reshape(x, tuple(x.shape[:d]) + sizes + tuple(x.shape[d + 1:]))


class Permute(Function):
    @staticmethod
    def forward(ctx, x, perm):
        ctx.perm = perm
        return _view_of(x._data.transpose(perm), x)

    @staticmethod
    def backward(ctx, g):
        inv = [0] * len(ctx.perm)
        for i, p in enumerate(ctx.perm):
            inv[p] = i
        return g.permute(*inv), None


# Argument tuples -> what they name, per view op: an eager model calls permute / transpose / expand with a few fixed
# argument tuples, so each op's checks run once per tuple (arguments that cannot be hashed, a list say, every time)
_PERMS = {}        # (dims as given, ndim) -> permute's permutation
_TRANSPOSES = {}   # (ndim, dim0, dim1) -> transpose's permutation
_EXPANDS = {}      # (sizes as given, x's shape) -> expand's shape
_MEMO_MAX = 1024


def _remember(cache, key, value):
    """value, kept in cache under key (the cache emptied past _MEMO_MAX entries; an unhashable key keeps nothing)."""
    try:
        if len(cache) >= _MEMO_MAX:
            cache.clear()
        cache[key] = value
    except TypeError:
        pass
    return value


def _permutation(x, dims, nd):
    dims = _size_arg(dims)
    if len(dims) != nd:
        raise ShapeError(f"permute: number of dims {len(dims)} doesn't match the tensor's {nd} dims "
                         f"(shape {fmt_shape(x._data.shape)})")
    perm = tuple(_norm_dim(d, nd, "permute") for d in dims)
    if sorted(perm) != list(range(nd)):
        raise ShapeError(f"permute: dims {dims} are not a permutation of {nd} dims")
    return perm


def permute(x, *dims):
    key = (dims, x._data.ndim)
    try:
        perm = _PERMS[key]
    except (KeyError, TypeError):
        perm = _remember(_PERMS, key, _permutation(x, dims, key[1]))
    return Permute.apply(x, perm)


def _swap(nd, dim0, dim1):
    p = list(range(nd))
    a, b = _norm_dim(dim0, nd, "transpose"), _norm_dim(dim1, nd, "transpose")
    p[a], p[b] = p[b], p[a]
    return tuple(p)


def transpose(x, dim0, dim1):
    nd = x._data.ndim
    if nd == 0:
        return x
    key = (nd, dim0, dim1)
    try:
        perm = _TRANSPOSES[key]
    except (KeyError, TypeError):
        perm = _remember(_TRANSPOSES, key, _swap(nd, dim0, dim1))
    return Permute.apply(x, perm)


swapaxes = transpose
swapdims = transpose


def matrix_h(x):
    """Tensor.H: a matrix's conjugate transpose -- its transpose, FLAME having no complex dtypes; 2-D only."""
    if x.ndim != 2:
        raise ShapeError(f".H is only supported on matrices (2-D tensors), got {x.ndim}-D")
    return transpose(x, 0, 1)


def t(x):
    if x.ndim > 2:
        raise ShapeError(f"t() expects a tensor with <= 2 dims, got shape {fmt_shape(x.shape)}")
    return transpose(x, 0, 1) if x.ndim == 2 else x


def squeeze(x, dim=None):
    if dim is None:
        shape = tuple(s for s in x.shape if s != 1)
    else:
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        dims = {_norm_dim(d, x.ndim, "squeeze") for d in dims}
        shape = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return _reshaped(x, shape) if shape != tuple(x.shape) else x


def unsqueeze(x, dim):
    shape = x._data.shape
    nd = len(shape) + 1
    if not -nd <= dim < nd:
        raise IndexError(f"unsqueeze: dimension {dim} out of range for a tensor of {nd - 1} dims")
    d = dim % nd
    return _reshaped(x, shape[:d] + (1,) + shape[d:])


class Expand(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.in_shape = x._data.shape
        xp = backend.xp_of(x._data)
        return _view_of(xp.broadcast_to(x._data, shape), x)

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        return sum_to(g, ctx.in_shape), None


def expand(x, *sizes):
    shape = x._data.shape
    key = (sizes, shape)
    try:
        out = _EXPANDS[key]
    except (KeyError, TypeError):
        out = _remember(_EXPANDS, key, _expanded_shape(x, sizes))
    return x if out == shape else Expand.apply(x, out)


def _expanded_shape(x, sizes):
    sizes = _size_arg(sizes)
    if len(sizes) < x.ndim:
        raise ShapeError(f"expand: the number of sizes {len(sizes)} must be >= the tensor's dims {x.ndim}")
    lead = len(sizes) - x.ndim
    out = []
    for i, s in enumerate(sizes):
        if i < lead:
            if s < 0:
                raise ShapeError(f"expand: -1 not allowed in a leading, non-existing dimension ({sizes})")
            out.append(s)
            continue
        cur = x.shape[i - lead]
        if s == -1:
            s = cur
        if cur != s and cur != 1:
            raise ShapeError(f"expand: the expanded size of the tensor ({s}) must match the existing size ({cur}) "
                             f"at non-singleton dimension {i}. Target sizes: {list(sizes)}. Tensor sizes: "
                             f"{list(x.shape)}")
        out.append(s)
    return tuple(out)


def expand_as(x, other):
    return expand(x, tuple(other.shape))


def broadcast_to(x, shape):
    return expand(x, tuple(shape))


def broadcast_shapes(*shapes):
    return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))


class Repeat(Function):
    @staticmethod
    def forward(ctx, x, reps):
        a = x._data
        lead = len(reps) - a.ndim
        a = a.reshape((1,) * lead + a.shape)
        ctx.shape = a.shape
        ctx.reps = reps
        ctx.in_shape = x._data.shape
        return _wrap(backend.xp_of(a).tile(a, reps))

    @staticmethod
    def backward(ctx, g):
        inter = []
        for r, s in zip(ctx.reps, ctx.shape):
            inter += [r, s]
        gs = g.reshape(tuple(inter)).sum(dim=tuple(range(0, 2 * len(ctx.reps), 2)))
        return gs.reshape(ctx.in_shape), None


def repeat(x, *reps):
    reps = _size_arg(reps)
    if len(reps) < x.ndim:
        raise ShapeError(f"repeat: number of repeat dims {len(reps)} can not be smaller than the tensor's dims "
                         f"{x.ndim}")
    return Repeat.apply(x, reps)


def repeat_interleave(x, repeats, dim=None, *, output_size=None):
    """Each element repeated `repeats` times along dim (the flattened x when dim is None): an int, or one count per
    element (a tensor / sequence of x.shape[dim] non-negative ints; through index_select, which carries the
    gradient). output_size, when given, must equal the result's size along dim (PyTorch uses it to skip a sync)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    d = _norm_dim(dim, x.ndim, "repeat_interleave")
    if isinstance(repeats, Tensor):
        repeats = repeats.item() if repeats.numel() == 1 else repeats.to("cpu").numpy()
    if not isinstance(repeats, (int, np.integer)):
        reps = np.asarray(repeats)
        n = x.shape[d]
        if reps.ndim != 1 or reps.shape[0] != n or reps.dtype.kind not in "iu":
            raise ShapeError(f"repeat_interleave: repeats must be {n} integers (x's size along dim {d}), got shape "
                             f"{fmt_shape(reps.shape)} of {reps.dtype}")
        if (reps < 0).any():
            raise ValueError("repeat_interleave: repeats can not be negative")
        idx = np.repeat(np.arange(n, dtype=np.int64), reps)
        if output_size is not None and int(output_size) != idx.size:
            raise ValueError(f"repeat_interleave: output_size {output_size} is not the result's size {idx.size}")
        from .creation import tensor
        from .indexing import index_select
        return index_select(x, d, tensor(idx, device=x.device))
    if repeats < 0:
        raise ValueError("repeat_interleave: repeats can not be negative")
    if output_size is not None and int(output_size) != x.shape[d] * int(repeats):
        raise ValueError(f"repeat_interleave: output_size {output_size} is not the result's size "
                         f"{x.shape[d] * int(repeats)}")
    y = x.unsqueeze(d + 1)
    shape = list(y.shape)
    shape[d + 1] = int(repeats)
    y = y.expand(tuple(shape))
    out = list(x.shape)
    out[d] *= int(repeats)
    return y.reshape(tuple(out))


class Narrow(Function):
    @staticmethod
    def forward(ctx, x, dim, start, length):
        idx = [slice(None)] * x.ndim
        idx[dim] = slice(start, start + length)
        ctx.idx, ctx.shape = tuple(idx), x._data.shape
        return _view_of(x._data[tuple(idx)], x)

    @staticmethod
    def backward(ctx, g):
        from .indexing import ScatterInto
        return ScatterInto.apply(g, ctx.idx, ctx.shape), None, None, None


def narrow(x, dim, start, length):
    d = _norm_dim(dim, x.ndim, "narrow")
    if isinstance(start, Tensor):
        start = int(start.item())
    if start < 0:
        start += x.shape[d]
    if start < 0 or length < 0 or start + length > x.shape[d]:
        raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size ({x.shape[d]}) of "
                         f"dim {d} (shape {fmt_shape(x.shape)})")
    return Narrow.apply(x, d, start, length)


def select(x, dim, index):
    d = _norm_dim(dim, x.ndim, "select")
    n = x.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select: index {index} out of range for dimension {d} of size {n}")
    return squeeze(narrow(x, d, index % n, 1), d)


def chunk(x, chunks, dim=0):
    d = _norm_dim(dim, x.ndim, "chunk")
    n = x.shape[d]
    if not n:   # PyTorch: `chunks` empty pieces
        return split(x, [0] * chunks, d)
    return split(x, -(-n // chunks), d)


def split(x, split_size_or_sections, dim=0):
    d = _norm_dim(dim, x.ndim, "split")
    n = x.shape[d]
    if isinstance(split_size_or_sections, int):
        s = split_size_or_sections
        if s <= 0:
            raise ValueError(f"split: split_size must be positive, got {s}")
        sizes = [s] * (n // s) + ([n % s] if n % s else []) if n else [0]   # an empty dim: one empty piece
    else:
        sizes = list(split_size_or_sections)
        if builtins.sum(sizes) != n:
            raise ShapeError(f"split: sizes {sizes} don't sum to dimension {d} of size {n}")
    return Split.apply(x, d, tuple(sizes))


class Split(Function):
    """Views of x cut along `dim` into pieces of `sizes`, recorded as one node whose backward is one concatenation
    (a node per piece would scatter each piece's gradient into a full-size zero tensor)."""

    @staticmethod
    def forward(ctx, x, dim, sizes):
        ctx.dim = dim
        a, lead, out, start = x._data, (slice(None),) * dim, [], 0
        for n in sizes:
            out.append(_view_of(a[lead + (slice(start, start + n),)], x))
            start += n
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return cat(grads, dim=ctx.dim), None, None


def tensor_split(x, sections, dim=0):
    d = _norm_dim(dim, x.ndim, "tensor_split")
    n = x.shape[d]
    q, r = divmod(n, sections)
    return split(x, [q + 1] * r + [q] * (sections - r), d)


def unbind(x, dim=0):
    return Unbind.apply(x, _norm_dim(dim, x.ndim, "unbind"))


class Unbind(Function):
    """The slices x[..., i, ...] along `dim` as views, in one node (backward: one stack)."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        a, lead = x._data, (slice(None),) * dim
        return tuple(_view_of(a[lead + (i, Ellipsis)], x) for i in range(a.shape[dim]))  # `...`: 0-d stays an array

    @staticmethod
    def backward(ctx, *grads):
        return stack(grads, dim=ctx.dim), None


class Flip(Function):
    @staticmethod
    def forward(ctx, x, dims):
        ctx.dims = dims
        return _wrap(backend.xp_of(x._data).flip(x._data, axis=dims).copy())

    @staticmethod
    def backward(ctx, g):
        return flip(g, ctx.dims), None


def flip(x, dims):
    dims = tuple(_norm_dim(d, x.ndim, "flip") for d in (dims if isinstance(dims, (list, tuple)) else (dims,)))
    return Flip.apply(x, dims)


class Roll(Function):
    @staticmethod
    def forward(ctx, x, shifts, dims):
        ctx.shifts, ctx.dims = shifts, dims
        return _wrap(backend.xp_of(x._data).roll(x._data, shifts, axis=dims))

    @staticmethod
    def backward(ctx, g):
        neg = tuple(-s for s in ctx.shifts) if isinstance(ctx.shifts, tuple) else -ctx.shifts
        return Roll.apply(g, neg, ctx.dims), None, None


def roll(x, shifts, dims=None):
    if isinstance(shifts, list):
        shifts = tuple(shifts)
    if isinstance(dims, list):
        dims = tuple(dims)
    return Roll.apply(x, shifts, dims)


class Tri(Function):
    @staticmethod
    def forward(ctx, x, k, upper):
        ctx.k, ctx.upper = k, upper
        xp = backend.xp_of(x._data)
        return _wrap((xp.triu if upper else xp.tril)(x._data, k))

    @staticmethod
    def backward(ctx, g):
        return Tri.apply(g, ctx.k, ctx.upper), None, None


def tril(x, diagonal=0):
    return Tri.apply(x, diagonal, False)


def triu(x, diagonal=0):
    return Tri.apply(x, diagonal, True)


class Contiguous(Function):
    """A copy of x in memory format fmt (x's values and shape; only the strides differ). The gradient passes as is."""
    @staticmethod
    def forward(ctx, x, fmt):
        out = _wrap(MF.to_format(x._data, fmt, copy=True))
        out._f8 = x._f8
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def contiguous(x, memory_format=MF.contiguous_format):
    """x when it is already contiguous in memory_format (flame.contiguous_format or flame.channels_last, 4-D), else a
    copy that is."""
    fmt = MF.check(memory_format, "contiguous", allow_preserve=False)
    return x if MF.is_contiguous(x._data, fmt) else Contiguous.apply(x, fmt)


def is_contiguous(x, memory_format=MF.contiguous_format):
    """Whether x lies in memory contiguously in memory_format (flame.contiguous_format or flame.channels_last)."""
    return MF.is_contiguous(x._data, MF.check(memory_format, "is_contiguous", allow_preserve=False))


class Clone(Contiguous):
    """clone's node (the copy Contiguous makes, under torch's name)."""


def clone(x, memory_format=MF.preserve_format):
    """A copy of x. memory_format: flame.preserve_format (the default: channels-last stays channels-last, anything
    else becomes contiguous), flame.contiguous_format or flame.channels_last (4-D)."""
    fmt = MF.check(memory_format, "clone")
    return Clone.apply(x, MF.suggested(x._data) if fmt is MF.preserve_format else fmt)


_CAT_DIRECT = 8  # arrays one xp.concatenate joins (see Cat.forward)


def _join(dim, xs, arrs):
    """The arrays `arrs` (of the tensors xs) joined along their existing axis `dim` (cat's and stack's forward)."""
    dt = arrs[0].dtype
    f8 = xs[0]._f8
    mixed = False
    for a, x in zip(arrs, xs):   # a loop, not any(<generator>): this is every cat's and stack's per-op path
        if a.dtype != dt or x._f8 != f8:
            mixed = True
            break
    if mixed:
        from .. import dtypes as D
        res = xs[0].dtype
        for x in xs[1:]:
            res = D.promote_types(res, x.dtype)
        if builtins.any(x.dtype is D.float8_e4m3fn for x in xs):
            from .promotion import _fp8_storage_only
            _fp8_storage_only("cat of float8_e4m3fn with another dtype")
        arrs = [a.astype(res.np) for a in arrs]
    xp = backend.xp_of(arrs[0])
    if xp is not np and _kernels.enabled():  # row-block copies (kernels/copy_rows.py)
        out = _wrap(_copy_rows.cat(arrs, dim))
    elif len(arrs) <= _CAT_DIRECT:
        out = _wrap(xp.concatenate(arrs, axis=dim))
    else:  # CuPy joins more arrays through an address table copied from host memory, which a CUDA graph
        # capture refuses (a split's backward into 9+ pieces is such a join): each piece is copied into its slice
        shape = list(arrs[0].shape)
        shape[dim] = builtins.sum(a.shape[dim] for a in arrs)
        res = xp.empty(tuple(shape), dtype=arrs[0].dtype)
        at = [slice(None)] * res.ndim
        start = 0
        for a in arrs:
            n = a.shape[dim]
            at[dim] = slice(start, start + n)
            res[tuple(at)] = a
            start += n
        out = _wrap(res)
    if f8:  # cuda float8 bytes stay float8
        out._f8 = True
    return out


class Cat(Function):
    @staticmethod
    def forward(ctx, dim, *xs):
        ctx.sizes = [x._data.shape[dim] for x in xs]
        ctx.dim = dim
        return _join(dim, xs, [x._data for x in xs])

    @staticmethod
    def backward(ctx, g):
        return (None,) + split(g, ctx.sizes, ctx.dim)


class Stack(Function):
    """stack as one node: the arrays joined along a new axis (views with a unit axis there, no unsqueeze nodes);
    the backward hands each input its slice of the gradient (a view)."""

    @staticmethod
    def forward(ctx, dim, *xs):
        ctx.dim, ctx.n = dim, len(xs)
        at = (slice(None),) * dim + (None,)
        return _join(dim, xs, [x._data[at] for x in xs])

    @staticmethod
    def backward(ctx, g):
        if is_grad_enabled():   # create_graph: Tensor ops, which record
            return (None,) + tuple(g.select(ctx.dim, i) for i in range(ctx.n))
        gd = g._data
        pre = (slice(None),) * ctx.dim
        return (None,) + tuple(_wrap(gd[pre + (i,)]) for i in range(ctx.n))


def cat(tensors, dim=0):
    tensors = list(tensors)
    shapes = [t._data.shape for t in tensors]   # plain tuples (no Size objects): the checks below read these
    if len(tensors) > 1 and (0,) in shapes:   # PyTorch's legacy rule: an empty 1-D tensor joins anything
        kept = [(t, sh) for t, sh in zip(tensors, shapes) if sh != (0,)]
        if kept:
            tensors, shapes = [t for t, _ in kept], [sh for _, sh in kept]
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    check_same_device("cat", *tensors)
    ref = shapes[0]
    nd = len(ref)
    d = _norm_dim(dim, nd, "cat")
    for i, sh in enumerate(shapes):
        if sh != ref and (len(sh) != nd or sh[:d] != ref[:d] or sh[d + 1:] != ref[d + 1:]):
            raise ShapeError(f"cat: sizes of tensors must match except in dimension {d}; tensor 0 has shape "
                             f"{fmt_shape(ref)}, tensor {i} has shape {fmt_shape(sh)}")
    return Cat.apply(d, *tensors)


concat = cat
concatenate = cat


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    ref = tensors[0]._data.shape
    for i, t_ in enumerate(tensors):
        if t_._data.shape != ref:
            raise ShapeError(f"stack expects each tensor to be equal size, but got {fmt_shape(ref)} at entry 0 "
                             f"and {fmt_shape(t_._data.shape)} at entry {i}")
    nd = len(ref) + 1
    if not -nd <= dim < nd:
        raise IndexError(f"stack: dimension {dim} out of range for {nd} dims")
    d = dim % nd
    check_same_device("stack", *tensors)
    return Stack.apply(d, *tensors)


def movedim(x, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src = [_norm_dim(s, x.ndim, "movedim") for s in src]
    dst = [_norm_dim(s, x.ndim, "movedim") for s in dst]
    order = [i for i in range(x.ndim) if i not in src]
    for d_, s_ in sorted(zip(dst, src)):
        order.insert(d_, s_)
    return permute(x, *order)
