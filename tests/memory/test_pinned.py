"""Pinned host pool: pooled blocks are reused, stats count them; on a GPU the memory is page-locked."""
import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
from flame_core.memory.pinned import PageableBackend, PinnedPool, round_pinned


def test_round_pinned():
    assert [round_pinned(n) for n in (1, 4096, 4097, (1 << 20) - 1, 1 << 20, (3 << 20) + 1)] == \
        [4096, 4096, 8192, 1 << 20, 2 << 20, 4 << 20]


def test_blocks_are_reused_after_release_and_counted():
    pool = PinnedPool(PageableBackend())
    a = pool.empty((3, 1000), np.float32)  # 12000 B -> 12288 B block
    a[...] = np.arange(3000, dtype=np.float32).reshape(3, 1000)
    ptr = a.ctypes.data
    assert (pool.allocated, pool.reserved, pool.requested, pool.num_device_alloc) == (12288, 12288, 12000, 1)
    view = a[1:]
    del a  # the view keeps the block leased
    assert pool.allocated == 12288
    np.testing.assert_array_equal(view[0], np.arange(1000, 2000, dtype=np.float32))
    del view
    assert (pool.allocated, pool.reserved, pool.num_free) == (0, 12288, 1)
    b = pool.empty((6000,), np.float16)  # same class (12000 B): same block, no new host allocation
    assert b.ctypes.data == ptr and pool.num_device_alloc == 1 and pool.cache_hits == 1
    c = pool.empty((6000,), np.float16)  # class busy: a new block
    assert c.ctypes.data != ptr and pool.num_device_alloc == 2 and pool.cache_misses == 2
    assert pool.peak_allocated == 2 * 12288
    del b, c
    assert pool.empty_cache() == 2 * 12288 and pool.reserved == 0 and pool.num_device_free == 2


def test_pinned_empty_returns_a_cpu_tensor_of_the_pool(no_gc):
    s0 = M.pinned_memory_stats()
    t = M.pinned_empty((4, 8), flame.bfloat16)
    assert t.shape == (4, 8) and t.dtype == flame.bfloat16 and t.device == flame.device("cpu")
    t._data[...] = np.arange(32).reshape(4, 8)
    np.testing.assert_array_equal(t.float().numpy(), np.arange(32, dtype=np.float32).reshape(4, 8))
    assert M.pinned_pool().owns(t._data) and M.is_pinned(t) == flame.cuda_is_available()
    s1 = M.pinned_memory_stats()
    assert s1["num_alloc"] - s0["num_alloc"] == 1
    assert s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == 4096
    del t
    assert M.pinned_memory_stats()["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert M.pinned_empty(0, "float32").shape == (0,)


@pytest.mark.gpu
def test_pinned_memory_is_page_locked_and_feeds_async_copies():
    import cupy
    t = M.pinned_empty((1 << 20,), "float32")
    assert M.is_pinned(t)
    attrs = cupy.cuda.runtime.pointerGetAttributes(t._data.ctypes.data)
    assert attrs.type == 1  # cudaMemoryTypeHost: page-locked host memory registered with CUDA
    t._data[...] = np.arange(1 << 20, dtype=np.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    d = cupy.empty(1 << 20, np.float32)
    d.set(t._data, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(d), t._data)
