import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_after():
    """The streaming tests' pinned buffers and slots go back before the next test (the root conftest clears any pool
    limit an auto_fit left behind)."""
    yield
    gc.collect()
