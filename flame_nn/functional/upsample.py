"""interpolate (PyTorch's F.interpolate) on (N, C, L), (N, C, H, W) and (N, C, D, H, W) inputs: 'nearest',
'nearest-exact', 'linear' / 'bilinear' / 'trilinear', 'bicubic', 'area', and antialias for 'bilinear' / 'bicubic'.

Nearest with integer factors is a broadcast + reshape (one copy; its backward is a sum); otherwise nearest modes
gather along each spatial axis. The others are separable: one (n_out, n_in) weight matrix per spatial axis, built on
the host with PyTorch's source-index rules (aten/src/ATen/native/UpSample.h, cpu/UpSampleKernel.cpp) and applied as a
matmul along that axis, so the gradient is the transposed matrices' product (no kernel of its own).
"""
import functools
import math

import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops.pooling import adaptive_weights

_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic", "area")
_LINEAR_DIMS = {"linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
CUBIC_A = -0.75      # PyTorch's bicubic (as OpenCV's)
_CUBIC_A_AA = -0.5    # PyTorch's antialiased bicubic (as Pillow's)


def _sizes(x, size, scale_factor, recompute_scale_factor):
    """(output sizes, PyTorch's scale per axis or None): `size` (int or one per spatial dim) or `scale_factor`
    (float or one per spatial dim; output floor(in * f), sampled at 1 / f unless recompute_scale_factor)."""
    spatial = tuple(x.shape[2:])
    n = len(spatial)
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        if recompute_scale_factor:
            raise ValueError("interpolate: recompute_scale_factor only applies with scale_factor")
        out = (int(size),) * n if isinstance(size, (int, np.integer)) else tuple(int(s) for s in size)
        if len(out) != n:
            raise ValueError(f"interpolate: size {size} must have {n} elements for input {fmt_shape(x.shape)}")
        scales = (None,) * n
    else:
        f = (float(scale_factor),) * n if isinstance(scale_factor, (int, float)) else tuple(float(s) for s in
                                                                                            scale_factor)
        if len(f) != n:
            raise ValueError(f"interpolate: scale_factor {scale_factor} must have {n} elements for input "
                             f"{fmt_shape(x.shape)}")
        if any(v <= 0 for v in f):
            raise ValueError(f"interpolate: scale_factor must be positive, got {scale_factor}")
        out = tuple(int(math.floor(s * v)) for s, v in zip(spatial, f))
        scales = (None,) * n if recompute_scale_factor else f
    if any(o <= 0 for o in out):
        raise ValueError(f"interpolate: the output would have size {out} (input {fmt_shape(x.shape)})")
    return out, scales


def _scale(n_in, n_out, align_corners, factor):
    """PyTorch's area_pixel_compute_scale: the source step per output index."""
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return 1.0 / factor if factor is not None and factor > 0 else n_in / n_out


def _source(i, scale, align_corners, cubic=False):
    """PyTorch's area_pixel_compute_source_index (float64 source coordinates of output indices i)."""
    if align_corners:
        return i * scale
    src = (i + 0.5) * scale - 0.5
    return src if cubic else np.maximum(src, 0.0)


def _nearest_index(n_in, n_out, factor, exact):
    scale = n_in / n_out if factor is None else 1.0 / factor
    i = np.arange(n_out, dtype=np.float64)
    src = np.floor((i + 0.5) * scale) if exact else np.floor(i * scale)
    return np.minimum(src.astype(np.int64), n_in - 1)


def _linear_matrix(n_in, n_out, factor, align_corners):
    """(n_out, n_in) linear interpolation weights along one axis."""
    src = _source(np.arange(n_out, dtype=np.float64), _scale(n_in, n_out, align_corners, factor), align_corners)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = src - i0
    m = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    np.add.at(m, (rows, i0), 1 - lam)
    np.add.at(m, (rows, i1), lam)
    return m


def cubic_weights(t, a):
    """The four cubic-convolution weights of taps -1, 0, 1, 2 at fraction t."""
    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):   # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _cubic_matrix(n_in, n_out, factor, align_corners):
    """(n_out, n_in) bicubic weights along one axis: taps clamped to the edge (PyTorch's bounded access)."""
    src = _source(np.arange(n_out, dtype=np.float64), _scale(n_in, n_out, align_corners, factor), align_corners,
                  cubic=True)
    i0 = np.floor(src).astype(np.int64)
    t = src - i0
    m = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    for k, w in zip(range(-1, 3), cubic_weights(t, CUBIC_A)):
        np.add.at(m, (rows, np.clip(i0 + k, 0, n_in - 1)), w)
    return m


def _aa_matrix(n_in, n_out, factor, align_corners, cubic):
    """(n_out, n_in) antialiased weights (PyTorch's _compute_weights_aa): the filter widened by the downscale
    factor, each row normalised to sum 1."""
    scale = _scale(n_in, n_out, align_corners, factor)
    half = 2.0 if cubic else 1.0
    support = half * scale if scale >= 1.0 else half
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        x = np.abs((np.arange(lo, hi) - center + 0.5) * invscale)
        if cubic:
            a = _CUBIC_A_AA
            w = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                         np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
        else:
            w = np.maximum(1.0 - x, 0.0)
        total = w.sum()
        if total != 0.0:
            m[i, lo:hi] = w / total
    return m


def _along(x, m, axis):
    """m (n_out, n_in) applied along `axis` of x."""
    last = x.ndim - 1
    if axis == last:
        return x @ m.mT
    if axis == last - 1:
        return m @ x
    return (x.transpose(axis, last) @ m.mT).transpose(axis, last)


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                antialias=False):
    """PyTorch's F.interpolate (see the module docstring for the modes and the input ranks they take)."""
    if mode not in _MODES:
        raise ValueError(f"interpolate: mode must be one of {', '.join(_MODES)}, got {mode!r}")
    if input.ndim not in (3, 4, 5):
        raise ShapeError(f"interpolate: expected (N, C, L), (N, C, H, W) or (N, C, D, H, W) input, got "
                         f"{fmt_shape(input.shape)}")
    n = input.ndim - 2
    if mode in _LINEAR_DIMS and _LINEAR_DIMS[mode] != n:
        raise ShapeError(f"interpolate: mode {mode!r} needs a {_LINEAR_DIMS[mode] + 2}-D input, got "
                         f"{fmt_shape(input.shape)}")
    if align_corners is not None and mode not in _LINEAR_DIMS:
        raise ValueError("interpolate: align_corners only applies to 'linear', 'bilinear', 'bicubic' and "
                         "'trilinear'")
    if antialias and mode not in ("bilinear", "bicubic"):
        raise ValueError("interpolate: antialias only applies to 'bilinear' and 'bicubic'")
    align = bool(align_corners)
    out, factors = _sizes(input, size, scale_factor, recompute_scale_factor)
    spatial = tuple(input.shape[2:])
    if mode in ("nearest", "nearest-exact"):
        whole = [o // s for o, s in zip(out, spatial)]
        if mode == "nearest" and all(o == f * s and f >= 1 and (g is None or math.isclose(g, f))
                                     for o, f, s, g in zip(out, whole, spatial, factors)):
            # integer factors: a broadcast + reshape
            lead = tuple(input.shape[:2])
            view = lead + tuple(v for s in spatial for v in (s, 1))
            grown = lead + tuple(v for s, f in zip(spatial, whole) for v in (s, f))
            return input.reshape(*view).expand(*grown).reshape(*(lead + out))
        y = input
        for k, (s, o, f) in enumerate(zip(spatial, out, factors)):
            if s != o or f is not None:
                y = y.index_select(2 + k, flame.as_tensor(_nearest_index(s, o, f, mode == "nearest-exact"),
                                                          device=input.device))
        return y
    acc = np.float32 if input.dtype.itemsize < 4 else input.dtype.np
    y = input.to(flame.float32) if input.dtype.itemsize < 4 else input
    for k, (s, o, f) in enumerate(zip(spatial, out, factors)):
        m = _weights(mode, s, o, f, align, bool(antialias), np.dtype(acc))
        y = _along(y, flame.as_tensor(m, device=input.device), 2 + k)
    return y.to(input.dtype)


@functools.lru_cache(maxsize=256)
def _weights(mode, n_in, n_out, factor, align_corners, antialias, dtype):
    """One axis's (n_out, n_in) weight matrix in `dtype`, built once per configuration (a training loop resizing
    every step rebuilds nothing on the host); read-only, as it is shared."""
    if mode == "area":
        m = adaptive_weights(n_in, n_out)
    elif antialias:
        m = _aa_matrix(n_in, n_out, factor, align_corners, mode == "bicubic")
    elif mode == "bicubic":
        m = _cubic_matrix(n_in, n_out, factor, align_corners)
    else:
        m = _linear_matrix(n_in, n_out, factor, align_corners)
    m = m.astype(dtype)
    m.flags.writeable = False
    return m
