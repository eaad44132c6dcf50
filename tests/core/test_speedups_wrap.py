"""Tensor birth in C (flame_core/csrc/tensor.c) against its specification, tensor.py's py_wrap."""
import sys

import numpy as np
import pytest

from flame_core import speedups

T = sys.modules["flame_core.tensor"]
pytestmark = pytest.mark.skipif(speedups.module is None, reason="flame_core._speedups is not built (no C compiler)")


def state(t):
    return type(t), type(t._data), t._data.dtype, t._data.tolist(), t._version, t.requires_grad, t.grad_fn


@pytest.mark.parametrize("arr", [np.arange(6, dtype=np.float32).reshape(2, 3), [1, 2, 3], 2.5, np.float16(1.5),
                                 np.arange(4)[::2]])
@pytest.mark.parametrize("kw", [{}, {"requires_grad": True}, {"requires_grad": False}, "positional"])
def test_the_c_birth_is_py_wrap(arr, kw):
    births = []
    for fn in (T.py_wrap, speedups.module.wrap):
        t = fn(arr, True) if kw == "positional" else fn(arr, **kw)
        births.append(state(t))
        if isinstance(arr, np.ndarray):
            assert t._data is arr  # kept as it is, no copy
    assert births[0] == births[1]
    assert births[0][4] == [0] and births[0][0] is T.Tensor


def test_the_memory_hook_sees_each_birth_and_bad_calls_raise(monkeypatch):
    seen = []
    monkeypatch.setattr(T, "_memory_hook", seen.append)
    a = np.ones(3)
    speedups.module.wrap(a)
    T.py_wrap(a)
    assert seen == [a, a]
    for bad in ((), (a, True, True)):
        with pytest.raises(TypeError):
            speedups.module.wrap(*bad)
    with pytest.raises(TypeError):
        speedups.module.wrap(a, grad=True)
    assert T._wrap is speedups.module.wrap
