"""SDXL with train.train_text_encoder on the GPU: the encoders in bfloat16 beside the UNet, their adapters trained
inside the step's CUDA graph (the token ids are fixed-shape inputs) with the eager numbers, with and without
gradient checkpointing of the CLIP layers; previews encoded by them."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_sd_families import PROMPTS, sdxl_model  # noqa: F401  (the module fixture)

pytestmark = pytest.mark.gpu


def _config(tmp_path, name, model, images, graph, checkpointing, **top):
    cfg = image_config(tmp_path, name, model, images, steps=6,
                       train={"train_text_encoder": True, "text_encoder_lr": 1e-3,
                              "gradient_checkpointing": checkpointing},
                       model={"arch": "sdxl", "t5_max_length": None}, **top)
    cfg.device, cfg.train.dtype, cfg.model.dtype, cfg.train.cuda_graph = "cuda", "bf16", "bf16", graph
    return cfg


@pytest.mark.parametrize("checkpointing", [False, True])
def test_text_encoder_training_is_captured_with_the_eager_numbers(tmp_path, sdxl_model, checkpointing):  # noqa: F811
    images = draw_images(tmp_path / "images", 2, 2)                  # one bucket: one graph
    runs = {}
    for graph in (False, True):
        tr = Trainer(_config(tmp_path, f"g{graph}{checkpointing}", sdxl_model, images, graph, checkpointing),
                     verbose=False).setup()
        assert all(m.dtype == flame.bfloat16 for _, m in tr.text_encoders.parts)
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    tr = runs[True][2]
    assert tr.graphed is not None and tr.graphed.captured == 1, tr.graphed.why
    assert np.isfinite(runs[True][0]).all()
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    ups = [p.detach().float().numpy() for k, p in tr.text_encoders.named_parameters() if k.endswith("lora_B")]
    assert ups and max(np.abs(x).max() for x in ups) > 0              # the ups moved from zero


def test_previews_and_the_file_on_the_gpu(tmp_path, sdxl_model):  # noqa: F811
    images = draw_images(tmp_path / "images", 2, 2)
    cfg = _config(tmp_path, "p", sdxl_model, images, True, True,
                  sample={"sample_every": 3, "sample_steps": 2, "prompts": PROMPTS[:1], "neg": "blurry"})
    result = Trainer(cfg, verbose=False).train()
    assert np.isfinite(result["losses"]).all() and result["samples_decoded"]
