"""Accounting of FLAME tensor storage on cpu.

NumPy arrays cannot use a custom allocator, so storage is counted where tensors are born: `flame_core.tensor._wrap`
calls `on_birth(arr)`, which walks `arr.base` to the array that owns the storage, counts its `nbytes` once, and
subtracts them when that array is deallocated (a weakref callback). Views, reshapes and `.grad` views of a flat
gradient buffer therefore count nothing extra. What is counted: the storage of arrays that back FLAME tensors,
for as long as the owning array lives (also when a NumPy array shared with `from_numpy` outlives the tensor).
Temporaries inside an op that never become a tensor are not counted. Reserved equals allocated (no cache).
Cost: about 0.55 us per new storage (its weakref callback included), 0.2 us per view (2-core dev box).
Deaths are accounted lazily, at the next birth or counter read (see `_dead`): the same figures.

The limit applies at birth: a tensor whose storage would take allocated bytes over it raises OutOfMemoryError
(NumPy had already made the array; it is released as the exception unwinds) and the process goes on.

On demand: the birth hook costs ~1.6 us per small op (about a quarter of an eager op's host time on cpu), so it is
installed only once something needs the figures -- `enable()`, which every reader turns on: the `flame_core.memory`
functions for the cpu device (stats, summary, peak reset, `set_memory_limit`), a `MemoryProfiler` on cpu, setting an
observer, reading a counter of `T` -- or FLAME_CPU_MEMORY_ACCOUNTING=1 (on from import: the peak and the counts then
cover the whole process). `enable()` installs the hook and then counts the storages of every tensor alive (one walk of
the garbage collector's objects), so `memory_allocated('cpu')` is the same figure as with accounting from the start;
from then on the bookkeeping is exact and stays on. What the first read cannot know: the peak, counts and totals of
what was born and died before it (the peak starts at the current allocation), and a storage that outlived every
tensor over it (an array given to `from_numpy` whose tensor is gone) -- counted from its next tensor birth on.
"""
import gc
import os
import sys
import weakref

import numpy as np

from ..errors import OutOfMemoryError
from . import tracking

_nd = np.ndarray


class _Ref(weakref.ref):
    """Weak reference to an array that owns tensor storage; remembers its size for when it dies."""
    __slots__ = ("key", "nbytes", "origin")  # origin is set only while tracking is on

    @property
    def info(self):
        """(nbytes, shape, dtype, origin); shape/dtype are read from the array (None once it died)."""
        a = self()
        return (self.nbytes, None if a is None else a.shape, None if a is None else a.dtype,
                getattr(self, "origin", None))


class CpuTracker:
    name = "cpu"
    cache_hits = cache_misses = num_splits = num_merges = num_alloc_retries = 0

    def __init__(self):
        self._live = {}  # id(owning array) -> _Ref
        self._allocated = self._peak = 0
        self._num_free = self.num_ooms = 0
        self._freed = 0
        self.limit = None
        self._observer = None

    # the counters a death changes are read through _settle (deaths are accounted lazily, see on_birth); every read
    # turns the accounting on (see enable)
    @property
    def allocated(self):
        if not _on:
            enable()
        if _dead:
            _settle()
        return self._allocated

    @property
    def peak_allocated(self):
        if not _on:
            enable()
        return self._peak

    @property
    def num_free(self):
        if not _on:
            enable()
        if _dead:
            _settle()
        return self._num_free

    @property
    def bytes_freed_total(self):
        if not _on:
            enable()
        if _dead:
            _settle()
        return self._freed

    @property
    def observer(self):
        return self._observer

    @observer.setter
    def observer(self, fn):
        """Told (event, tracker, ref) of each "alloc" and "free" (the profiler); setting one turns accounting on."""
        if fn is not None and not _on:
            enable()
        self._observer = fn

    # derived so that the birth hook updates only `allocated` and the peak
    num_alloc = property(lambda self: len(self._live) + self.num_free)  # num_free first: it settles
    bytes_allocated_total = property(lambda self: self.allocated + self.bytes_freed_total)
    # cpu storage is never cached: reserved == allocated, and every storage is one host allocation
    reserved = property(lambda self: self.allocated)
    peak_reserved = property(lambda self: self.peak_allocated)
    requested = property(lambda self: self.allocated)
    num_device_alloc = property(lambda self: self.num_alloc)
    num_device_free = property(lambda self: self.num_free)

    def live_items(self):
        if not _on:
            enable()
        if _dead:
            _settle()
        return [r.info for r in list(self._live.values())]

    def reset_peak(self):
        self._peak = self.allocated  # (reading allocated turns accounting on)

    def set_limit(self, nbytes):
        if not _on:
            enable()
        self.limit = None if nbytes is None else int(nbytes)

    def empty_cache(self):
        return 0


T = CpuTracker()
_live = T._live
cuda_birth = None  # set by flame_core.memory.cuda (set_cuda_birth) while its pool wants device blocks tagged at birth
_on = False  # cpu storage accounting is running (see enable)
# Deaths are accounted lazily: a storage's weakref callback is `_dead.append` (C: no Python frame while NumPy frees
# the array), and `_settle` subtracts what died before the next birth and before any counter is read, so every figure
# is what immediate accounting gives (the peak included: it only moves at births). While an observer (the memory
# profiler) is installed, new storages report their death at once through `_gone`.
_dead = []
_note_death = _dead.append


def _settle():
    """Account the storages that died since the last birth or read (on_birth runs the same loop inline: hot path)."""
    while _dead:
        _gone(_dead.pop())


def _gone(ref):
    k = ref.key
    if _live.get(k) is ref:
        del _live[k]
    n = ref.nbytes
    t = T
    t._allocated -= n
    t._num_free += 1
    t._freed += n
    if t._observer is not None:
        t._observer("free", t, ref)


def on_birth(arr):
    """Called by `_wrap` with the array of every new tensor."""
    t = T
    while _dead:  # _settle, inlined (one frame fewer per death); before the id check: a dead storage's id may be ours
        r = _dead.pop()
        k = r.key
        if _live.get(k) is r:
            del _live[k]
        n = r.nbytes
        t._allocated -= n
        t._num_free += 1
        t._freed += n
        if t._observer is not None:
            t._observer("free", t, r)
    if type(arr) is _nd:
        base = arr
        b = arr.base
        if b is not None:  # a view: the storage is its base's (a fresh op output has no base: the common case)
            while b is not None and (type(b) is _nd or isinstance(b, _nd)):
                base = b
                b = b.base
    elif isinstance(arr, _nd):
        base = arr
        b = arr.base
        while b is not None and (type(b) is _nd or isinstance(b, _nd)):
            base = b
            b = b.base
    else:
        if cuda_birth is not None:
            cuda_birth(arr)
        return
    k = id(base)
    if k in _live:
        return
    n = base.nbytes
    if t.limit is not None and t._allocated + n > t.limit:
        _oom(base)
    observer = t._observer
    r = _Ref(base, _note_death if observer is None else _gone)
    r.key = k
    r.nbytes = n
    if tracking._enabled:
        r.origin = tracking.origin()
    _live[k] = r
    t._allocated += n  # one statement: a weakref callback cannot run between its read and write
    if t._allocated > t._peak:
        t._peak = t._allocated
    if observer is not None:
        observer("alloc", t, r)


def _cuda_only_birth(arr):
    """The birth hook while cpu accounting is off and FLAME's cuda pool tags at birth: cuda tensors only."""
    if not isinstance(arr, _nd):
        cuda_birth(arr)


def _install_hook():
    """The tensor birth hook for the current state: on_birth (cpu accounting on; it also hands cuda arrays to
    cuda_birth), _cuda_only_birth (off, cuda tags at birth: see memory.cuda) or none."""
    tensor = sys.modules["flame_core.tensor"]  # the module: the attribute flame_core.tensor is the function
    tensor._memory_hook = on_birth if _on else (_cuda_only_birth if cuda_birth is not None else None)


def set_cuda_birth(fn):
    """Install (fn) or remove (None) the cuda pool's tagging of new device tensors (flame_core.memory.cuda)."""
    global cuda_birth
    cuda_birth = fn
    _install_hook()


def is_enabled():
    return _on


def enable():
    """Turn cpu storage accounting on (idempotent; it stays on): install the birth hook, then count the storage of
    every tensor alive now, so the figures are those of accounting since import (see the module's docstring)."""
    global _on
    if _on:
        return
    _on = True
    _settle()  # (nothing is pending unless on_birth was called by hand): a dead storage's id may be reused below
    _install_hook()  # first: a tensor born during the walk below is counted by the hook (a storage counts once)
    tensor_cls = sys.modules["flame_core.tensor"].Tensor
    t = T
    for o in gc.get_objects():
        if isinstance(o, tensor_cls):
            arr = getattr(o, "_data", None)
            if isinstance(arr, _nd):
                base = arr
                b = arr.base
                while b is not None and isinstance(b, _nd):
                    base = b
                    b = b.base
                k = id(base)
                if k not in _live:
                    r = _Ref(base, _note_death if t._observer is None else _gone)
                    r.key = k
                    r.nbytes = base.nbytes
                    _live[k] = r
                    t._allocated += r.nbytes
    if t._allocated > t._peak:
        t._peak = t._allocated


def _oom(base):
    from .stats import oom_message
    T.num_ooms += 1
    raise OutOfMemoryError(oom_message(T, base.nbytes, base.nbytes, f"cpu tensor {tuple(base.shape)} {base.dtype}",
                                       None))


if os.environ.get("FLAME_CPU_MEMORY_ACCOUNTING", "0").strip().lower() not in ("0", "", "false", "no", "off"):
    _on = True  # flame_core.memory installs the hook on import (_install_hook)
