"""Image folders on the GPU: one CUDA graph per batch shape (bucket) with the eager numbers, eager steps when there
are more shapes than graphs, the VAE in host memory between preview decodes, every stage's driver-observed peak
logged -- and a Flux-dev-size run with random weights (no files) held to 12 GiB in every stage."""
import numpy as np
import pytest

from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

pytestmark = pytest.mark.gpu


def _gpu(cfg, graph=True):
    cfg.device, cfg.train.dtype, cfg.model.dtype, cfg.train.cuda_graph = "cuda", "bf16", "bf16", graph
    return cfg


def test_one_cuda_graph_per_bucket_shape_gives_the_eager_numbers(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images", wide=2)                 # buckets 64x64 (6 images) and 96x32 (2)
    runs = {}
    for graph in (False, True):
        tr = Trainer(_gpu(image_config(tmp_path, f"g{graph}", tiny_model, images, steps=12), graph),
                     verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(12)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    tr = runs[True][2]
    assert tr.graphed is not None and tr.graphed.captured == 2, tr.graphed.why  # one graph per shape, both captured
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu_exclusive
def test_more_shapes_than_graphs_train_eagerly_and_say_why(tmp_path, tiny_model, capsys):
    images = draw_images(tmp_path / "images", wide=2)
    cfg = _gpu(image_config(tmp_path, "budget", tiny_model, images, steps=2, max_gpu_memory="8GiB"))
    tr = Trainer(cfg).setup()
    assert tr.graphed is None
    assert "2 batch shapes (aspect buckets) exceed 1 CUDA graph under max_gpu_memory" in capsys.readouterr().out


def test_previews_decode_on_the_gpu_with_the_vae_waiting_in_host_memory(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images")
    cfg = _gpu(image_config(tmp_path, "prev", tiny_model, images, steps=4,
                            sample={"sample_every": 2, "sample_steps": 2, "prompts": ["[trigger]"]}))
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert result["samples_decoded"] and tr.graphed.captured == 1, tr.graphed.why
    assert tr.prepared.decode.on_gpu and tr.prepared.decode.vae.device.type == "cpu"   # on the host between decodes
    stages = {s["stage"]: s for s in result["stages"]}
    for name in ("check", "latents", "text", "build", "train", "samples"):
        assert stages[name]["device_peak"] >= stages[name]["peak_reserved"] > 0 or name == "check"


@pytest.mark.gpu_exclusive
@pytest.mark.slow
def test_a_random_flux_dev_size_run_holds_12gib_in_every_stage(tmp_path):
    # model.size flux-dev without files: the transformer, VAE, CLIP-L and T5-XXL at their real sizes with random
    # weights drawn on the GPU, the packaged tokenizers; the transformer's blocks stream
    images = draw_images(tmp_path / "images", 2, 2, size=512)
    cfg = image_config(tmp_path, "dev", None, images, steps=2, max_gpu_memory="12GiB",
                       model={"name_or_path": None, "size": "flux-dev", "t5_max_length": 512},
                       datasets=[{"folder_path": images, "resolution": 512}],
                       network={"target": "attention"},
                       sample={"sample_every": 2, "sample_steps": 2, "prompts": ["a photo of [trigger]"]},
                       train={"gradient_checkpointing": True, "batch_size": 1})
    result = Trainer(_gpu(cfg), verbose=False).train()
    for s in result["stages"]:
        assert s["device_peak"] <= 12 * 2 ** 30, s
    assert result["samples_decoded"] and len(result["losses"]) == 2
