"""tma.TiledMap's checks (before any driver call) and PackedLaunch's by-value TensorMap slots: CPU tests; the GPU
tests of the maps in use are the attention forward's (tests/kernels/test_attention.py)."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from flame_core.kernels import tma

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dims, strides, box, what", [
    ([128, 4608, 24], [6144, 256], (64, 128, 1, 1), "ranks disagree"),         # 3 dims, a 4-D box
    ([128, 4608, 24, 1], [6144, 256, 16], (32, 128, 1, 1), "128-byte box rows"),
    ([128, 4608, 24, 1], [6144, 256, 16], (64, 512, 1, 1), "at most 256"),
    ([128, 4608, 24, 2], [6144, 0, 16], (64, 128, 1, 1), "multiples of 16"),   # a broadcast head dimension
    ([128, 4608, 24, 1], [6152, 256, 16], (64, 128, 1, 1), "multiples of 16"),
    ([128, 4608, 24, 1], [2 ** 40, 256, 16], (64, 128, 1, 1), "below 2\\*\\*40"),
    ([0, 4608, 24, 1], [6144, 256, 16], (64, 128, 1, 1), "multiples of 16|dims"),
])
def test_tiled_map_refuses_what_tma_cannot_describe(dims, strides, box, what):
    with pytest.raises(ValueError, match=what):
        tma.TiledMap(BF16, dims, strides, box, tma.TensorMap(2), 0)


def test_tiled_map_checks_its_slot_and_dtype():
    with pytest.raises(ValueError, match="slot 2 of a parameter of 2"):
        tma.TiledMap(BF16, [128, 64, 1, 1], [256, 16384, 16384], (64, 64, 1, 1), tma.TensorMap(2), 2)
    with pytest.raises(TypeError, match="float64"):
        tma.TiledMap(np.float64, [16, 64], [128], (16, 64), tma.TensorMap(1), 0)


def test_tiled_map_refuses_an_unaligned_address_before_the_driver():
    m = tma.TiledMap(BF16, [128, 64, 1, 1], [256, 16384, 16384], (64, 64, 1, 1), tma.TensorMap(2), 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        m.encode(0x1008)


def test_packed_launch_passes_a_tensor_map_from_its_own_buffer():
    """A TensorMap argument's parameter pointer is the map's host buffer (read at each launch), so re-encoding the
    map between calls changes what the next launch passes; the other slots stay packed values."""
    from flame_core.kernels import launching as KL

    class _Fn:  # the driver function a PackedLaunch reads (.ptr); no launch happens here
        ptr = 0

    class _Kernel:
        kernel = _Fn()

    m = tma.TensorMap(2)
    ctypes.memset(m.address, 7, tma.MAP_BYTES * 2)
    pl = KL.PackedLaunch(_Kernel(), (1,), (32,), (None, np.int32(5), m), 1)
    params = (ctypes.c_void_p * 3).from_address(pl._pa)
    assert params[2] == m.address
    assert ctypes.c_int32.from_address(params[1]).value == 5
    assert ctypes.string_at(params[2], 4) == b"\x07" * 4
