"""interpolate (PyTorch's F.interpolate) for 4-D inputs: 'nearest' and 'bilinear'.

Nearest with an integer factor is a broadcast + reshape (one copy; its backward is a sum). Other cases gather rows
and columns (nearest) or multiply by the separable interpolation matrices (bilinear): y = M_h @ x @ M_w^T.
"""
import math

import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape


def _sizes(x, size, scale_factor):
    H, W = x.shape[-2:]
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        oh, ow = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
        return (oh, ow), (H / oh, W / ow)
    fh, fw = (scale_factor, scale_factor) if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
    # PyTorch (recompute_scale_factor unset): output floor(in * f); sampling uses 1/f
    return (int(math.floor(H * fh)), int(math.floor(W * fw))), (1.0 / fh, 1.0 / fw)


def _nearest_index(n_in, n_out, scale):
    return np.minimum(np.floor(np.arange(n_out) * scale).astype(np.int64), n_in - 1)


def _bilinear_matrix(n_in, n_out, scale, align_corners):
    """(n_out, n_in) matrix of bilinear weights along one axis (PyTorch's source-index rules)."""
    i = np.arange(n_out, dtype=np.float64)
    if align_corners:
        src = i * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
    else:
        src = np.maximum((i + 0.5) * scale - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = src - i0
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), i0), 1 - lam)
    np.add.at(m, (np.arange(n_out), i1), lam)
    return m


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None):
    if input.ndim != 4:
        raise ShapeError(f"interpolate: expected (N, C, H, W) input, got {fmt_shape(input.shape)}")
    (oh, ow), (sh, sw) = _sizes(input, size, scale_factor)
    N, C, H, W = input.shape
    if mode == "nearest":
        if align_corners is not None:
            raise ValueError("interpolate: align_corners only applies to 'bilinear'")
        fh, fw = oh // H, ow // W
        if oh == fh * H and ow == fw * W and math.isclose(sh, 1 / fh) and math.isclose(sw, 1 / fw):
            y = input.reshape(N, C, H, 1, W, 1).expand(N, C, H, fh, W, fw)
            return y.reshape(N, C, oh, ow)
        ih = flame.as_tensor(_nearest_index(H, oh, sh), device=input.device)
        iw = flame.as_tensor(_nearest_index(W, ow, sw), device=input.device)
        return input.index_select(2, ih).index_select(3, iw)
    if mode == "bilinear":
        acc = np.float32 if input.dtype.itemsize < 4 else input.dtype.np
        mh = flame.as_tensor(_bilinear_matrix(H, oh, sh, bool(align_corners)).astype(acc), device=input.device)
        mw = flame.as_tensor(_bilinear_matrix(W, ow, sw, bool(align_corners)).astype(acc), device=input.device)
        return (mh @ input.to(mh.dtype) @ mw.mT).to(input.dtype)
    raise ValueError(f"interpolate: mode must be 'nearest' or 'bilinear', got {mode!r}")
