"""memory.recycle on a GPU: small dead CuPy arrays reused by kernels.pointwise_small's outputs -- the same values as
without the bin, memory_allocated unchanged by it, nothing reused while a view, a raw array or another array over
its memory lives, off under the memory profiler, settled by a graph capture. The bin's logic under the fake backend:
tests/memory/test_recycle.py."""
import gc

import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
from flame_core import backend
from flame_core.memory import recycle

pytestmark = pytest.mark.gpu


@pytest.fixture
def bin_on():
    from flame_core.memory import cuda as mcuda
    if backend.cuda_device_count() != 1 or not recycle.requested():
        pytest.skip("the bin is on with one visible GPU and FLAME_RECYCLE_SMALL unset")
    mcuda.refresh_birth()
    assert recycle.is_enabled()
    gc.collect()
    gc.disable()  # exact accounting: no cycle collection in the middle
    try:
        yield
    finally:
        gc.enable()
        M.empty_cache("cuda")


def _chain(x):
    y = x
    for _ in range(25):
        y = y * 1.01
        y = y + 0.5
        y = y.tanh()
        y = y - x
    return y.sum()


def test_a_chain_gives_the_same_bits_with_and_without_the_bin(bin_on):
    x = flame.tensor(np.linspace(-2, 2, 16, dtype=np.float32), device="cuda", requires_grad=True)
    out = {}
    for on in (False, True, False, True):
        if on:
            from flame_core.memory import cuda as mcuda
            mcuda.refresh_birth()
        else:
            recycle.disable()
        taken = recycle.counts["taken"]
        x.grad = None
        y = _chain(x)
        y.backward()
        res = (y.detach().numpy().tobytes(), x.grad.numpy().tobytes())
        if on:
            assert recycle.counts["taken"] > taken  # the chain's outputs came from the bin
        else:
            assert recycle.counts["taken"] == taken
        out.setdefault(on, res)
        assert out[on] == res
    assert out[True] == out[False]


def test_a_dead_output_is_reused_and_memory_allocated_reads_as_without_the_bin(bin_on):
    x = flame.randn(16, device="cuda")
    base = M.memory_allocated("cuda")
    y = x * 2.0
    assert M.memory_allocated("cuda") == base + 512
    arr_id = id(y._data)
    del y
    assert M.memory_allocated("cuda") == base
    z = x * 3.0
    assert id(z._data) == arr_id and M.memory_allocated("cuda") == base + 512
    np.testing.assert_allclose(z.numpy(), x.numpy() * 3.0, rtol=1e-6)
    del z
    assert M.memory_allocated("cuda") == base
    live = sum(size for size, *_ in M._accountant("cuda").live_items())
    assert live == M.memory_allocated("cuda")  # the report settles the bin: its blocks are free again


def test_nothing_is_reused_while_something_else_holds_the_memory(bin_on):
    x = flame.ones(16, device="cuda")
    y = x * 2.0
    v = y[:4]  # a view: shares y's array as its base
    del y
    w = x * 5.0
    np.testing.assert_array_equal(v.numpy(), np.full(4, 2.0, np.float32))
    y = x * 3.0
    raw = y._data  # the raw CuPy array kept by the user
    del y
    w = x * 7.0
    assert w._data is not raw
    np.testing.assert_array_equal(backend.to_numpy(raw), np.full(16, 3.0, np.float32))
    y = x * 4.0
    other = backend.cupy.ndarray(y._data.shape, y._data.dtype, memptr=y._data.data)  # another array, same memory
    del y
    w = x * 9.0
    np.testing.assert_array_equal(backend.to_numpy(other), np.full(16, 4.0, np.float32))
    del w


def test_the_memory_profiler_turns_the_bin_off_and_back_on(bin_on):
    with M.MemoryProfiler("cuda"):
        assert not recycle.is_enabled()
        assert "__del__" not in type(flame.ones(1)).__dict__
    assert recycle.is_enabled()


def test_a_graph_capture_settles_the_bin_and_its_blocks_are_never_binned(bin_on):
    x = flame.randn(16, device="cuda")
    ys = [x * float(i) for i in range(4)]
    del ys
    assert recycle.held[0] > 0
    g = flame.cuda.CUDAGraph()
    with flame.cuda.graph(g):
        out = x * 2.0
        tmp = out + 1.0
        del tmp  # dies inside the capture: its stream is pinned, so the pool keeps it
    assert recycle.held[0] == 0
    g.replay()
    np.testing.assert_allclose(out.numpy(), x.numpy() * 2.0, rtol=1e-6)
    del out
    g.reset()
