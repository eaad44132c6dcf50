"""Test configuration: device selection, the `gpu` marker, hypothesis profiles, and the collected objects kept out of
the cyclic GC's scans."""
import gc
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import flame_core as flame
from flame_core import backend

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE = flame.default_device()
# configs that name Hugging Face repo ids read them from the local Hugging Face cache (checkpoint_io/hub_cache.py): the
# tests see an empty one, never the machine's (a test that needs one sets HF_HUB_CACHE itself)
os.environ["HF_HUB_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"flame-tests-empty-hub-{os.getpid()}")


def pytest_collection_modifyitems(config, items):
    if backend.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Every object alive once the tests are collected (the imported modules, test items, hypothesis strategies:
    ~235k on the cpu suite, no tensor among them) is moved to the permanent generation, so that each full
    collection -- the library's own gc.collect() when it frees encoders or a budget's buffers (hundreds of calls in
    a run), the tests' and the interpreter's -- scans only the objects born since, not those again. Nothing changes
    for the objects the tests make: they are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def device():
    """The device under test: cpu in CI, cuda with FLAME_DEVICE=cuda on a GPU."""
    return DEVICE


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _no_memory_limit_left_behind():
    """auto_fit leaves its budget set as the pool's limit (its contract); a test that fits must not hand that limit
    to the next test of its worker (a later test on the same device then fails to allocate under it)."""
    yield
    from flame_core import memory
    for dev in ("cpu", "cuda") if DEVICE.type == "cuda" else ("cpu",):
        if memory.get_memory_limit(dev) is not None:
            memory.set_memory_limit(None, dev)


@pytest.fixture(autouse=True)
def _release_torch_cache():
    """Tests that run a reference through torch on the GPU leave its caching allocator full; release it after each
    test, so that later memory-budget tests see the device as FLAME alone uses it."""
    yield
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
