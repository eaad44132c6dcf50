"""The cached kernel switch (loader._state) that the per-op paths read without a call: it follows FLAME_KERNELS as it
changes at runtime and `loader.reference()` blocks (this thread's only), exactly as `loader.enabled()` does.
Runs on the cpu: pointwise_small._ready is given stand-in cuda arrays and a stand-in GPU."""
import threading
import types

import numpy as np
import pytest

from flame_core import backend
from flame_core.kernels import loader
from flame_core.kernels import pointwise_small as PS


class _FakeCudaArray:
    def __init__(self, n=16, dtype=np.float32, device_id=0):
        self.size, self.shape, self.dtype = n, (n,), np.dtype(dtype)
        self._c_contiguous = True
        self.data = types.SimpleNamespace(device_id=device_id)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(PS, "_nd", _FakeCudaArray)
    monkeypatch.setattr(PS, "_CUPY_FLAG_ATTR", True)
    monkeypatch.setattr(backend, "_cuda_ok", True)
    monkeypatch.setattr(PS, "_one_device", True)


def _ready():
    x = _FakeCudaArray()
    return PS._ready(x, _FakeCudaArray())


def test_ready_follows_flame_kernels_changes(fake_gpu, monkeypatch):
    monkeypatch.delenv("FLAME_KERNELS", raising=False)
    assert _ready() == (0, 0) and loader.enabled()
    assert _ready() == (0, 0)  # the cached state
    monkeypatch.setenv("FLAME_KERNELS", "0")
    assert _ready() is None and not loader.enabled()
    assert _ready() is None
    monkeypatch.setenv("FLAME_KERNELS", "1")
    assert _ready() == (0, 0) and loader.enabled()
    monkeypatch.setenv("FLAME_KERNELS", "off")
    assert _ready() is None and not loader.enabled()
    monkeypatch.setenv("FLAME_KERNELS", "off")  # the same value set again (a new object): still off
    assert _ready() is None
    monkeypatch.delenv("FLAME_KERNELS")
    assert _ready() == (0, 0)


def test_ready_follows_reference_blocks_of_its_own_thread_only(fake_gpu, monkeypatch):
    monkeypatch.setenv("FLAME_KERNELS", "1")
    assert _ready() == (0, 0)
    with loader.reference():
        assert _ready() is None and not loader.enabled()
        with loader.reference():
            assert _ready() is None
        assert _ready() is None
    assert _ready() == (0, 0) and loader._state[2] == 0
    # a reference block open in another thread leaves this one's kernels on
    inside, leave, seen = threading.Event(), threading.Event(), []

    def other():
        with loader.reference():
            seen.append(loader.enabled())
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        assert _ready() == (0, 0) and loader.enabled()
    finally:
        leave.set()
        t.join()
    assert seen == [False] and loader._state[2] == 0


def test_ready_without_a_gpu_or_with_other_operands(monkeypatch):
    monkeypatch.setattr(PS, "_nd", _FakeCudaArray)
    monkeypatch.setattr(PS, "_CUPY_FLAG_ATTR", True)
    monkeypatch.setattr(PS, "_one_device", True)
    monkeypatch.setenv("FLAME_KERNELS", "1")
    monkeypatch.setattr(backend, "_cuda_ok", False)
    assert _ready() is None  # no GPU: loader.enabled() decides
    monkeypatch.setattr(backend, "_cuda_ok", True)
    assert PS._ready(_FakeCudaArray(), _FakeCudaArray(dtype=np.float16)) is None
    assert PS._ready(_FakeCudaArray(dtype=np.float16)) == (1, 0)
    assert PS._ready(_FakeCudaArray(dtype=np.float64)) is None


def test_device_check_runs_until_one_gpu_is_known(monkeypatch):
    monkeypatch.setattr(PS, "_nd", _FakeCudaArray)
    monkeypatch.setattr(PS, "_CUPY_FLAG_ATTR", True)
    monkeypatch.setattr(backend, "_cuda_ok", True)
    monkeypatch.setenv("FLAME_KERNELS", "1")
    monkeypatch.setattr(PS, "_get_device", lambda: 1)
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(PS, "_one_device", None)
    assert PS._ready(_FakeCudaArray(device_id=0)) is None  # not on the current device
    assert PS._ready(_FakeCudaArray(device_id=1), _FakeCudaArray(device_id=0)) is None
    assert PS._ready(_FakeCudaArray(device_id=1)) == (0, 1) and PS._one_device is False
    assert PS._ready(_FakeCudaArray(device_id=0)) is None  # several GPUs: checked every call
    monkeypatch.setattr(PS, "_one_device", None)
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(PS, "_get_device", lambda: 0)
    assert PS._ready(_FakeCudaArray()) == (0, 0) and PS._one_device is True
