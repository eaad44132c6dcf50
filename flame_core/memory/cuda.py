"""FLAME's DevicePool installed as CuPy's allocator: one pool per GPU, raw memory from cudaMalloc.

`install()` hands an allocator's `malloc` over the pools to `cupy.cuda.set_allocator`: every CuPy allocation
(arrays, reduction scratch, cuBLAS/cuFFT buffers that go through CuPy) then comes from the pool, and the block goes
back (`_free`) when the last array over it dies. `flame_core.memory` installs it on import when CuPy sees a GPU,
unless FLAME_CUDA_POOL=0.

The allocator is `Allocator` from the C extension (flame_core/csrc/alloc.c) where it is built: CuPy's
`PythonFunctionAllocator` with each block's free held by an object the garbage collector does not track. CuPy's own
keeps the free function on its memory object, which the collector may clear first when it frees a reference cycle
holding arrays (an exception's traceback, a closure): that block then never came back to the pool ("Exception
ignored in: PythonFunctionAllocatorMemory.__dealloc__ ... 'NoneType' object is not callable"). Without the extension
(no C compiler, FLAME_SPEEDUPS=0) CuPy's allocator is used, with that loss.

Tags (the shape, dtype and, with tracking, the creating line of a tensor on each block: OOM reports, summaries, the
profiler) are written at tensor birth only while something needs them then -- origin tracking on (the line is only
known at birth) or an observer (the profiler) on a pool; the birth hook costs a few frames per op otherwise. Else
they are written on demand: before a pool's `live_items()` is read, `tag_live()` walks the garbage collector's live
tensors once and tags the untagged blocks they live on (a block several tensors share is named after the one that
owns it -- not a view -- and then the largest).
"""
import gc
import sys

import numpy as np

from .. import backend as _backend
from .. import speedups
from . import cpu_tracking, recycle, tracking
from .pool import DeviceOutOfMemory, DevicePool

pools = {}  # device id -> DevicePool
_allocator = None
_installed = False


class CudaBackend:
    """Raw device memory for a DevicePool: cudaMalloc / cudaFree, keyed by the current CuPy stream."""

    def __init__(self, device_id):
        cp = _backend.cupy
        self.device_id = device_id
        self._cp = cp
        self._rt = cp.cuda.runtime
        self.current_stream = cp.cuda.get_current_stream  # the pool's hot path: current_stream().ptr, no frame

    def malloc(self, nbytes):
        try:
            with self._cp.cuda.Device(self.device_id):
                return self._rt.malloc(nbytes)
        except self._rt.CUDARuntimeError as e:
            if getattr(e, "status", None) == 2:  # cudaErrorMemoryAllocation
                raise DeviceOutOfMemory(str(e)) from None
            raise

    def free(self, ptr, nbytes):
        with self._cp.cuda.Device(self.device_id):
            self._rt.free(ptr)

    def mem_info(self):
        with self._cp.cuda.Device(self.device_id):
            return self._rt.memGetInfo()

    def release_foreign(self):
        """Blocks cached by CuPy's own pool (arrays made before FLAME's pool was installed)."""
        self._cp.get_default_memory_pool().free_all_blocks()


def pool_for(device_id):
    pool = pools.get(device_id)
    if pool is None:
        pool = pools[device_id] = DevicePool(CudaBackend(device_id), name=f"cuda:{device_id}")
        _watch(pool)
    return pool


def _watch(pool):
    """Hook a pool to the tagging: birth tags while it has an observer, on-demand tags before its reports."""
    pool.on_observer_change = refresh_birth
    pool.tagger = tag_live


def _malloc(nbytes, device_id):
    pool = pools.get(device_id)
    if pool is None:
        pool = pool_for(device_id)
    return pool.malloc(nbytes)


def _free(ptr, device_id):
    try:
        pools[device_id].free(ptr)
    except Exception:  # interpreter shutdown: module globals may already be gone
        pass


def _birth(arr):
    """Tag the block a new cuda tensor lives on with its shape and dtype (and origin when tracking)."""
    mp = arr.data
    pool = pools.get(mp.device_id)
    if pool is None:
        return
    blk = pool._live.get(mp.mem.ptr)
    if blk is not None and blk.tag is None:
        blk.tag = (arr.shape, arr.dtype, tracking.origin() if tracking._enabled else None)
        if pool._observer is not None:
            pool._observer("tag", pool, blk)


def tag_live():
    """Tag the untagged blocks that live cuda tensors sit on, (shape, dtype, None): one walk of the garbage
    collector's objects (see the module docstring). Returns how many blocks it tagged."""
    tensor_cls = sys.modules["flame_core.tensor"].Tensor
    nd = np.ndarray
    best = {}  # id(block) -> [rank, array, pool, block]
    for o in gc.get_objects():
        if not isinstance(o, tensor_cls):
            continue
        arr = getattr(o, "_data", None)
        if arr is None or isinstance(arr, nd):
            continue
        try:
            mp = arr.data
            pool = pools.get(mp.device_id)
            ptr = mp.mem.ptr
        except AttributeError:  # a cpu array, or storage that is not a CuPy array
            continue
        if pool is None:
            continue
        blk = pool._live.get(ptr)
        if blk is None or blk.tag is not None:
            continue
        rank = (getattr(arr, "base", None) is None, getattr(arr, "nbytes", 0))
        cur = best.get(id(blk))
        if cur is None or rank > cur[0]:
            best[id(blk)] = [rank, arr, pool, blk]
    for _, arr, pool, blk in best.values():
        if blk.tag is None and pool._live.get(blk.ptr) is blk:
            blk.tag = (arr.shape, arr.dtype, None)
            if pool._observer is not None:
                pool._observer("tag", pool, blk)
    return len(best)


def refresh_birth():
    """Install the birth tagging hook while tags are needed at birth (tracking on, or an observer on a pool), else
    remove it (tags are then written on demand, `tag_live`). Called on install / uninstall, `set_tracking` and when a
    pool's observer changes (a no-op while the pool is not installed)."""
    if not _installed:
        return
    need = tracking._enabled or any(p._observer is not None for p in list(pools.values()))
    fn = _birth if need else None
    if cpu_tracking.cuda_birth is not fn:
        cpu_tracking.set_cuda_birth(fn)
    # the small-array bin (memory.recycle) while nothing watches each allocation, on a single GPU
    want = not need and recycle.requested() and _backend.cuda_device_count() == 1
    if want and not recycle.is_enabled():
        recycle.enable(pool_for(0))
    elif not want and recycle.is_enabled():
        recycle.disable()


def make_allocator(cp):
    """An allocator over the pools whose `malloc` CuPy can call: the C extension's `Allocator` (the module docstring),
    else CuPy's `PythonFunctionAllocator`."""
    c = speedups.module
    if c is None:
        return cp.cuda.memory.PythonFunctionAllocator(_malloc, _free)
    return c.Allocator(_malloc, _free, cp.cuda.device.get_device_id, cp.cuda.memory.UnownedMemory,
                       cp.cuda.memory.MemoryPointer)


def install():
    """Make FLAME's pools CuPy's allocator (idempotent)."""
    global _allocator, _installed
    cp = _backend.cupy
    if _allocator is None:
        _allocator = make_allocator(cp)
    cp.cuda.set_allocator(_allocator.malloc)
    _installed = True
    refresh_birth()


def uninstall():
    """Give allocation back to CuPy's default pool (blocks already handed out still return to FLAME's)."""
    global _installed
    cp = _backend.cupy
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    _installed = False
    cpu_tracking.set_cuda_birth(None)
    if recycle.is_enabled():
        recycle.disable()


def is_installed():
    return _allocator is not None and _installed
