"""Launch geometry: how a kernel's grid and blocks cover the data (ceiling division, 1-D grids, 16-byte vectors, the
row-kernel plans), from the device's SM count and compute capability.
"""
import numpy as np

from .. import backend
from . import loader as L


def cdiv(a, b):
    return -(-int(a) // int(b))


def grid_1d(n, block):
    return (max(1, cdiv(n, block)),)


_props = {}  # device -> (its cudaDeviceProp as a dict, compute capability as an int, SM count)


def device_properties():
    """The current CUDA device's cudaDeviceProp as a dict (read from the driver once per device)."""
    return _device(backend.cupy.cuda.runtime.getDevice())[0]


def compute_capability():
    """The current CUDA device's compute capability as an int (90 for sm_90)."""
    return _device(backend.cupy.cuda.runtime.getDevice())[1]


def _device(dev):
    p = _props.get(dev)
    if p is None:
        d = backend.cupy.cuda.runtime.getDeviceProperties(dev)
        p = _props[dev] = (d, d["major"] * 10 + d["minor"], d["multiProcessorCount"])
    return p


_nd = backend._cupy_ndarray if backend.cupy is not None else None


def contiguous(a):
    """C-contiguous and, on the GPU, 16-byte aligned (kernels read 16-byte vectors when the base address allows it;
    a copy is cheaper than the scalar path for the large arrays that matter)."""
    if type(a) is _nd and a._c_contiguous and not a.data.ptr & 15:  # the per-op case: no flags object, no frame
        return a
    if not a.flags.c_contiguous:
        if backend.is_cuda_array(a) and a.size:
            from .copy_rows import (
                contiguous as rows_copy,  # row-block views (a qkv split): 16-byte copies
            )
            out = rows_copy(a)
            if out is not None:
                return out
        return backend.xp_of(a).ascontiguousarray(a)
    if backend.is_cuda_array(a) and a.data.ptr % 16:
        return a.copy()
    return a


def vec_width(dtype):
    """Elements in a 16-byte vector of this dtype."""
    return 16 // np.dtype(dtype).itemsize


def sm_count():
    return _device(backend.cupy.cuda.runtime.getDevice())[2]


MAX_VPT = 4  # keep equal to MAX_VPT in cuda_src/common.cuh
VPTS = (1, 2, 4)  # row kernels exist per vectors-per-thread: <name>1, <name>2, <name>4
vpt_override = None  # benchmarks set this to sweep the choice; None: the heuristic of row_plan


def row_tpr(nvec, vpt):
    """Threads per row for `nvec` vectors at `vpt` each: a power of two up to 32 (shuffle groups), else a multiple
    of 32 (the whole block)."""
    need = cdiv(nvec, vpt)
    if need <= 32:
        tpr = 1
        while tpr < need:
            tpr *= 2
        return tpr
    return cdiv(need, 32) * 32


def row_plan(stem, name, dtype, rows, cols, vec):
    """(kernel, grid, block, tpr) for a row-kernel family `<name>1`, `<name>2`, `<name>4` of cuda_src/<stem>.cu
    (the digit: vectors of `vec` elements each thread caches in registers).

    The smallest count that keeps a row within 256 threads (else 4), raised while the kernel's registers do not
    allow that many threads per block. Rows wider than tpr * vpt vectors run the kernel's looping path."""
    nvec = max(1, cols // vec)
    if vpt_override is not None:
        order = [vpt_override]
    else:
        first = next((v for v in VPTS if cdiv(nvec, v) <= 256), VPTS[-1])
        order = [v for v in VPTS if v >= first]
    for vpt in order:
        kernel = L.get_function(stem, f"{name}{vpt}", dtype)
        limit = kernel.max_threads_per_block // 32 * 32
        tpr = row_tpr(nvec, vpt)
        if tpr <= limit:
            break
    else:
        tpr = min(limit, 1024)  # looping path
    block = tpr if tpr > 32 else 128
    return kernel, (max(1, cdiv(rows, block // tpr)),), (block,), tpr


def elementwise_grid(n, dtype, block=256):
    """Grid for the grid-stride elementwise kernels over n elements read as 16-byte vectors."""
    return (max(1, min(cdiv(cdiv(n, vec_width(dtype)), block), sm_count() * 16)),), (block,)


def rows_grid(rows, block=256):
    """(grid, block) of a kernel whose blocks walk whole rows (grid-stride): up to 8 blocks per SM."""
    return (max(1, min(int(rows), sm_count() * 8)),), (block,)
