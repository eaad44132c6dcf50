"""Output preservation on cuda: the graphed step (the adapters switched off and on inside the capture) gives the
eager step's losses; under max_gpu_memory (streamed blocks, eager steps) the resident run's; blank prompt
preservation too."""
import numpy as np
import pytest

from flame_models.training.trainer import Trainer

from .conftest import image_config
from .test_preservation import BLANK, DOP, images  # noqa: F401  (the module's image folder fixture)

pytestmark = pytest.mark.gpu


def _run(tmp_path, tiny_model, images, name, budget=None, kind=None, **train):   # noqa: F811
    kind = kind or {**DOP, "diff_output_preservation_multiplier": 2.0}
    c = image_config(tmp_path, name, tiny_model, images, steps=6, train={**kind, "dtype": "bf16", **train})
    c.device, c.max_gpu_memory = "cuda", budget
    tr = Trainer(c, verbose=False)
    out = tr.train()
    assert np.isfinite(out["losses"]).all()
    return tr, np.array(out["losses"])


@pytest.mark.parametrize("kind", ["class", "blank"])
def test_the_graphed_step_is_the_eager_one(tmp_path, tiny_model, images, kind):   # noqa: F811
    k = None if kind == "class" else BLANK
    _, eager = _run(tmp_path, tiny_model, images, f"eager{kind}", kind=k, cuda_graph=False)
    tr, graphed = _run(tmp_path, tiny_model, images, f"graphed{kind}", kind=k)
    assert tr.graphed is not None and tr.graphed.graph is not None, tr.graphed.why   # it captured
    np.testing.assert_allclose(graphed, eager, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu_exclusive   # a max_gpu_memory budget: other processes' memory counts against it
def test_streamed_blocks_train_as_resident_ones(tmp_path, tiny_model, images):   # noqa: F811
    _, resident = _run(tmp_path, tiny_model, images, "resident", cuda_graph=False)
    tr, streamed = _run(tmp_path, tiny_model, images, "streamed", budget="8GiB")
    assert tr.graphed is None          # (eager: the prior forward's inference schedule)
    np.testing.assert_allclose(streamed, resident, rtol=2e-2)
