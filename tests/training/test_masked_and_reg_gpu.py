"""Masked loss and regularisation images on the GPU: the masks and per-sample weights are inputs of the step's CUDA
graph, so training and regularisation micro-batches (one shape) replay one graph with their own weights and give
the eager step's numbers."""
import numpy as np
import pytest

from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_masked_and_reg_training import _half_masks

pytestmark = pytest.mark.gpu


def test_masked_and_regularisation_batches_replay_one_graph_with_the_eager_numbers(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images")
    masks = _half_masks(images, tmp_path / "masks")
    reg = draw_images(tmp_path / "reg", n_concept=0, n_other=4)
    ds = [{"folder_path": images, "mask_path": masks, "mask_min_value": 0.2, "resolution": 64,
           "bucket_tolerance": 32},
          {"folder_path": reg, "is_reg": True, "resolution": 64, "bucket_tolerance": 32}]
    runs = {}
    for graph in (False, True):
        cfg = image_config(tmp_path, f"g{graph}", tiny_model, images, steps=10, datasets=ds,
                           train={"reg_weight": 0.3, "reg_ratio": 0.4})
        cfg.device, cfg.train.dtype, cfg.model.dtype, cfg.train.cuda_graph = "cuda", "bf16", "bf16", graph
        tr = Trainer(cfg, verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(10)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    # one shape: train and reg batches share it
    assert runs[True][2].graphed.captured == 1, runs[True][2].graphed.why
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
