"""PackedLaunch's per-call argument writing (the per-op launch path), without a GPU: the driver launch is replaced by a
recorder that reads the packed parameter array it is handed, so the test sees exactly what the kernel would get."""
import ctypes
import types

import numpy as np
import pytest

from flame_core.kernels import launching


class _Recorder:
    """Calls of the driver launch: (function, grid, block, shared memory, stream, the 8-byte argument slots)."""

    def __init__(self):
        self.calls = []
        self.n_args = 0

    def launch(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        addrs = (ctypes.c_uint64 * self.n_args).from_address(params)  # pointers to each argument's slot
        self.calls.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream,
                           [ctypes.c_uint64.from_address(a).value for a in addrs]))


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(launching, "_driver_launch", rec.launch)
    monkeypatch.setattr(launching, "_current_stream", lambda: types.SimpleNamespace(ptr=77))
    return rec


def _kernel(ptr=1234):
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr))


def test_leading_dynamic_slots_are_written_each_call(recorder):
    recorder.n_args = 4
    pl = launching.PackedLaunch(_kernel(), (5,), (256,), (None, None, None, np.int32(4096)), 3)
    pl((11, 22, 2 ** 63 + 5))
    pl.launch_raw((33, 44, 55))
    (fn, grid, block, smem, stream, first), second = recorder.calls[0], recorder.calls[1][5]
    assert (fn, grid, block, smem, stream) == (1234, (5, 1, 1), (256, 1, 1), 0, 77)
    assert first == [11, 22, 2 ** 63 + 5, 4096]
    assert second == [33, 44, 55, 4096]  # the fixed int32 argument stays in its slot


def test_dynamic_slots_at_listed_indices(recorder):
    recorder.n_args = 4
    pl = launching.PackedLaunch(_kernel(), 2, 128, (np.int64(-1), None, np.float32(1.5), None), (1, 3))
    pl((8, 9))
    slots = recorder.calls[0][5]
    assert slots[1] == 8 and slots[3] == 9
    assert slots[0] == np.uint64(np.int64(-1).view(np.uint64))
    assert slots[2] & 0xFFFFFFFF == int(np.float32(1.5).view(np.uint32))


def test_a_call_with_fewer_values_writes_only_those(recorder):
    # zip semantics, as before the slice store: a short value tuple leaves the remaining slots as they were
    recorder.n_args = 3
    pl = launching.PackedLaunch(_kernel(), 1, 32, (None, None, np.int32(7)), 2)
    pl((1, 2))
    pl((3,))
    assert recorder.calls[1][5] == [3, 2, 7]


def test_fixed_arity_launches_write_what_a_call_writes(recorder):
    recorder.n_args = 4
    pl3 = launching.PackedLaunch(_kernel(), (3,), (256,), (None, None, None, np.int32(96)), 3)
    pl3((1, 2, 3))
    pl3.launch3(1, 2, 3)
    pl2 = launching.PackedLaunch(_kernel(9), (2, 2), (64,), (None, None, np.int32(5), np.int64(6)), 2)
    pl2((7, 2 ** 64 - 1))
    pl2.launch2(7, 2 ** 64 - 1)
    c = recorder.calls
    assert c[0] == c[1] and c[0][5] == [1, 2, 3, 96]
    assert c[2] == c[3] and c[2][1] == (2, 2, 1) and c[2][5] == [7, 2 ** 64 - 1, 5, 6]
    # slots not leading the argument list: the general call writes them
    recorder.n_args = 3
    odd = launching.PackedLaunch(_kernel(), 1, 32, (np.int32(4), None, None), (1, 2))
    odd.launch2(8, 9)
    assert recorder.calls[-1][5] == [4, 8, 9]
