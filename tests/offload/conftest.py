import gc

import pytest

import flame_core.memory as M


@pytest.fixture(autouse=True)
def _no_memory_limit_left_behind(device):
    """auto_fit leaves its budget set as the pool's limit: never let it leak into other tests."""
    yield
    M.set_memory_limit(None, device)
    gc.collect()
