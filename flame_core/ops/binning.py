"""Finding and counting values with PyTorch's semantics: searchsorted, bucketize, isin, bincount, histc, histogram.
None is differentiable (their results are positions and counts), as in PyTorch."""
import collections

import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import DTypeError, ShapeError
from ..tensor import Tensor, _wrap


def _cmp_array(t, op):
    """An array to compare: half types in float32 (exact; CuPy has no bfloat16 comparisons)."""
    a = t._data if isinstance(t, Tensor) else t
    if a.dtype == D.bfloat16.np or a.dtype == np.float16:
        a = a.astype(np.float32)
    return a


def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None, sorter=None):
    """The positions at which `input`'s values would be inserted into `sorted_sequence` (sorted along its last dim)
    to keep it sorted: side "left" (default; right=False) the first such position, "right" the last. A 1-D sequence
    serves every value; an N-D one has a row per leading index of `input` (same leading dims). `sorter`: indices
    that sort the sequence (argsort's)."""
    if side is not None:
        if side not in ("left", "right"):
            raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
        if right and side == "left":
            raise ValueError("searchsorted: side='left' and right=True contradict each other")
        right = side == "right"
    side = "right" if right else "left"
    seq = _cmp_array(sorted_sequence, "searchsorted")
    scalar = not isinstance(input, Tensor)
    vals = _cmp_array(input, "searchsorted") if not scalar else None
    xp = backend.xp_of(seq)
    if scalar:
        vals = xp.asarray(input, dtype=seq.dtype if seq.dtype.kind == "f" else np.float64)
    if sorter is not None:
        seq = xp.take_along_axis(seq, sorter._data.astype(np.int64), axis=-1)
    out_dt = np.int32 if out_int32 else np.int64
    if seq.ndim <= 1:
        return _wrap(xp.searchsorted(seq.reshape(-1), vals, side=side).astype(out_dt))
    if vals.shape[:-1] != seq.shape[:-1]:
        raise ShapeError(f"searchsorted: the sequence's leading dims {tuple(seq.shape[:-1])} and the values' "
                         f"{tuple(vals.shape[:-1])} must match")
    rows_s, rows_v = seq.reshape(-1, seq.shape[-1]), vals.reshape(-1, vals.shape[-1])
    out = xp.empty(rows_v.shape, dtype=out_dt)
    for r in range(rows_s.shape[0]):
        out[r] = xp.searchsorted(rows_s[r], rows_v[r], side=side)
    return _wrap(out.reshape(vals.shape))


def bucketize(input, boundaries, *, out_int32=False, right=False):
    """The bucket of each value among 1-D sorted `boundaries`: right=False gives i with boundaries[i-1] < x <=
    boundaries[i], right=True boundaries[i-1] <= x < boundaries[i]."""
    if boundaries.ndim != 1:
        raise ShapeError(f"bucketize: boundaries must be 1-D, got {tuple(boundaries.shape)}")
    return searchsorted(boundaries, input, out_int32=out_int32, right=right)


def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """Whether each element of `elements` occurs in `test_elements` (either may be a Python scalar)."""
    ref = elements if isinstance(elements, Tensor) else test_elements
    xp = backend.xp_of(ref._data)
    a = _cmp_array(elements, "isin") if isinstance(elements, Tensor) else xp.asarray(elements)
    b = _cmp_array(test_elements, "isin") if isinstance(test_elements, Tensor) else xp.asarray(test_elements)
    return _wrap(xp.isin(a, b, assume_unique=assume_unique, invert=invert))


def bincount(input, weights=None, minlength=0):
    """Counts (or summed weights) of each value of a 1-D non-negative integer tensor; length max(input) + 1, at
    least minlength. Counts are int64; summed weights are float32 for float32 weights, else float64 (PyTorch's
    rule: half and integer weights give float64 too)."""
    a = input._data
    if input.ndim != 1 or a.dtype.kind not in "iub":
        raise DTypeError(f"bincount: expects a 1-D tensor of non-negative integers, got {input.dtype} of shape "
                         f"{tuple(input.shape)}")
    xp = backend.xp_of(a)
    if a.size and int(a.min()) < 0:
        raise ValueError("bincount: the input holds negative values")
    if minlength < 0:
        raise ValueError(f"bincount: minlength must be non-negative, got {minlength}")
    if weights is None:
        return _wrap(xp.bincount(a, minlength=minlength).astype(np.int64))
    w = weights._data
    if tuple(weights.shape) != tuple(input.shape):
        raise ShapeError(f"bincount: weights {tuple(weights.shape)} must have the input's shape {tuple(input.shape)}")
    out = xp.bincount(a, weights=w.astype(np.float64), minlength=minlength)
    return _wrap(out.astype(np.float32 if w.dtype == np.float32 else np.float64))


def histc(input, bins=100, min=0, max=0):
    """A histogram of `bins` equal-width bins over [min, max] (both 0: the data's own range); values outside are
    left out, the max value counts in the last bin. The counts have the input's float dtype."""
    if not input.dtype.is_floating_point:
        raise DTypeError(f"histc: expects a floating point tensor, got {input.dtype}")
    if bins <= 0:
        raise ValueError(f"histc: bins must be positive, got {bins}")
    a = _cmp_array(input, "histc").reshape(-1)
    xp = backend.xp_of(a)
    lo, hi = float(min), float(max)
    if lo == hi and a.size:
        finite = a[xp.isfinite(a)]
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:   # PyTorch widens an empty range by one on each side
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise ValueError(f"histc: max ({max}) must be larger than min ({min})")
    counts, _ = xp.histogram(a, bins=bins, range=(lo, hi))
    return _wrap(counts.astype(input.dtype.np))


histogram_result = collections.namedtuple("histogram", ["hist", "bin_edges"])


def histogram(input, bins, *, range=None, weight=None, density=False):
    """(hist, bin_edges) of the flattened input, as torch.histogram (NumPy's rules): `bins` equal-width bins over
    `range` (default: the data's min and max, widened by 0.5 each side when equal; [0, 1] when empty) or the given
    increasing edges; the last bin includes its right edge; optional per-element `weight`; density=True divides by
    the total and the bin widths. Floating point input; both results have its dtype."""
    if not input.dtype.is_floating_point:
        raise DTypeError(f"histogram: expects a floating point tensor, got {input.dtype}")
    a = _cmp_array(input, "histogram").reshape(-1)
    xp = backend.xp_of(a)
    if isinstance(bins, Tensor):
        if bins.ndim != 1 or bins.numel() < 2:
            raise ShapeError(f"histogram: bin edges must be 1-D with at least 2 elements, got shape "
                             f"{tuple(bins.shape)}")
        edges = _cmp_array(bins, "histogram").astype(a.dtype)
        if bool((edges[1:] < edges[:-1]).any()):
            raise ValueError("histogram: bin edges must increase monotonically")
    elif isinstance(bins, int) and not isinstance(bins, bool) and bins > 0:
        edges = bins
    else:
        raise ValueError(f"histogram: bins must be a positive int or a 1-D tensor of edges, got {bins!r}")
    w = None
    if weight is not None:
        if tuple(weight.shape) != tuple(input.shape):
            raise ShapeError(f"histogram: weight of shape {tuple(weight.shape)} must have the input's shape "
                             f"{tuple(input.shape)}")
        w = _cmp_array(weight, "histogram").reshape(-1)
    rng = None
    if range is not None:
        lo, hi = float(range[0]), float(range[1])
        if not lo <= hi:
            raise ValueError(f"histogram: range min ({lo}) must not exceed max ({hi})")
        rng = (lo, hi)
    hist, e = xp.histogram(a, bins=edges, range=rng, weights=w, density=density)
    dt = input.dtype.np
    return histogram_result(_wrap(hist.astype(dt)), _wrap(xp.asarray(e).astype(dt)))
