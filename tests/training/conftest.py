"""Shared pieces of the trainer tests: a tiny Flux checkpoint file, folders of precomputed samples, a small config."""
import importlib.util
import os

import numpy as np
import pytest

from flame_models.data import write_sample
from flame_models.flux import Flux, save_flux
from flame_models.training.config import config_from_dict

# flux-tiny: context_in_dim 32, vec_in_dim 16


@pytest.fixture(scope="session")
def flux_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "flux-tiny.safetensors"
    save_flux(Flux("flux-tiny"), str(path))
    return str(path)


def make_samples(folder, n=4, h=4, w=4, txt=(8, 32), pooled=16, seed=0):
    """n sample files of latents (16, h, w) (h, w in latent pixels) and conditioning of the given shapes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        write_sample(str(folder / f"{i:04d}.safetensors"),
                     latents=rng.standard_normal((16, h, w)).astype(np.float32),
                     prompt_embeds=rng.standard_normal(txt).astype(np.float32),
                     pooled_prompt_embeds=rng.standard_normal(pooled).astype(np.float32))
    return str(folder)


def _drop(d, drop):
    """d without the dotted keys `drop` ("network.linear": a default of these helpers the test leaves out)."""
    for key in drop:
        *path, last = key.split(".")
        sec = d
        for k in path:
            sec = sec[k]
        sec.pop(last, None)
    return d


def tiny_config(tmp_path, name, steps=6, train=None, drop=(), **top):
    """A flux-tiny run on 8 synthetic 32x32 samples, LoRA r4 on every block Linear, fp32 on the cpu. drop: dotted
    keys of these settings to leave out."""
    t = {"steps": steps, "batch_size": 2, "optimizer": "adamw", "lr": 3e-3, "lr_warmup_steps": 2, "dtype": "fp32",
         "gradient_checkpointing": False, "seed": 0}
    t.update(train or {})
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu",
         "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "target": "all_linear"},
         "synthetic": {"num_samples": 8, "height": 32, "width": 32, "text_length": 8, "seed": 0},
         "train": t, "model": {"size": "flux-tiny", "dtype": "fp32"},
         "sample": {"sample_every": 0}, "save": {"save_every": 3, "format": "kohya", "dtype": "fp32"}}
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    return config_from_dict(_drop(d, drop))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Flux model folder (diffusers layout): random transformer, CLIP and T5, learned tokenizers, and the
    analytic pooling VAE (no pretraining: the tests need the stages, not pictures)."""
    from flame_models.flux.demo import tiny_model_folder
    folder = tmp_path_factory.mktemp("tiny_model") / "model"
    tiny_model_folder(str(folder), base_steps=0)
    return str(folder)


def draw_images(folder, n_concept=3, n_other=3, size=64, wide=0):
    """The demo's drawings at `size` px, plus `wide` 3:1 images (192x64, captioned) for a second bucket."""
    from PIL import Image

    from flame_models.flux.demo import draw_dataset
    draw_dataset(str(folder), n_concept=n_concept, n_other=n_other, size=size)
    for i in range(wide):
        Image.new("RGB", (3 * size, size), (30 + 40 * i, 90, 200)).save(str(folder / f"wide_{i}.png"))
        (folder / f"wide_{i}.txt").write_text("a wide blue band on a grey background")
    return str(folder)


def image_config(tmp_path, name, model_path, images, steps=4, train=None, drop=(), **top):
    """A run on an image folder with the tiny model: 64 px buckets, LoRA r4, T5 at 8 tokens, fp32 on the cpu. drop:
    dotted keys of these settings to leave out."""
    t = {"steps": steps, "batch_size": 2, "optimizer": "adamw", "lr": 3e-3, "dtype": "fp32",
         "gradient_checkpointing": False, "seed": 0}
    t.update(train or {})
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu", "trigger_word": "ohwx",
         "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "target": "all_linear"},
         "datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32}],
         "train": t, "model": {"name_or_path": model_path, "dtype": "fp32", "t5_max_length": 8},
         "sample": {"sample_every": 0}, "save": {"save_every": 2, "format": "kohya", "dtype": "fp32"}}
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    return config_from_dict(_drop(d, drop))


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def fixture_script(name):
    """The module tests/fixtures/<name>.py (a fixture-making script), imported by path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(FIXTURES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
