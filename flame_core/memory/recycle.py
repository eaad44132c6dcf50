"""Recycling small dead cuda arrays: an eager op's output without CuPy's array creation.

An eager op on a small cuda tensor (`kernels.pointwise_small`: at most MAX_NUMEL elements) spends more host time on
its output array -- the CuPy ndarray, FLAME's allocator callback into the pool, and the same again when the array dies
-- than on launching its kernel. While the bin is on, a Tensor that dies holding the only reference to a small
C-contiguous base array (no view of it, no other array over its memory, nothing else holding it) hands the array to a
bin keyed by (shape, dtype, the stream its block belongs to); the next small op's output of that shape and dtype on
that stream takes it (`take`) instead of creating one. Same stream only, as the pool's own free lists: the kernels
that used the array are queued before whatever reuses it.

Accounting stays the pool's: binning an array counts as a free of its block (allocated, requested and the free count
move as at a free) and taking it as an allocation (a cache hit; the peak updated), so memory_allocated and the peaks
read what they would without the bin. The block stays in the pool's live map while binned, so whatever lists or
releases blocks (live items, summaries, segments, empty_cache, the out-of-memory retry, a CUDA graph capture pinning
its stream) first settles the pool: `reclaim` drops the bin (its arrays die and their blocks return to the free
lists). Bounded: PER_KEY arrays per key, MAX_BYTES in all.

On (`enable`, by `memory.cuda.install`) when the process sees one GPU and FLAME_RECYCLE_SMALL is not 0; off while
origin tracking or a pool observer (the memory profiler) is on: they see every allocation and free. Blocks of a pinned
stream (a CUDA graph's) are never binned. The hook is `Tensor.__del__`, installed only while the bin is on.

`take` and the `__del__` hook run once per eager op each: where the C extension is built (flame_core.speedups) they
are its C versions of `py_take` and `_tensor_del` below (flame_core/csrc/recycle.c), which stay the specification
and the fallback.
"""
import os
import sys

from .. import backend, speedups

MAX_NUMEL = 65536  # kernels.pointwise_small's bound
PER_KEY = 8
MAX_BYTES = 16 << 20

on = [False]  # read inline by the hot path (kernels.pointwise_small)
bins = {}  # (shape, dtype, stream ptr) -> [(array, block)]
held = [0, 0]  # [arrays, bytes] in the bins
counts = {"binned": 0, "taken": 0}
_pool = [None]
_nd = backend._cupy_ndarray if backend.cupy is not None else None
_getrc = sys.getrefcount
_current_stream = backend.cupy.cuda.get_current_stream if backend.cupy is not None else None
_FLAG_ATTR = _nd is not None and hasattr(_nd, "_c_contiguous")  # CuPy's internal flag (else the public flags)


def requested():
    """Whether the environment allows the bin: FLAME_RECYCLE_SMALL (default on), and its only reader, the small-array
    fast path, on (FLAME_SMALL_POINTWISE=0 turns that off: a bin nobody takes from would only hold memory)."""
    off = ("0", "false", "no", "off")
    return (os.environ.get("FLAME_RECYCLE_SMALL", "1").strip().lower() not in off
            and os.environ.get("FLAME_SMALL_POINTWISE", "1") != "0")


def _tensor_del(self):
    """Tensor.__del__ while the bin is on: bin the tensor's array when it is the last holder (see the docstring)."""
    try:
        a = self.__dict__.get("_data")
        # refcounts: a's (one holder: this tensor's dict) + the local + the call's argument
        if type(a) is not _nd or a.size > MAX_NUMEL or _getrc(a) != 3 or a.base is not None \
                or not (a._c_contiguous if _FLAG_ATTR else a.flags.c_contiguous):
            return
        mp = a.data
        mem = mp.mem
        if _getrc(mp) != 3 or _getrc(mem) != 3:  # another array (or pointer) over the same memory
            return
        pool = _pool[0]
        if pool is None or not on[0]:
            return
        blk = pool._live.get(mp.ptr)
        if blk is None or blk.free:
            return
        stream = blk.sub.stream
        size = blk.size
        if stream in pool._pinned_streams or held[1] + size > MAX_BYTES:
            return
        key = (a.shape, a.dtype, stream)
        lst = bins.get(key)
        if lst is None:
            lst = bins[key] = []
        elif len(lst) >= PER_KEY:
            return
        lock = pool._lock
        if not lock.acquire(False):  # the pool is busy (another thread, or GC inside malloc): let the array die
            return
        try:
            if not on[0]:
                return
            blk.tag = None
            pool.allocated -= size
            pool.requested -= blk.requested
            pool.bytes_freed_total += size
            pool.num_free += 1
            held[0] += 1
            held[1] += size
            counts["binned"] += 1
            lst.append((a, blk))
        finally:
            lock.release()
    except (TypeError, NameError):  # interpreter shutdown: this module's globals may be None or gone already
        pass


def py_take(shape, dtype):
    """A binned array of this shape and dtype on the current stream, counted as allocated again, or None."""
    lst = bins.get((shape, dtype, _current_stream().ptr))
    if not lst:
        return None
    pool = _pool[0]
    lock = pool._lock
    if not lock.acquire(False):
        return None
    try:
        if not lst:
            return None
        a, blk = lst.pop()
        size = blk.size
        held[0] -= 1
        held[1] -= size
        counts["taken"] += 1
        pool.cache_hits += 1
        pool.requested += blk.requested
        n = pool.allocated = pool.allocated + size
        if n > pool.peak_allocated:
            pool.peak_allocated = n
        return a
    finally:
        lock.release()


_c = speedups.module
if _c is not None:
    _c.configure_recycle(globals())
take = _c.take if _c is not None else py_take  # (shape, dtype) -> a binned array counted as allocated again, or None
_hooks = {}  # Tensor class -> its installed __del__ (the C method descriptor or _tensor_del)


def del_hook(cls):
    """The `__del__` that `enable` installs on `cls`: the C hook where the extension is built, else _tensor_del."""
    hook = _hooks.get(cls)
    if hook is None:
        hook = _hooks[cls] = _c.del_for(cls) if _c is not None else _tensor_del
    return hook


def reclaim():
    """Drop the bin: its blocks counted as allocated again, then its arrays released (their frees reach the pool as
    usual). The pool calls it with its lock held (DevicePool.reclaim); the frees then wait in its pending list until
    it drains them."""
    if not held[0]:
        bins.clear()
        return
    pool = _pool[0]
    drop = []
    for lst in bins.values():
        for a, blk in lst:
            pool.allocated += blk.size
            pool.requested += blk.requested
            pool.bytes_freed_total -= blk.size
            pool.num_free -= 1
            drop.append(a)
    bins.clear()
    held[0] = held[1] = 0
    del drop  # (inside the pool's lock: each free is deferred to its pending list)


def enable(pool):
    """Bin small dead arrays for `pool` (the one GPU's pool); hooks Tensor.__del__."""
    tensor_cls = sys.modules["flame_core.tensor"].Tensor
    _pool[0] = pool
    pool.reclaim = reclaim
    on[0] = True
    tensor_cls.__del__ = del_hook(tensor_cls)


def disable():
    """Stop binning: unhook Tensor.__del__ and settle the pool (the bin's arrays released)."""
    on[0] = False
    tensor_cls = sys.modules["flame_core.tensor"].Tensor
    if tensor_cls.__dict__.get("__del__") is del_hook(tensor_cls):
        del tensor_cls.__del__
    pool = _pool[0]
    if pool is not None:
        pool.settle()
        pool.reclaim = None


def is_enabled():
    return on[0]
