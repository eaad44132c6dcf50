"""The validation loss on the GPU: evaluated eagerly between replays of the step's CUDA graph (the graph keeps
replaying with the numbers of a run that never validates), and under max_gpu_memory with streamed blocks (within
the budget, the same value as the resident model's)."""
import numpy as np
import pytest

from flame_core import memory
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

pytestmark = pytest.mark.gpu


def _gpu(cfg, graph=True):
    cfg.device, cfg.train.dtype, cfg.model.dtype, cfg.train.cuda_graph = "cuda", "bf16", "bf16", graph
    return cfg


def test_validating_between_graph_replays_keeps_the_graphs_numbers(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images")                         # one bucket: one graph
    held = draw_images(tmp_path / "held", n_concept=1, n_other=1)
    disk = {"datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32,
                          "cache_latents_to_disk": True}]}              # the second run reads the first's embeddings
    runs = {}
    for every in (1, None):
        val = {} if every is None else {"validation": {"folder_path": held, "every": every}}
        tr = Trainer(_gpu(image_config(tmp_path, f"v{every}", tiny_model, images, steps=8, **val, **disk)),
                     verbose=False)
        runs[every] = (tr.train(), tr)
    result, tr = runs[1]
    assert tr.graphed is not None and tr.graphed.captured == 1, tr.graphed.why
    assert len(result["validation_losses"]) == 9 and all(np.isfinite(v) for _, v in result["validation_losses"])
    assert tr.validate()["loss"] == result["validation_losses"][-1][1]
    np.testing.assert_allclose(result["losses"], runs[None][0]["losses"], rtol=1e-5)
    eager = Trainer(_gpu(image_config(tmp_path, "eager", tiny_model, images, steps=8,
                                      validation={"folder_path": held, "every": 4}, **disk), graph=False),
                    verbose=False).train()
    np.testing.assert_allclose([v for _, v in eager["validation_losses"]],
                               [v for s, v in result["validation_losses"] if s in (0, 4, 8)], rtol=2e-2)


@pytest.mark.gpu_exclusive
def test_streamed_blocks_validate_within_the_budget(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images")
    val = {"validation": {"split": 0.25, "every": 2}}
    resident = Trainer(_gpu(image_config(tmp_path, "res", tiny_model, images, steps=2, **val)), verbose=False)
    want = resident.train()["validation_losses"]
    streamed = Trainer(_gpu(image_config(tmp_path, "str", tiny_model, images, steps=2, max_gpu_memory="8GiB",
                                         **val)), verbose=False)
    result = streamed.train()
    assert streamed.streamer is not None
    np.testing.assert_allclose([v for _, v in result["validation_losses"]], [v for _, v in want], rtol=2e-2)
    stages = {s["stage"]: s for s in result["stages"]}
    assert stages["validation"]["device_peak"] <= 8 * 2 ** 30
    assert memory.max_memory_allocated(streamed.device) > 0
