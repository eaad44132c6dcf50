"""Fixtures for the memory tests: exact byte accounting needs the cyclic GC held off while a test measures
(refcounting still frees everything the engine releases; only cycles from other tests are kept for later)."""
import gc

import pytest

import flame_core.memory  # noqa: F401  (installs the accounting hook and, on a GPU, the pool)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def storage(nbytes, device):
    """Bytes the accountant charges for a new storage of `nbytes`: exact on cpu, the pool's block size on cuda."""
    from flame_core.memory.pool import round_size
    return nbytes if device.type == "cpu" else round_size(nbytes)[0]
