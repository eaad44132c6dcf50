"""Pinned (page-locked) host memory pool: the staging area for streaming weights to the GPU.

`pinned_empty(shape, dtype)` returns a cpu Tensor over a cached page-locked block (cudaHostAlloc). When the last
array over the block dies the block goes back to the pool's free list for its size class and the next request of
that class reuses it without another cudaHostAlloc. Size classes: 4 KiB steps below 1 MiB, 2 MiB steps above.
Without a GPU the pool hands out ordinary (pageable) host memory with the same reuse and stats, so code and tests
run unchanged; `is_pinned` tells which.
"""
import ctypes
import threading

import numpy as np

from .pool import MiB

_PAGE = 4096
_LARGE_STEP = 2 * MiB


def round_pinned(nbytes):
    if nbytes < MiB:
        return max(_PAGE, (nbytes + _PAGE - 1) & -_PAGE)
    return (nbytes + _LARGE_STEP - 1) & -_LARGE_STEP


class CudaHostBackend:
    pinned = True

    def __init__(self):
        from .. import backend
        self._rt = backend.cupy.cuda.runtime

    def alloc(self, nbytes):
        return self._rt.hostAlloc(nbytes, 0), None

    def free(self, ptr, keep):
        self._rt.freeHost(ptr)


class PageableBackend:
    """Fallback without CUDA: plain host memory (not page-locked)."""
    pinned = False

    def alloc(self, nbytes):
        buf = np.empty(nbytes, np.uint8)
        return buf.ctypes.data, buf

    def free(self, ptr, keep):
        pass


class _Block:
    __slots__ = ("ptr", "size", "keep", "requested", "shape", "dtype")


class _Lease:
    """Attached to the ctypes buffer under the returned array: its death returns the block."""
    __slots__ = ("pool", "blk")

    def __init__(self, pool, blk):
        self.pool, self.blk = pool, blk

    def __del__(self):
        try:
            self.pool._release(self.blk)
        except Exception:  # interpreter shutdown
            pass


class PinnedPool:
    name = "pinned"
    num_splits = num_merges = num_alloc_retries = num_ooms = 0
    limit = None

    def __init__(self, backend):
        self.backend = backend
        self._free = {}  # rounded size -> [blocks]
        self._leased = {}  # ptr -> block
        self._lock = threading.Lock()
        self._pending = []
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = 0
        self.num_alloc = self.num_free = self.cache_hits = self.cache_misses = 0
        self.num_device_alloc = self.num_device_free = 0
        self.bytes_allocated_total = self.bytes_freed_total = 0

    def empty(self, shape, np_dtype):
        """A NumPy array of `shape`/`np_dtype` over a pooled block (uninitialised)."""
        np_dtype = np.dtype(np_dtype)
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * np_dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, np_dtype)
        r = round_pinned(nbytes)
        with self._lock:
            self._drain()
            lst = self._free.get(r)
            if lst:
                blk = lst.pop()
                self.cache_hits += 1
            else:
                blk = self._new_block(r)
                self.cache_misses += 1
            blk.requested, blk.shape, blk.dtype = nbytes, tuple(shape), np_dtype
            self._leased[blk.ptr] = blk
            self.num_alloc += 1
            self.requested += nbytes
            self.bytes_allocated_total += r
            self.allocated += r
            self.peak_allocated = max(self.peak_allocated, self.allocated)
        buf = (ctypes.c_ubyte * r).from_address(blk.ptr)
        buf._flame_lease = _Lease(self, blk)
        return np.frombuffer(buf, dtype=np_dtype, count=count).reshape(shape)

    def _new_block(self, r):
        try:
            ptr, keep = self.backend.alloc(r)
        except Exception:  # host allocation refused: drop the cache and try once more
            self._release_cached()
            ptr, keep = self.backend.alloc(r)
        blk = _Block()
        blk.ptr, blk.size, blk.keep = ptr, r, keep
        self.num_device_alloc += 1
        self.reserved += r
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return blk

    def _release(self, blk):
        if not self._lock.acquire(False):  # GC inside empty(), or another thread: defer
            self._pending.append(blk)
            return
        try:
            self._release_locked(blk)
            self._drain()
        finally:
            self._lock.release()

    def _release_locked(self, blk):
        if self._leased.pop(blk.ptr, None) is None:
            return
        self.allocated -= blk.size
        self.requested -= blk.requested
        self.bytes_freed_total += blk.size
        self.num_free += 1
        self._free.setdefault(blk.size, []).append(blk)

    def _drain(self):
        while self._pending:
            self._release_locked(self._pending.pop())

    def _release_cached(self):
        released = 0
        for lst in self._free.values():
            for blk in lst:
                self.backend.free(blk.ptr, blk.keep)
                self.num_device_free += 1
                self.reserved -= blk.size
                released += blk.size
        self._free = {}
        return released

    def empty_cache(self):
        with self._lock:
            self._drain()
            return self._release_cached()

    def reset_peak(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def live_items(self):
        return [(b.size, b.shape, b.dtype, None) for b in list(self._leased.values())]

    def owns(self, arr):
        """True when NumPy array `arr` lies on a block of this pool."""
        b = arr
        while isinstance(b, np.ndarray):
            b = b.base
        return getattr(b, "_flame_lease", None) is not None and b._flame_lease.pool is self


_pool = None


def pinned_pool():
    global _pool
    if _pool is None:
        from .. import backend
        _pool = PinnedPool(CudaHostBackend() if backend.cuda_available() else PageableBackend())
    return _pool
