"""Cuda block tags on demand, without a GPU: the tensor birth hook is installed only while tags are needed at birth
(origin tracking, an observer on a pool); else a report's `live_items()` tags the blocks of the live tensors with one
walk of the garbage collector -- the same tags birth tagging writes (fake backend, stand-in cuda arrays)."""
import types

import numpy as np
import pytest

import flame_core as flame
from flame_core.memory import cpu_tracking, tracking
from flame_core.memory import cuda as mcuda
from flame_core.memory.pool import DevicePool

from .fake_backend import FakeBackend


class _FakeCudaArray:
    """What the tagging reads of a cupy.ndarray: data.device_id, data.mem.ptr (the block), shape, dtype, base."""

    def __init__(self, ptr, shape, dtype, device_id, base=None):
        self.data = types.SimpleNamespace(device_id=device_id, mem=types.SimpleNamespace(ptr=ptr))
        self.shape, self.dtype, self.base = shape, np.dtype(dtype), base
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize


def _tensor(arr):
    t = flame.Tensor.__new__(flame.Tensor)  # a stand-in cuda tensor (no _wrap: its array is not CuPy's)
    t._data = arr
    t._version = [0]
    return t


@pytest.fixture
def pools(monkeypatch):
    """Two watched fake pools (devices 8 and 9) in the cuda module's table, the pool marked installed."""
    made = {}
    for dev in (8, 9):
        pool = made[dev] = DevicePool(FakeBackend(), name=f"cuda:{dev}")
        mcuda._watch(pool)
        monkeypatch.setitem(mcuda.pools, dev, pool)
    prev = cpu_tracking.cuda_birth
    monkeypatch.setattr(mcuda, "_installed", True)
    monkeypatch.setattr(tracking, "_enabled", False)
    yield made
    cpu_tracking.set_cuda_birth(prev)


def test_lazy_tags_equal_birth_tags(pools, no_gc):
    born, lazy = pools[8], pools[9]
    keep = []
    for shape, dtype in (((750,), "float32"), ((4, 8), "float16"), ((3,), "float64")):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        for dev, pool in ((8, born), (9, lazy)):
            arr = _FakeCudaArray(pool.malloc(nbytes), shape, dtype, dev)
            keep.append(_tensor(arr))
            if dev == 8:
                mcuda._birth(arr)
    buffer = lazy.malloc(1000)  # a buffer no tensor was born on: stays untagged
    born.malloc(1000)
    assert all(b.tag is None for b in lazy._live.values())
    assert sorted(lazy.live_items(), key=repr) == sorted(born.live_items(), key=repr)
    assert lazy._live[buffer].tag is None
    assert sum(1 for it in lazy.live_items() if it[1] is not None) == 3
    del keep


def test_a_shared_block_is_named_after_its_owner_and_tags_clear_on_free(pools, no_gc):
    pool = pools[9]
    p = pool.malloc(4000)
    owner = _FakeCudaArray(p, (1000,), "float32", 9)
    view = _FakeCudaArray(p, (10, 10), "float32", 9, base=owner)  # a view: same block, not its owner
    tensors = [_tensor(view), _tensor(owner)]
    assert mcuda.tag_live() == 1
    assert pool._live[p].tag == ((1000,), np.dtype("float32"), None)
    assert mcuda.tag_live() == 0  # tagged blocks are left alone
    pool.free(p)
    del tensors
    q = pool.malloc(4000)
    assert q == p and pool._live[q].tag is None  # a reused block carries no stale tag
    t = _tensor(_FakeCudaArray(q, (2, 500), "float32", 9))
    assert pool.live_items()[0][:3] == (4096, (2, 500), np.dtype("float32"))
    del t


def test_oom_report_names_live_tensors_without_birth_tags(pools, no_gc):
    pool = pools[9]
    pool.set_limit(4 << 20)
    big = _tensor(_FakeCudaArray(pool.malloc(3 << 20), (3 << 18,), "float32", 9))
    with pytest.raises(flame.OutOfMemoryError) as ei:
        pool.malloc(2 << 20)
    assert "(786432,) float32" in str(ei.value)
    del big


def test_birth_hook_installed_only_while_needed(pools):
    mcuda.refresh_birth()
    assert cpu_tracking.cuda_birth is None  # nothing needs tags at birth
    pools[9].observer = lambda *a: None  # a profiler on a pool
    assert cpu_tracking.cuda_birth is mcuda._birth
    pools[9].observer = None
    assert cpu_tracking.cuda_birth is None
    try:
        tracking.set_tracking(True)  # origins are only known at birth
        assert cpu_tracking.cuda_birth is mcuda._birth
        pools[8].observer = lambda *a: None
        tracking.set_tracking(False)
        assert cpu_tracking.cuda_birth is mcuda._birth  # the observer still needs it
        pools[8].observer = None
        assert cpu_tracking.cuda_birth is None
    finally:
        tracking.set_tracking(False)
    mcuda._installed = False  # (restored by the fixture) not installed: refresh leaves the hook alone
    cpu_tracking.set_cuda_birth(None)
    pools[9].observer = lambda *a: None
    assert cpu_tracking.cuda_birth is None
    pools[9].observer = None


def test_profiler_sees_birth_tags_through_the_observer(pools, no_gc):
    pool = pools[9]
    events = []
    pool.observer = lambda ev, acct, blk: events.append((ev, blk.tag))
    try:
        assert cpu_tracking.cuda_birth is mcuda._birth
        p = pool.malloc(3000)
        cpu_tracking.cuda_birth(_FakeCudaArray(p, (750,), "float32", 9))  # what _wrap's hook does
        assert events == [("alloc", None), ("tag", ((750,), np.dtype("float32"), None))]
    finally:
        pool.observer = None
