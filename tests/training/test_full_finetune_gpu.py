"""Full fine-tuning on the GPU, every family: float32 weights under bf16 autocast through the models' cuda paths
(fused projections, norms, attention), the CUDA-graph steps giving the eager steps' numbers, and the file written
loading back as the trained weights rounded to bf16."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .test_full_finetune import full_config

pytestmark = pytest.mark.gpu


def _gpu(cfg, graph):
    cfg.device, cfg.train.cuda_graph = "cuda", graph
    return cfg


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl", "chroma", "qwen_image", "flux_kontext"])
def test_cuda_graph_steps_give_the_eager_numbers(tmp_path, arch):
    runs = {}
    for graph in (False, True):
        tr = Trainer(_gpu(full_config(tmp_path, f"{arch}{graph}", arch=arch, steps=6), graph), verbose=False).setup()
        before = [p.detach().float().numpy().copy() for p in tr.params]
        assert all(p.dtype == flame.float32 and p.device.type == "cuda" for p in tr.params)
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
        assert np.isfinite(losses).all()
        moved = sum(not np.array_equal(a, b) for a, b in zip(before, runs[graph][1]))
        assert moved > 0.9 * len(before), (moved, len(before))
    g = runs[True][2].graphed
    assert g is not None and g.captured == 1, g.failure
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    tr = runs[True][2]
    path = tr.save_lora(str(tmp_path / f"{arch}.safetensors"))
    fam = get_family(arch)
    back = dict(fam.load_model(path, fam.read_spec(path), flame.bfloat16, "cpu").named_parameters())
    for n, p in tr.model.named_parameters():
        np.testing.assert_array_equal(back[n].detach().float().numpy(),
                                      p.detach().to(flame.bfloat16).float().numpy(), err_msg=n)
