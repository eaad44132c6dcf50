"""Concatenation on cuda as row-block copies (cuda_src/copy_rows.cu): each piece of a cat along dim d is a
(rows, row) block -- rows the dims before d, a row the rest -- written into its columns of the output's (rows,
total row) view, 16 bytes per thread where the addresses allow; a piece whose rows are packed only after d (a view
of a fused projection) is copied as n rows per index of the dims before d. CuPy's concatenate runs its generic
elementwise copy (an index division per element, one element per thread: ~4x below the copy ceiling on bf16 pieces)
and joins more than a few arrays through an address table copied from host memory, which a CUDA graph capture
refuses."""
import math
import threading

import numpy as np

from .. import backend
from ..memory import recycle
from . import launching as KL
from . import loader as L
from . import plans as P

_BLOCK = 256
_local = threading.local()   # .launches: {(kernel, grid, block, device): PackedLaunch} of this thread
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None
_nd = backend._cupy_ndarray if backend.cupy is not None else None


def _row_blocks(a, d):
    """(rows, row bytes, row stride bytes) of array a seen as rows of its dims [d:], or None when those dims are not
    packed or the dims before d do not collapse into one stride."""
    item = a.itemsize
    expect = item
    for n, s in zip(reversed(a.shape[d:]), reversed(a.strides[d:])):
        if n != 1 and s != expect:
            return None
        expect *= n
    row = expect
    rows, stride = 1, row
    live = [(n, s) for n, s in zip(a.shape[:d], a.strides[:d]) if n != 1]
    for (n0, s0), (n1, s1) in zip(live, live[1:]):
        if s0 != s1 * n1:
            return None
    if live:
        stride = live[-1][1]
        rows = math.prod(n for n, _ in live)
    return rows, row, stride


def copy_rows(src, src_stride, dst, dst_stride, rows, row_bytes):
    """dst[r, :row_bytes] = src[r, :row_bytes] for r < rows (raw addresses + byte strides of cupy memory)."""
    if rows == 0 or row_bytes == 0:
        return
    for width, name in ((16, "copy_rows_v16"), (4, "copy_rows_v4"), (1, "copy_rows_v1")):
        if (src | dst | row_bytes | (src_stride if rows > 1 else 0) | (dst_stride if rows > 1 else 0)) % width == 0:
            break
    cols = row_bytes // width
    block = min(_BLOCK, P.cdiv(cols, 32) * 32)
    gx = P.cdiv(cols, block)
    gy = max(1, min(P.cdiv(rows, 4), 65535, P.cdiv(8 * P.sm_count(), gx)))
    if src_stride < 0 or dst_stride < 0:   # (a reversed view's rows) CuPy's argument conversion takes signed values
        KL.launch(L.get_function("copy_rows", name), (gx, gy), (block,),
                  (np.uint64(src), np.uint64(dst), KL.i64(rows), KL.i64(cols), KL.i64(src_stride),
                   KL.i64(dst_stride)))
        return
    # one packed launch per (kernel, grid, block, device) and thread: per call only the six values are written (no
    # per-argument conversion: the per-op host cost of an eager cat)
    key = (name, gx, gy, block, _get_device())
    try:
        pl = _local.launches[key]
    except AttributeError:
        _local.launches = {}
        pl = None
    except KeyError:
        pl = None
    if pl is None:
        if len(_local.launches) >= 256:   # (one entry per grid shape: bounded for programs of many shapes)
            _local.launches.clear()
        pl = _local.launches[key] = KL.PackedLaunch(L.get_function("copy_rows", name), (gx, gy), (block,),
                                                    (None,) * 6, 6)
    pl((src, dst, rows, cols, src_stride, dst_stride))


MAX_LEAD = 16  # a piece whose rows are packed only from dim + 1 on: one copy per index of the dims before dim, up to


def _packed_from(a, d):
    """(row bytes, row stride bytes) of `a` seen along dim d as rows of its packed dims [d + 1:] (each index along d
    one contiguous row: a q / k / v view of a fused projection), or None."""
    expect = a.itemsize
    for n, s in zip(reversed(a.shape[d + 1:]), reversed(a.strides[d + 1:])):
        if n != 1 and s != expect:
            return None
        expect *= n
    return expect, a.strides[d]


def cat(arrs, dim):
    """The concatenation of cupy arrays of one dtype along `dim` (a new C-contiguous array)."""
    shape = list(arrs[0].shape)
    shape[dim] = sum(a.shape[dim] for a in arrs)
    shape = tuple(shape)
    dt = arrs[0].dtype
    out = recycle.take(shape, dt) if recycle.on[0] and math.prod(shape) <= recycle.MAX_NUMEL else None
    if out is None:
        out = _nd(shape, dt)
    if out.size == 0:
        return out
    _, total, out_stride = _row_blocks(out, dim)
    at = [slice(None)] * out.ndim
    start = 0
    for a in arrs:
        n = a.shape[dim]
        if a.size:
            blocks = _row_blocks(a, dim)
            packed = _packed_from(a, dim) if blocks is None else None
            lead = a.shape[:dim]
            if packed is not None and math.prod(lead) <= MAX_LEAD:
                # rows packed from dim + 1 on (their stride along dim is not the row's length, e.g. a v view of a
                # fused qkv projection): n rows per index of the dims before dim
                row, rstride = packed
                for idx in np.ndindex(*lead):
                    so = sum(i * st for i, st in zip(idx, a.strides[:dim]))
                    do = sum(i * st for i, st in zip(idx, out.strides[:dim])) + start * out.strides[dim]
                    copy_rows(a.data.ptr + so, rstride, out.data.ptr + do, out.strides[dim], n, row)
            elif blocks is None:  # a piece with gaps inside its rows: CuPy's strided copy into its slice
                at[dim] = slice(start, start + n)
                out[tuple(at)] = a
            else:
                rows, row, stride = blocks
                copy_rows(a.data.ptr, stride, out.data.ptr + row // n * start if n else out.data.ptr, out_stride,
                          rows, row)
        start += n
    return out


def contiguous(a):
    """A C-contiguous copy of cupy array `a` by row-block copies when some split of its dims makes it (rows, row)
    blocks -- e.g. q of a fused qkv projection, (B, L, heads, D) rows of heads*D elements L*3*heads*D apart -- else
    None (the caller copies otherwise)."""
    for d in range(a.ndim):
        blocks = _row_blocks(a, d)
        if blocks is not None:
            rows, row, stride = blocks
            out = backend.cupy.empty(a.shape, dtype=a.dtype)
            copy_rows(a.data.ptr, stride, out.data.ptr, row, rows, row)
            return out
    return None
