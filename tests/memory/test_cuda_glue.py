"""The CuPy glue without a GPU: the malloc/free functions CuPy calls dispatch to the device's pool, and the
tensor birth hook tags the block a cuda array lives on (exercised with a fake backend and a stand-in array)."""
import types

import numpy as np

from flame_core.memory import cuda as mcuda
from flame_core.memory import tracking
from flame_core.memory.pool import DevicePool

from .fake_backend import FakeBackend


def fake_cuda_array(ptr, shape, dtype, device_id):
    mem = types.SimpleNamespace(ptr=ptr)
    return types.SimpleNamespace(data=types.SimpleNamespace(device_id=device_id, mem=mem), shape=shape,
                                 dtype=np.dtype(dtype))


def test_malloc_free_dispatch_and_birth_tagging(monkeypatch):
    pool = DevicePool(FakeBackend(), name="cuda:9")
    monkeypatch.setitem(mcuda.pools, 9, pool)
    p = mcuda._malloc(3000, 9)
    assert pool.allocated == 3072 and p in pool._live
    events = []
    pool.observer = lambda ev, acct, blk: events.append((ev, blk.tag))
    monkeypatch.setattr(tracking, "_enabled", True)
    mcuda._birth(fake_cuda_array(p, (750,), "float32", 9))
    mcuda._birth(fake_cuda_array(p, (3, 250), "float32", 9))  # a second tensor on the block keeps the first tag
    shape, dtype, origin = pool._live[p].tag
    assert (shape, str(dtype)) == ((750,), "float32") and "test_cuda_glue.py" in origin
    assert [e[0] for e in events] == ["tag"]
    pool.observer = None
    mcuda._free(p, 9)
    assert pool.allocated == 0 and pool.num_free == 1
    mcuda._free(p, 42)  # an unknown device (e.g. at interpreter shutdown) is ignored, not raised from __dealloc__
    mcuda._birth(fake_cuda_array(12345, (1,), "float32", 42))  # memory FLAME's pool does not own: no-op


def test_birth_hook_hands_cuda_arrays_to_the_pool_with_cpu_accounting_on_or_off():
    # the hook a tensor birth calls: _cuda_only_birth while cpu accounting is off (the cpu path pays nothing),
    # on_birth once it is on; both hand every non-NumPy array to the cuda pool's tagging, and only that
    import sys

    from flame_core.memory import cpu_tracking
    tensor_mod = sys.modules["flame_core.tensor"]
    prev = cpu_tracking.cuda_birth
    seen = []
    try:
        cpu_tracking.set_cuda_birth(seen.append)
        expect = cpu_tracking.on_birth if cpu_tracking.is_enabled() else cpu_tracking._cuda_only_birth
        assert tensor_mod._memory_hook is expect
        stand_in = fake_cuda_array(1, (4,), "float32", 0)
        cpu_tracking._cuda_only_birth(np.zeros(4, np.float32))  # a cpu array: not the pool's
        cpu_tracking._cuda_only_birth(stand_in)
        cpu_tracking.on_birth(stand_in)
        assert seen == [stand_in, stand_in]
    finally:
        cpu_tracking.set_cuda_birth(prev)
    assert cpu_tracking.cuda_birth is prev
    assert tensor_mod._memory_hook is (cpu_tracking.on_birth if cpu_tracking.is_enabled()
                                       else cpu_tracking._cuda_only_birth if prev is not None else None)
