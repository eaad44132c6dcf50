"""Fixtures of the distributed tests."""
import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Flux model folder of tests/training (random transformer, CLIP, T5, the analytic pooling VAE)."""
    from flame_models.training.demo import tiny_model_folder
    folder = tmp_path_factory.mktemp("tiny_model") / "model"
    tiny_model_folder(str(folder), base_steps=0)
    return str(folder)
