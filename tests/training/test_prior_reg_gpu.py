"""prior_reg datasets on cuda: the graphed steps (a graph for batches with prior samples, one for batches without;
the adapters switched off and on inside the capture) give the eager steps' losses; under max_gpu_memory (streamed
blocks, eager steps) the resident run's."""
import numpy as np
import pytest

from flame_models.training.trainer import Trainer

from .conftest import draw_images
from .test_prior_reg import _config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """4 images to learn, 2 prior_reg ones: batches of 2 come with and without prior samples."""
    root = tmp_path_factory.mktemp("prior_gpu")
    return (draw_images(root / "train", n_concept=2, n_other=2), draw_images(root / "keep", n_concept=0, n_other=2))


def _run(tmp_path, tiny_model, folders, name, budget=None, **train):
    c = _config(tmp_path, name, folders, steps=24, model=tiny_model, train={"dtype": "bf16", "batch_size": 2, **train})
    c.device, c.max_gpu_memory = "cuda", budget
    tr = Trainer(c, verbose=False)
    out = tr.train()
    assert np.isfinite(out["losses"]).all()
    return tr, np.array(out["losses"])


def test_the_graphed_steps_are_the_eager_ones(tmp_path, tiny_model, folders):
    _, eager = _run(tmp_path, tiny_model, folders, "eager", cuda_graph=False)
    tr, graphed = _run(tmp_path, tiny_model, folders, "graphed")
    assert tr.graphed is not None and tr.graphed.graph is not None, tr.graphed.why   # it captured
    keys = [k for k in tr.graphed.graphs if tr.graphed.graphs[k].graph is not None]
    assert len({k[-1] is None for k in keys}) == 2, keys      # both kinds of batch captured their own graph
    np.testing.assert_allclose(graphed, eager, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu_exclusive   # a max_gpu_memory budget: other processes' memory counts against it
def test_streamed_blocks_train_as_resident_ones(tmp_path, tiny_model, folders):
    _, resident = _run(tmp_path, tiny_model, folders, "resident", cuda_graph=False)
    tr, streamed = _run(tmp_path, tiny_model, folders, "streamed", budget="8GiB")
    assert tr.graphed is None          # (eager: the prior forward's inference schedule)
    np.testing.assert_allclose(streamed, resident, rtol=2e-2)
