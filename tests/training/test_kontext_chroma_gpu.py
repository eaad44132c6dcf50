"""Flux Kontext and Chroma trainer families on the GPU, as test_sd_families_gpu.py holds SD3 / SDXL: CUDA-graph
steps give the eager numbers (Kontext's reference tokens appended inside the captured step, Chroma's T5 mask and
approximator), and blocks streamed under max_gpu_memory give the resident numbers. Tiny random presets (no files);
Kontext trains on edit pairs, Chroma on an image folder."""
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
import flame_core.memory as M
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

pytestmark = pytest.mark.gpu


def _gpu(cfg, graph=True):
    cfg.device, cfg.train.dtype, cfg.model.dtype, cfg.train.cuda_graph = "cuda", "bf16", "bf16", graph
    return cfg


def _data(tmp_path, arch):
    """datasets: 4 drawings in one 64 px bucket (one graph), cached to disk; Kontext's with same-name controls."""
    images = draw_images(tmp_path / "images", 2, 2)
    d = {"folder_path": images, "resolution": 64, "bucket_tolerance": 32, "cache_latents_to_disk": True}
    if arch == "flux_kontext":
        ctl = tmp_path / "ctl"
        ctl.mkdir(exist_ok=True)
        for f in os.listdir(images):
            if f.endswith(".png"):
                im = np.asarray(Image.open(os.path.join(images, f)).convert("RGB"))
                Image.fromarray(255 - im).save(ctl / f)
        d["control_path"] = str(ctl)
    return images, [d]


@pytest.fixture(autouse=True)
def _same_model(monkeypatch):
    """Both runs of a test train the same model: the tiny preset's weights (and then the adapters') come from the
    global generator, which the first run's random text encoders draw from and the second run's (its captions read
    from the first run's cache) do not, so it is seeded as each run builds its transformer."""
    from flame_models.training.family import get_family
    for arch in ("flux_kontext", "chroma"):
        fam = get_family(arch)
        build = fam.build_model

        def seeded(*a, _build=build, **kw):
            flame.manual_seed(0)
            return _build(*a, **kw)
        monkeypatch.setattr(fam, "build_model", seeded)


def _config(arch, tmp_path, name, images, data, **top):
    top["model"] = {"arch": arch, "size": None, "name_or_path": None, "t5_max_length": 8, **top.get("model", {})}
    return image_config(tmp_path, name, None, images, datasets=data, **top)


@pytest.mark.parametrize("arch", ["flux_kontext", "chroma"])
def test_cuda_graph_steps_give_the_eager_numbers(tmp_path, arch):
    images, data = _data(tmp_path, arch)
    runs = {}
    for graph in (False, True):
        tr = Trainer(_gpu(_config(arch, tmp_path, f"g{graph}", images, data, steps=8), graph), verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(8)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    assert runs[True][2].graphed is not None and runs[True][2].graphed.captured == 1, runs[True][2].graphed.why
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("arch", ["flux_kontext", "chroma"])
def test_streamed_blocks_give_the_resident_numbers(tmp_path, arch):
    images, data = _data(tmp_path, arch)
    runs = {}
    for stream in (False, True):
        cfg = _gpu(_config(arch, tmp_path, f"s{stream}", images, data, steps=4,
                           train={"gradient_checkpointing": True}), graph=False)
        if stream:
            cfg.max_gpu_memory = "8GiB"
        tr = Trainer(cfg, verbose=False).setup()
        if stream:
            assert tr.prepared.encoded == {"latents": 0, "text": 0}   # the first run's caches, read back
            M.set_memory_limit(None, "cuda")
            tr.streamer.set_resident([0])                             # the others stream through the slots
            assert len(tr.streamer.streamed) == len(tr.streamer.names) - 1
        runs[stream] = ([tr.train_step()[0] for _ in range(4)], [p.detach().float().numpy() for p in tr.params])
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
