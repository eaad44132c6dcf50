"""max_pool2d (with return_indices), max_unpool2d, avg_pool2d, adaptive_avg_pool2d on (N, C, H, W) or (C, H, W).

Windows are visited as KH*KW strided slices of the padded input (no index arrays): the forward reduces them, the
backward adds the gradient back through the same slices (overlapping windows accumulate). max_unpool2d scatters each
value to its flat index in a zero plane and gathers the gradient back.
"""

import numpy as np

from .. import backend
from .. import dtypes as flame_dtypes
from ..autograd.function import Function
from ..errors import ShapeError, fmt_shape
from ..tensor import _wrap


def _pair(v, name):
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(a) for a in v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v}")
    return v


def _out_size(n, k, s, p, d, ceil_mode):
    eff = d * (k - 1) + 1
    num = n + 2 * p - eff
    o = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (o - 1) * s >= n + p:  # the last window must start inside the input or its left padding
        o -= 1
    return o


def _geometry(op, x, kernel_size, stride, padding, dilation, ceil_mode):
    if x.ndim != 4:
        raise ShapeError(f"{op}: expected input (N, C, H, W), got {fmt_shape(x.shape)}")
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride if stride is not None and stride != () else (kh, kw), "stride")
    ph, pw = _pair(padding, "padding")
    dh, dw = _pair(dilation, "dilation")
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"{op}: padding {ph, pw} should be at most half of the kernel size {kh, kw}")
    H, W = x.shape[2:]
    OH, OW = _out_size(H, kh, sh, ph, dh, ceil_mode), _out_size(W, kw, sw, pw, dw, ceil_mode)
    if OH < 1 or OW < 1:
        raise ShapeError(f"{op}: input {fmt_shape(x.shape)} is too small for kernel {kh, kw} with padding {ph, pw}")
    # right/bottom padding that ceil_mode windows may read past the input
    eh = max(0, (OH - 1) * sh + dh * (kh - 1) + 1 - (H + 2 * ph))
    ew = max(0, (OW - 1) * sw + dw * (kw - 1) + 1 - (W + 2 * pw))
    return dict(kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, OH=OH, OW=OW, eh=eh, ew=ew)


def _window(a, g, i, j):
    """The (N, C, OH, OW) slice of padded array `a` read by kernel offset (i, j)."""
    h0, w0 = i * g["dh"], j * g["dw"]
    return a[:, :, h0:h0 + g["sh"] * (g["OH"] - 1) + 1:g["sh"], w0:w0 + g["sw"] * (g["OW"] - 1) + 1:g["sw"]]


def _pad(xp, a, g, value):
    return xp.pad(a, ((0, 0), (0, 0), (g["ph"], g["ph"] + g["eh"]), (g["pw"], g["pw"] + g["ew"])),
                  constant_values=value)


def _unpad(a, g, H, W):
    return a[:, :, g["ph"]:g["ph"] + H, g["pw"]:g["pw"] + W]


class MaxPool2d(Function):
    """The window's largest value, its first position in row-major order; a NaN wins, the window's last one (PyTorch's
    `val > max || isnan(val)` scan), which is also where the gradient goes. With return_indices also the flat
    position (h * W + w, int64) of each maximum in its input plane."""

    @staticmethod
    def forward(ctx, x, g, return_indices=False):
        a = x._data
        xp = backend.xp_of(a)
        low = -np.inf if a.dtype.kind in "fV" else np.iinfo(a.dtype).min
        ap = _pad(xp, a, g, low)
        best = _window(ap, g, 0, 0).copy()
        arg = xp.zeros(best.shape, dtype=np.int32)
        for i in range(g["kh"]):
            for j in range(g["kw"]):
                if i == j == 0:
                    continue
                v = _window(ap, g, i, j)
                better = (v > best) | xp.isnan(v)  # NaN propagates, as in PyTorch
                best = xp.where(better, v, best)
                arg = xp.where(better, np.int32(i * g["kw"] + j), arg)
        flat = None
        if g["ph"] or g["pw"] or g["eh"] or g["ew"] or return_indices:
            arg, flat = _inside(xp, arg, g, *a.shape[2:])
        ctx.g, ctx.shape, ctx.arg = g, a.shape, arg
        ctx.padded_shape = ap.shape
        if not return_indices:
            return _wrap(best)
        idx = _wrap(flat)
        ctx.mark_non_differentiable(idx)
        return _wrap(best), idx

    @staticmethod
    def backward(ctx, gy, _g_indices=None):
        g, arg = ctx.g, ctx.arg
        ga = gy._data
        xp = backend.xp_of(ga)
        acc = np.float32 if ga.dtype.itemsize < 4 else ga.dtype
        d = xp.zeros(ctx.padded_shape, dtype=acc)
        for i in range(g["kh"]):
            for j in range(g["kw"]):
                _window(d, g, i, j)[...] += xp.where(arg == i * g["kw"] + j, ga, 0).astype(acc)
        return _wrap(_unpad(d, g, *ctx.shape[2:]).astype(ga.dtype)), None, None


def _inside(xp, arg, g, H, W):
    """(arg, flat): the window offsets `arg` (i * kw + j) with every offset outside the input -- a window whose values
    are all the padding's -inf keeps its first offset -- replaced by the window's first offset inside the input
    (PyTorch's choice, for the index and the gradient), and the input positions h * W + w (int64) they name."""
    kw, dh, dw = g["kw"], g["dh"], g["dw"]
    oh = (xp.arange(g["OH"]) * g["sh"] - g["ph"]).reshape(-1, 1)
    ow = (xp.arange(g["OW"]) * g["sw"] - g["pw"]).reshape(1, -1)
    i, j = arg // kw, arg % kw
    h, w = oh + i * dh, ow + j * dw
    inside = (h >= 0) & (h < H) & (w >= 0) & (w < W)
    i0 = xp.maximum((dh - 1 - oh) // dh, 0)  # PyTorch: while (h < 0) h += dh
    j0 = xp.maximum((dw - 1 - ow) // dw, 0)
    arg = xp.where(inside, arg, (i0 * kw + j0).astype(arg.dtype))
    h = xp.where(inside, h, oh + i0 * dh)
    w = xp.where(inside, w, ow + j0 * dw)
    return arg, (h * W + w).astype(np.int64)


class AvgPool2d(Function):
    @staticmethod
    def forward(ctx, x, g, count_include_pad, divisor_override):
        a = x._data
        xp = backend.xp_of(a)
        acc = np.float32 if a.dtype.itemsize < 4 else a.dtype
        ap = _pad(xp, a.astype(acc, copy=False), g, 0)
        s = xp.zeros((a.shape[0], a.shape[1], g["OH"], g["OW"]), dtype=acc)
        for i in range(g["kh"]):
            for j in range(g["kw"]):
                s += _window(ap, g, i, j)
        div = _divisor(xp, a.shape, g, count_include_pad, divisor_override, acc)
        ctx.g, ctx.shape, ctx.div = g, a.shape, div
        return _wrap((s / div).astype(a.dtype))

    @staticmethod
    def backward(ctx, gy):
        g = ctx.g
        ga = gy._data
        xp = backend.xp_of(ga)
        gd = ga.astype(ctx.div.dtype) / ctx.div
        N, C, H, W = ctx.shape
        d = xp.zeros((N, C, H + 2 * g["ph"] + g["eh"], W + 2 * g["pw"] + g["ew"]), dtype=gd.dtype)
        for i in range(g["kh"]):
            for j in range(g["kw"]):
                _window(d, g, i, j)[...] += gd
        return _wrap(_unpad(d, g, H, W).astype(ga.dtype)), None, None, None


def _divisor(xp, shape, g, count_include_pad, divisor_override, dt):
    """Per-output divisor (OH, OW): the window size, or the count of elements inside input (+ padding)."""
    if divisor_override:
        return xp.asarray(float(divisor_override), dtype=dt)
    H, W = shape[2:]
    ones = xp.zeros((1, 1, H + 2 * g["ph"] + g["eh"], W + 2 * g["pw"] + g["ew"]), dtype=dt)
    if count_include_pad:  # the padding counts, the ceil_mode overhang past it does not
        ones[:, :, :H + 2 * g["ph"], :W + 2 * g["pw"]] = 1
    else:
        ones[:, :, g["ph"]:g["ph"] + H, g["pw"]:g["pw"] + W] = 1
    cnt = xp.zeros((1, 1, g["OH"], g["OW"]), dtype=dt)
    for i in range(g["kh"]):
        for j in range(g["kw"]):
            cnt += _window(ones, g, i, j)
    return cnt


def _batched(fn, input, *args):
    if input.ndim == 3:
        out = fn(input.unsqueeze(0), *args)
        return tuple(t.squeeze(0) for t in out) if isinstance(out, tuple) else out.squeeze(0)
    return fn(input, *args)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """PyTorch's max_pool2d; with return_indices=True, (output, indices): each maximum's flat position h * W + w in
    its (H, W) input plane, int64 (what max_unpool2d takes)."""
    def run(x):
        g = _geometry("max_pool2d", x, kernel_size, stride, padding, dilation, ceil_mode)
        return MaxPool2d.apply(x, g, bool(return_indices))
    return _batched(run, input)


class MaxUnpool2d(Function):
    """Each input value written at its index in a zero (out_h, out_w) plane; the gradient gathered back from there.
    Repeated indices: one of the values lands (PyTorch leaves which undefined)."""

    @staticmethod
    def forward(ctx, x, indices, out_hw):
        a, ia = x._data, indices._data
        xp = backend.xp_of(a)
        N, C = a.shape[:2]
        rows = N * C
        flat = ia.reshape(rows, -1)
        out = xp.zeros((rows, out_hw[0] * out_hw[1]), dtype=a.dtype)
        out[xp.arange(rows)[:, None], flat] = a.reshape(rows, -1)
        ctx.flat, ctx.shape = flat, a.shape
        return _wrap(out.reshape(N, C, *out_hw))

    @staticmethod
    def backward(ctx, gy):
        g = gy._data
        xp = backend.xp_of(g)
        g = g.reshape(g.shape[0] * g.shape[1], -1)
        return _wrap(g[xp.arange(g.shape[0])[:, None], ctx.flat].reshape(ctx.shape)), None, None


def max_unpool2d(input, indices, kernel_size, stride=None, padding=0, output_size=None):
    """PyTorch's max_unpool2d: the inverse of max_pool2d(return_indices=True) -- input (N, C, H, W) or (C, H, W) and
    its int64 indices (flat positions h * W_out + w in each output plane) -> zeros with each value at its index.
    Output (H - 1) * stride - 2 * padding + kernel_size per side, or `output_size` ((H, W), or the whole shape) within
    a stride of it."""
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride if stride is not None else kernel_size, "stride")
    ph, pw = _pair(padding, "padding")
    if input.ndim not in (3, 4):
        raise ShapeError(f"max_unpool2d: expected (N, C, H, W) or (C, H, W), got {fmt_shape(input.shape)}")
    if tuple(indices.shape) != tuple(input.shape):
        raise ShapeError(f"max_unpool2d: indices of shape {fmt_shape(indices.shape)} do not match the input's "
                         f"{fmt_shape(input.shape)}")
    if indices.dtype not in (flame_dtypes.int64, flame_dtypes.int32):
        raise TypeError(f"max_unpool2d: indices must be int64 (max_pool2d's return_indices), got {indices.dtype}")
    H, W = input.shape[-2:]
    default = ((H - 1) * sh - 2 * ph + kh, (W - 1) * sw - 2 * pw + kw)
    if output_size is None:
        out_hw = default
    else:
        out_hw = tuple(int(v) for v in tuple(output_size)[-2:])
        if len(tuple(output_size)) not in (2, input.ndim):
            raise ValueError(f"max_unpool2d: output_size must have 2 or {input.ndim} elements, got {output_size}")
        for n, d, s_ in zip(out_hw, default, (sh, sw)):
            if not d - s_ < n < d + s_:
                raise ValueError(f"max_unpool2d: output_size {out_hw} must be within a stride of the default "
                                 f"{default} (stride {(sh, sw)})")
    if min(out_hw) <= 0:
        raise ValueError(f"max_unpool2d: the output would have size {out_hw}")
    ia = indices._data
    if ia.size:  # before any write: an index past the plane would raise inside NumPy / CuPy, or wrap around
        xp = backend.xp_of(ia)
        lo, hi = (int(v) for v in backend.to_numpy(xp.stack((ia.min(), ia.max()))))  # (one transfer on cuda)
        if lo < 0 or hi >= out_hw[0] * out_hw[1]:
            raise IndexError(f"max_unpool2d: indices range over [{lo}, {hi}], outside the {out_hw} output plane "
                             f"(0 .. {out_hw[0] * out_hw[1] - 1})")

    def run(x, idx):
        return MaxUnpool2d.apply(x, idx, out_hw)
    if input.ndim == 3:
        return run(input.unsqueeze(0), indices.unsqueeze(0)).squeeze(0)
    return run(input, indices)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    def run(x):
        g = _geometry("avg_pool2d", x, kernel_size, stride, padding, 1, ceil_mode)
        return AvgPool2d.apply(x, g, count_include_pad, divisor_override)
    return _batched(run, input)


def adaptive_windows(n_in, n_out):
    """PyTorch's adaptive pooling windows [floor(i n / o), ceil((i + 1) n / o)) along one axis."""
    return [((i * n_in) // n_out, -(-((i + 1) * n_in) // n_out)) for i in range(n_out)]


def adaptive_weights(n_in, n_out):
    """(n_out, n_in) float64 averaging matrix over the adaptive windows (adaptive_avg_pool, interpolate's 'area')."""
    m = np.zeros((n_out, n_in))
    for i, (s, e) in enumerate(adaptive_windows(n_in, n_out)):
        m[i, s:e] = 1.0 / (e - s)
    return m


def _adaptive_matrix(n_in, n_out, xp, dtype):
    return xp.asarray(adaptive_weights(n_in, n_out).astype(dtype))


def adaptive_avg_pool2d(input, output_size):
    """Averages over PyTorch's adaptive windows, as two small matmuls: P_h @ x @ P_w^T (differentiable)."""
    if input.ndim not in (3, 4):
        raise ShapeError(f"adaptive_avg_pool2d: expected (N, C, H, W) or (C, H, W), got {fmt_shape(input.shape)}")
    H, W = input.shape[-2:]
    oh, ow = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    oh, ow = oh or H, ow or W
    xp = input._xp()
    acc = np.float32 if input.dtype.itemsize < 4 else input.dtype.np
    ph = _wrap(_adaptive_matrix(H, oh, xp, acc))
    pw = _wrap(_adaptive_matrix(W, ow, xp, acc))
    x = input.to(ph.dtype)
    return (ph @ x @ pw.mT).to(input.dtype)


def adaptive_max_pool2d(input, output_size, return_indices=False):
    """The maximum over PyTorch's adaptive windows (its first position in row-major order; a NaN wins); with
    return_indices also the flat positions h * W + w (int64). The output gathers the input at those positions, so
    its gradient goes to them."""
    if input.ndim not in (3, 4):
        raise ShapeError(f"adaptive_max_pool2d: expected (N, C, H, W) or (C, H, W), got {fmt_shape(input.shape)}")
    x = input if input.ndim == 4 else input.unsqueeze(0)
    N, C, H, W = x.shape
    oh, ow = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    oh, ow = int(oh or H), int(ow or W)
    if oh < 1 or ow < 1:
        raise ValueError(f"adaptive_max_pool2d: output_size must be positive, got {output_size}")
    a = x._data
    xp = backend.xp_of(a)
    idx = xp.empty((N, C, oh, ow), dtype=np.int64)
    for i, (h0, h1) in enumerate(adaptive_windows(H, oh)):
        for j, (w0, w1) in enumerate(adaptive_windows(W, ow)):
            win = a[:, :, h0:h1, w0:w1].reshape(N, C, -1)
            # argmax picks the first maximum; a NaN anywhere wins (PyTorch: val > max || isnan(val): its last NaN)
            nan = xp.isnan(win) if win.dtype.kind == "f" else None
            k = xp.argmax(win, axis=-1)
            if nan is not None:
                last_nan = win.shape[-1] - 1 - xp.argmax(nan[..., ::-1], axis=-1)
                k = xp.where(nan.any(axis=-1), last_nan, k)
            kw_ = w1 - w0
            idx[:, :, i, j] = (h0 + k // kw_) * W + (w0 + k % kw_)
    flat_idx = _wrap(idx.reshape(N, C, oh * ow))
    out = x.reshape(N, C, H * W).gather(2, flat_idx).reshape(N, C, oh, ow)
    ind = _wrap(idx)
    if input.ndim == 3:
        out, ind = out.squeeze(0), ind.squeeze(0)
    return (out, ind) if return_indices else out


def _as_2d(fn, input, *args, name):
    if input.ndim not in (2, 3):
        raise ShapeError(f"{name}: expected (N, C, L) or (C, L), got {fmt_shape(input.shape)}")
    out = fn(input.unsqueeze(-2), *args)
    return tuple(t.squeeze(-2) for t in out) if isinstance(out, tuple) else out.squeeze(-2)


def _one(v, name):
    t = (v,) if isinstance(v, int) else tuple(v)
    if len(t) != 1:
        raise ValueError(f"{name} must be an int or 1 int, got {v}")
    return t[0]


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """max_pool2d over (N, C, 1, L): PyTorch's 1-D max pooling (indices are positions along L)."""
    k = _one(kernel_size, "max_pool1d: kernel_size")
    s = k if stride is None else _one(stride, "max_pool1d: stride")
    return _as_2d(max_pool2d, input, (1, k), (1, s), (0, _one(padding, "max_pool1d: padding")),
                  (1, _one(dilation, "max_pool1d: dilation")), ceil_mode, return_indices, name="max_pool1d")


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    """avg_pool2d over (N, C, 1, L)."""
    k = _one(kernel_size, "avg_pool1d: kernel_size")
    s = k if stride is None else _one(stride, "avg_pool1d: stride")
    return _as_2d(avg_pool2d, input, (1, k), (1, s), (0, _one(padding, "avg_pool1d: padding")), ceil_mode,
                  count_include_pad, name="avg_pool1d")


def adaptive_avg_pool1d(input, output_size):
    return _as_2d(adaptive_avg_pool2d, input, (1, _one(output_size, "adaptive_avg_pool1d: output_size")),
                  name="adaptive_avg_pool1d")


def adaptive_max_pool1d(input, output_size, return_indices=False):
    """adaptive_max_pool2d over (N, C, 1, L) (indices are positions along L)."""
    return _as_2d(adaptive_max_pool2d, input, (1, _one(output_size, "adaptive_max_pool1d: output_size")),
                  return_indices, name="adaptive_max_pool1d")
