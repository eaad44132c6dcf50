"""Fixtures of the kernel tests."""
import numpy as np
import pytest

from flame_core import backend
from flame_core.kernels import launching, loader


@pytest.fixture
def ab():
    """ab(fn, *numpy arrays) -> (kernel result, reference result): the same CuPy inputs through `fn` with kernels
    enabled (asserting that at least one kernel launched) and inside `loader.reference()`."""
    def run(fn, *arrays):
        cp = backend.cupy
        assert loader.enabled(), "kernels are disabled (FLAME_KERNELS=0?)"
        dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in arrays]
        before = launching.launches
        k = fn(*dev)
        assert launching.launches > before, "the kernel path did not run"
        with loader.reference():
            before = launching.launches
            r = fn(*dev)
            assert launching.launches == before, "the reference path launched a kernel"
        return k, r
    return run
