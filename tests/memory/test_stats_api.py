"""The PyTorch-named stats API on the device under test (cpu: tensor storage; cuda: FLAME's pool)."""
import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M

from .conftest import storage

MiB = 1 << 20


def test_allocated_counts_each_storage_once_and_returns_on_release(device, no_gc):
    a0 = M.memory_allocated(device)
    x = flame.zeros(1000, device=device)  # 4000 B
    one = storage(4000, device)
    assert M.memory_allocated(device) - a0 == one
    v = x.reshape(10, 100)[2:5].transpose(0, 1)  # views share the storage
    assert M.memory_allocated(device) - a0 == one
    y = x * 2
    assert M.memory_allocated(device) - a0 == 2 * one
    del x  # the view keeps the storage alive
    assert M.memory_allocated(device) - a0 == 2 * one
    del v
    assert M.memory_allocated(device) - a0 == one
    del y
    assert M.memory_allocated(device) == a0
    assert M.memory_reserved(device) >= M.memory_allocated(device)


def test_peak_and_reset(device, no_gc):
    M.reset_peak_memory_stats(device)
    base = M.memory_allocated(device)
    assert M.max_memory_allocated(device) == base
    x = flame.ones(3 * MiB // 4, device=device)  # 3 MiB
    y = flame.ones(MiB // 4, device=device)
    del x, y
    assert M.memory_allocated(device) == base
    assert M.max_memory_allocated(device) == base + storage(3 * MiB, device) + storage(MiB, device)
    assert M.max_memory_reserved(device) >= M.max_memory_allocated(device)
    M.reset_peak_memory_stats(device)
    assert M.max_memory_allocated(device) == base


def test_memory_stats_counts(device, no_gc):
    s0 = M.memory_stats(device)
    xs = [flame.zeros(257, device=device) for _ in range(3)]
    s1 = M.memory_stats(device)
    del xs
    s2 = M.memory_stats(device)
    xs = [flame.zeros(257, device=device) for _ in range(3)]
    s3 = M.memory_stats(device)
    assert s1["num_alloc"] - s0["num_alloc"] == 3
    assert s2["num_free"] - s1["num_free"] == 3
    assert s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == 3 * storage(257 * 4, device)
    assert s1["allocation.all.current"] - s0["allocation.all.current"] == 3
    if device.type == "cuda":  # the second round is served from the cache
        assert s3["cache_hits"] - s2["cache_hits"] == 3
        assert s3["num_device_alloc"] == s2["num_device_alloc"]
    else:  # every cpu storage is a new host allocation
        assert s3["num_device_alloc"] - s2["num_device_alloc"] == 3
    for key in ("allocated_bytes.all.peak", "reserved_bytes.all.current", "cache_misses", "num_ooms",
                "num_alloc_retries", "num_device_free"):
        assert isinstance(s3[key], int)
    del xs


def test_memory_summary_names_current_numbers(device, no_gc):
    x = flame.zeros(5 * MiB // 4, device=device)
    text = M.memory_summary(device)
    assert f"device {device}" in text
    assert M.stats.fmt_bytes(M.memory_allocated(device)) in text
    assert "(1310720,) float32" in text  # the 5 MiB tensor is among the largest live
    del x


def test_limit_raises_readable_oom_then_process_continues(device, no_gc):
    M.empty_cache(device)
    M.set_tracking(True)
    headroom = M.memory_reserved(device) if device.type == "cuda" else M.memory_allocated(device)
    M.set_memory_limit(headroom + 40 * MiB, device)
    try:
        keep = flame.ones(8 * MiB, device=device)  # 32 MiB
        with pytest.raises(flame.OutOfMemoryError) as ei:
            flame.zeros(16 * MiB, device=device)  # 64 MiB: over the limit
        msg = str(ei.value)
        assert isinstance(ei.value, RuntimeError)
        assert "tried to allocate 64.00 MiB" in msg
        assert f"limit {M.stats.fmt_bytes(headroom + 40 * MiB)}" in msg
        assert f"allocated {M.stats.fmt_bytes(M.memory_allocated(device))}" in msg
        assert "reserved" in msg
        assert "(8388608,) float32" in msg and "test_stats_api.py" in msg  # the live 32 MiB tensor and its origin
        assert M.memory_stats(device)["num_ooms"] >= 1
        z = flame.ones(MiB, device=device)  # usable afterwards
        assert float((keep[:4] + z[:4]).sum().item()) == 8.0
        del z
    finally:
        M.set_memory_limit(None, device)
        M.set_tracking(False)
    assert M.get_memory_limit(device) is None
    big = flame.zeros(16 * MiB, device=device)  # no limit: fits
    assert big.shape == (16 * MiB,)
    del keep, big


def test_oom_report_without_tracking_says_how_to_enable_it(device, no_gc):
    M.empty_cache(device)  # no cached block may serve the request
    base = M.memory_reserved(device) if device.type == "cuda" else M.memory_allocated(device)
    M.set_memory_limit(base, device)
    try:
        with pytest.raises(flame.OutOfMemoryError, match="FLAME_MEMORY_TRACKING=1"):
            flame.zeros(64 * MiB, device=device)
    finally:
        M.set_memory_limit(None, device)


def test_set_memory_limit_parses_sizes_and_rejects_nonsense(device):
    try:
        M.set_memory_limit("1.5GiB", device)
        assert M.get_memory_limit(device) == 3 << 29
        M.set_memory_limit("12 GB", device)
        assert M.get_memory_limit(device) == 12 * 10 ** 9
        M.set_memory_limit(123456, device)
        assert M.get_memory_limit(device) == 123456
        with pytest.raises(ValueError, match="cannot parse"):
            M.set_memory_limit("lots", device)
        with pytest.raises(ValueError):
            M.set_memory_limit(-1, device)
        with pytest.raises(TypeError):
            M.set_memory_limit([1], device)
    finally:
        M.set_memory_limit(None, device)
    assert M.get_memory_limit(device) is None


def test_empty_cache(device, no_gc):
    if device.type == "cpu":
        assert M.empty_cache(device) == 0
        assert M.memory_reserved(device) == M.memory_allocated(device)
        return
    M.empty_cache(device)
    x = flame.zeros(12 * MiB, device=device)  # 48 MiB: a segment of its own (nothing cached to split)
    r0 = M.memory_reserved(device)
    del x
    assert M.memory_reserved(device) == r0  # cached
    released = M.empty_cache(device)
    assert released >= 48 * MiB and M.memory_reserved(device) == r0 - released


def test_cpu_stats_follow_numpy_sharing(no_gc):
    a0 = M.memory_allocated("cpu")
    arr = np.arange(1000, dtype=np.float64)
    t = flame.from_numpy(arr[100:])  # storage = the whole array it views
    assert M.memory_allocated("cpu") - a0 == 8000
    del t
    assert M.memory_allocated("cpu") - a0 == 8000  # the owning array is still alive (held by `arr`)
    del arr
    assert M.memory_allocated("cpu") == a0


def test_mem_get_info_is_for_gpus():
    with pytest.raises(flame.DeviceError, match="mem_get_info: (cpu is not a GPU|no CUDA GPU)"):
        flame.cuda.mem_get_info("cpu")
