"""Fixtures of the distributed tests. Everything here but the `gpu` tests checks logic on the cpu ("store"
backend), also when the suite runs with FLAME_DEVICE=cuda: the default device is cpu inside those tests, and the
processes they start get FLAME_DEVICE=cpu (`CPU_ENV`)."""
import os

import pytest

import flame_core as flame

CPU_ENV = {"FLAME_DEVICE": "cpu", "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _cpu_default(request):
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    prev = flame.default_device()
    flame.set_default_device("cpu")
    try:
        yield
    finally:
        flame.set_default_device(prev)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Flux model folder of tests/training (random transformer, CLIP, T5, the analytic pooling VAE)."""
    from flame_models.flux.demo import tiny_model_folder
    folder = tmp_path_factory.mktemp("tiny_model") / "model"
    tiny_model_folder(str(folder), base_steps=0)
    return str(folder)


def cpu_env(root):
    return {**os.environ, "PYTHONPATH": root, **CPU_ENV}
