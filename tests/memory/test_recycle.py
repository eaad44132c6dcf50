"""memory.recycle (the bin of small dead cuda arrays) under the fake device backend: a stand-in with CuPy's array /
MemoryPointer / memory-object structure, whose memory object frees its block when it dies as CuPy's
PythonFunctionAllocatorMemory does. The GPU side (real CuPy arrays through kernels.pointwise_small) is in
tests/kernels/test_pointwise_small.py."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flame_core.errors import OutOfMemoryError
from flame_core.memory import recycle
from flame_core.memory.pool import DevicePool, MiB, round_size

from .fake_backend import FakeBackend


class Mem:  # CuPy's memory object: frees its block when the last MemoryPointer over it dies
    def __init__(self, pool, nbytes):
        self.pool, self.ptr = pool, pool.malloc(nbytes)

    def __del__(self):
        self.pool.free(self.ptr)


class Ptr:  # MemoryPointer
    def __init__(self, mem, offset=0):
        self.mem, self.ptr = mem, mem.ptr + offset


class Arr:  # a CuPy ndarray's attributes that the bin reads
    def __init__(self, pool, shape, dtype=np.dtype(np.float32), data=None, base=None, contiguous=True):
        self.shape, self.dtype = shape, dtype
        self.size = int(np.prod(shape))
        self.data = data if data is not None else Ptr(Mem(pool, self.size * dtype.itemsize))
        self.base = base
        self._c_contiguous = contiguous
        self.flags = SimpleNamespace(c_contiguous=contiguous)


class Holder:  # a Tensor: its array in its __dict__ as `_data`
    __del__ = recycle._tensor_del

    def __init__(self, a):
        self._data = a


class CHolder(Holder):  # the same, dying through the C hook
    pass


if recycle._c is not None:
    CHolder.__del__ = recycle._c.del_for(CHolder)

IMPLS = ["python", pytest.param("c", marks=pytest.mark.skipif(recycle._c is None, reason="flame_core._speedups is "
                                                               "not built (no C compiler at install)"))]


@pytest.fixture(params=IMPLS)
def env(request, monkeypatch):
    """The fake pool with the bin on; `env.Holder` dies through the Python hook or the C one (flame_core._speedups),
    and recycle.take is the same implementation's."""
    c = request.param == "c"
    monkeypatch.setattr(recycle, "take", recycle._c.take if c else recycle.py_take)
    be = FakeBackend()
    pool = DevicePool(be, name="fake:0")
    monkeypatch.setattr(recycle, "_nd", Arr)
    monkeypatch.setattr(recycle, "_FLAG_ATTR", True)
    monkeypatch.setattr(recycle, "_current_stream", be.current_stream)
    monkeypatch.setattr(recycle, "_pool", [pool])
    monkeypatch.setattr(recycle, "on", [True])
    monkeypatch.setattr(recycle, "bins", {})
    monkeypatch.setattr(recycle, "held", [0, 0])
    pool.reclaim = recycle.reclaim
    return SimpleNamespace(pool=pool, be=be, Holder=CHolder if c else Holder)


def stats(pool):
    return pool.allocated, pool.requested, pool.num_alloc, pool.num_free, pool.bytes_allocated_total


def test_a_dead_tensor_array_is_binned_counted_free_and_taken_back_counted_allocated(env):
    pool = env.pool
    before = stats(pool)
    h = env.Holder(Arr(pool, (16,)))
    a_id = id(h._data)
    r = round_size(64)[0]
    assert pool.allocated == before[0] + r
    del h
    assert recycle.held == [1, r]
    assert stats(pool)[0] == before[0] and stats(pool)[1] == before[1]  # as after a free
    assert pool.num_free == before[3] + 1
    peak = pool.peak_allocated
    a = recycle.take((16,), np.dtype(np.float32))
    assert id(a) == a_id and recycle.held == [0, 0]
    assert pool.allocated == before[0] + r and pool.num_alloc == before[2] + 2  # a second allocation, a cache hit
    assert pool.peak_allocated == peak
    assert recycle.take((16,), np.dtype(np.float32)) is None


def test_the_peak_counts_a_taken_array_as_a_new_allocation(env):
    pool = env.pool
    h = env.Holder(Arr(pool, (16,)))
    del h
    pool.reset_peak()
    assert pool.peak_allocated == pool.allocated
    a = recycle.take((16,), np.dtype(np.float32))
    assert a is not None and pool.peak_allocated == pool.allocated == round_size(64)[0]


def test_arrays_someone_else_holds_or_shares_are_not_binned(env):
    pool = env.pool
    a = Arr(pool, (16,))
    h = env.Holder(a)
    del h  # `a` still held here
    assert recycle.held[0] == 0
    # a view (its base is the array) keeps the array; the view itself is not a base array
    base = Arr(pool, (16,))
    view = Arr(pool, (8,), data=Ptr(base.data.mem), base=base)
    h = env.Holder(view)
    del h
    assert recycle.held[0] == 0
    # another array over the same memory (base None, shared memory object)
    b = Arr(pool, (16,))
    other = Arr(pool, (16,), data=Ptr(b.data.mem))
    del other
    h = env.Holder(b)
    del b
    extra = Ptr(h._data.data.mem, 0)  # a second pointer over its memory
    del h
    assert recycle.held[0] == 0
    del extra
    # too large, not contiguous, not this pool's block start
    for arr in (Arr(pool, (recycle.MAX_NUMEL + 1,)), Arr(pool, (16,), contiguous=False)):
        h = env.Holder(arr)
        del arr, h
    assert recycle.held[0] == 0
    m = Mem(pool, 256)
    h = env.Holder(Arr(pool, (16,), data=Ptr(m, 64)))
    del m, h
    assert recycle.held[0] == 0


def test_the_bin_is_bounded_per_key_and_in_bytes(env, monkeypatch):
    pool = env.pool
    hs = [env.Holder(Arr(pool, (16,))) for _ in range(recycle.PER_KEY + 3)]
    del hs
    assert recycle.held[0] == recycle.PER_KEY
    allocated = pool.allocated
    monkeypatch.setattr(recycle, "MAX_BYTES", recycle.held[1] + 1024)
    hs = [env.Holder(Arr(pool, (300,))) for _ in range(4)]  # 1200 B -> 1536 B blocks: none fits in 1024 more bytes
    del hs
    assert recycle.held[0] == recycle.PER_KEY and pool.allocated == allocated


def test_streams_and_pinned_streams(env):
    pool, be = env.pool, env.be
    be.stream = 7
    h = env.Holder(Arr(pool, (16,)))
    del h
    be.stream = 0
    assert recycle.take((16,), np.dtype(np.float32)) is None  # another stream's array: never
    be.stream = 7
    assert recycle.take((16,), np.dtype(np.float32)) is not None
    pool.pin_stream(9)
    be.stream = 9
    h = env.Holder(Arr(pool, (16,)))
    del h
    assert recycle.held[0] == 0  # a CUDA graph's stream: its blocks go to the pool


@pytest.mark.parametrize("how", ["settle", "live_items", "live_blocks", "segments", "class_bytes", "empty_cache",
                                 "pin_stream", "release_stream"])
def test_whatever_lists_or_releases_blocks_settles_the_bin_first(env, how):
    pool = env.pool
    keep = env.Holder(Arr(pool, (32,)))
    hs = [env.Holder(Arr(pool, (16,))) for _ in range(3)]
    del hs
    assert recycle.held[0] == 3
    allocated, requested = pool.allocated, pool.requested
    if how in ("pin_stream", "release_stream"):
        getattr(pool, how)(5)
    else:
        getattr(pool, how)()
    assert recycle.held == [0, 0] and not recycle.bins
    assert pool.allocated == allocated and pool.requested == requested
    assert sum(b.size for b in pool.live_blocks()) == pool.allocated == round_size(128)[0]
    if how == "empty_cache":
        del keep
        assert pool.empty_cache() == 2 * MiB and pool.reserved == 0


def test_the_out_of_memory_retry_settles_the_bin(env):
    pool = env.pool
    pool.set_limit(2 * MiB)
    hs = [env.Holder(Arr(pool, (64 * 1024,))) for _ in range(4)]  # 4 x 256 KiB in the one 2 MiB small segment
    del hs
    assert recycle.held[0] == 4 and pool.reserved == 2 * MiB
    ptr = pool.malloc(3 * MiB // 2 + 1)  # a medium block: only after the small segment is released
    assert recycle.held[0] == 0 and pool.num_alloc_retries == 1
    pool.free(ptr)
    with pytest.raises(OutOfMemoryError):
        pool.malloc(4 * MiB)


def test_disabled_bins_nothing(env):
    recycle.on[0] = False
    h = env.Holder(Arr(env.pool, (16,)))
    del h
    assert recycle.held[0] == 0


def test_enable_and_disable_hook_tensor_del_and_cpu_tensors_pass_through(env, monkeypatch):
    import flame_core as flame
    tensor_cls = sys.modules["flame_core.tensor"].Tensor
    monkeypatch.delattr(tensor_cls, "__del__", raising=False)  # (a GPU process has the real bin on: back at teardown)
    recycle.enable(env.pool)
    try:
        assert tensor_cls.__dict__["__del__"] is recycle.del_hook(tensor_cls) and env.pool.reclaim is recycle.reclaim
        t = flame.ones(4) * 2.0  # cpu tensors die through the hook untouched
        del t
        assert recycle.held[0] == 0
    finally:
        recycle.disable()
    assert "__del__" not in tensor_cls.__dict__ and env.pool.reclaim is None and not recycle.on[0]


@pytest.mark.parametrize("env_vars, want", [({}, True), ({"FLAME_RECYCLE_SMALL": "0"}, False),
                                            ({"FLAME_RECYCLE_SMALL": "off"}, False),
                                            ({"FLAME_SMALL_POINTWISE": "0"}, False)])
def test_the_environment_switches(monkeypatch, env_vars, want):
    monkeypatch.delenv("FLAME_RECYCLE_SMALL", raising=False)
    monkeypatch.delenv("FLAME_SMALL_POINTWISE", raising=False)
    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    assert recycle.requested() is want


def test_a_death_at_interpreter_shutdown_is_quiet(env, monkeypatch):
    """Module teardown sets recycle's globals to None or removes them: a Tensor dying then bins nothing and raises
    nothing (the C hook as the Python one)."""
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)  # where an exception from __del__ goes
    h = env.Holder(Arr(env.pool, (16,)))
    monkeypatch.delattr(recycle, "bins")
    del h
    monkeypatch.setattr(recycle, "_nd", None)
    h = env.Holder(Arr(env.pool, (16,)))
    del h
    assert recycle.held[0] == 0
    assert raised == []


def test_the_public_contiguity_flags_where_cupy_has_no_internal_one(env, monkeypatch):
    monkeypatch.setattr(recycle, "_FLAG_ATTR", False)
    bent = Arr(env.pool, (16,))
    bent._c_contiguous = True  # only the public flag says it is not contiguous
    bent.flags.c_contiguous = False
    h = env.Holder(bent)
    del bent, h
    assert recycle.held[0] == 0
    h = env.Holder(Arr(env.pool, (16,)))
    del h
    assert recycle.held[0] == 1
