"""The Flux Kontext pipeline end to end (flame_models/flux_kontext/pipeline.py: the reference read, encoded by the
VAE and appended at every step) against diffusers' FluxKontextPipeline on the tiny Flux pipeline's parts
(tests/fixtures/make_flux_kontext_pipeline_fixtures.py), from the same packed latents: plain, and with true
classifier-free guidance against a negative prompt (diffusers' true_cfg_scale)."""
import json
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
from flame_core.io import load_file
from flame_models.bfl.sampling import pack
from flame_models.bfl.vae import load_vae_for_flux
from flame_models.flux.pipeline import find_flux_files, load_text_encoders, load_transformer
from flame_models.flux_kontext.pipeline import encode_reference, read_reference, sample_latents

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "flux_pipeline")
REF = {k: v.numpy() for k, v in load_file(os.path.join(HERE, "kontext.safetensors")).items()}
with open(os.path.join(HERE, "kontext.json")) as f:
    META = json.load(f)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    files = find_flux_files(os.path.join(HERE, "pipeline"))
    path = tmp_path_factory.mktemp("kontext") / "reference.png"
    Image.fromarray(REF["reference"]).save(path)
    pixels = read_reference(str(path), auto_resize=False)          # (80 x 48: its own size, a multiple of 16)
    assert pixels.shape == (1, 3, META["height"], META["width"])
    vae = load_vae_for_flux(files, dtype=flame.float32, device="cpu")
    with load_text_encoders(files, dtype=flame.float32, device="cpu") as enc:
        cond = dict(enc.encode([META["prompt"]]), **encode_reference(vae, pixels))
        neg = enc.encode([META["negative"]])
    latents = load_file(os.path.join(HERE, "golden.safetensors"))["latents"].numpy()
    return load_transformer(files, dtype=flame.float32, device="cpu"), cond, neg, latents


def _run(parts, **kw):
    model, cond, neg, latents = parts
    z = sample_latents(model, cond, height=META["height"], width=META["width"], steps=META["steps"],
                       guidance=META["guidance"], latents=latents, neg=neg, **kw)
    return pack(z).numpy()


def test_kontext_is_diffusers(parts):
    got, want = _run(parts), REF["plain"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("scale", META["scales"])
def test_kontext_true_cfg_is_diffusers(parts, scale):
    got, want = _run(parts, true_cfg=scale), REF[f"true_cfg_{scale:g}"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(want - REF["plain"]).max() > 1e-2


def test_latents_or_seeds(parts):
    model, cond, _, latents = parts
    with pytest.raises(ValueError, match="exactly one of seeds"):
        sample_latents(model, cond, height=48, width=80, steps=2, guidance=3.5, seeds=[1], latents=latents)


def test_generate_kontext_true_cfg(tmp_path, capsys):
    import shutil

    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.generate import generate, main
    tiny = tiny_flux_files(tmp_path / "flux", seed=1)
    folder = tmp_path / "kontext"
    shutil.copytree(os.path.dirname(tiny.transformer), folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps(dict(json.loads(index.read_text()), _class_name="FluxKontextPipeline")))
    image = tmp_path / "ref.png"
    Image.fromarray(REF["reference"]).save(image)
    kw = dict(image=str(image), keep_image_size=True, steps=2, seed=3, width=32, height=32, progress=False,
              log=lambda *a: None, device="cpu", dtype="fp32")
    plain = np.asarray(generate(str(folder), "x", **kw)[0], np.int16)
    out = tmp_path / "out"
    guided = np.asarray(generate(str(folder), "x", true_cfg=3.0, negative_prompt="y", output=str(out), **kw)[0],
                        np.int16)
    assert np.abs(guided - plain).max() > 0
    im = Image.open(out / os.listdir(out)[0])
    assert "Negative prompt: y" in im.text["parameters"] and json.loads(im.text["flame"])["true_cfg"] == 3.0
    late = np.asarray(generate(str(folder), "x", true_cfg=3.0, true_cfg_start=2, negative_prompt="y", **kw)[0],
                      np.int16)
    np.testing.assert_array_equal(late, plain)      # (from step 2 of 2: the prompt alone throughout)
    assert main(["--model", str(folder), "--prompt", "x", "--image", str(image), "--negative-prompt", "y",
                 "--output", str(tmp_path / "o"), "--no-progress", "--device", "cpu"]) == 2
    assert "--negative-prompt: Flux reads it under true classifier-free guidance" in capsys.readouterr().err


def test_kontext_true_cfg_from_a_later_step(parts):
    # the steps before true_cfg_start run the prompt alone (with the same reference); 0 is true CFG at every step
    scale = META["scales"][-1]
    everywhere, plain = _run(parts, true_cfg=scale), _run(parts)
    np.testing.assert_array_equal(_run(parts, true_cfg=scale, true_cfg_start=0), everywhere)
    np.testing.assert_array_equal(_run(parts, true_cfg=scale, true_cfg_start=META["steps"]), plain)
    later = _run(parts, true_cfg=scale, true_cfg_start=1)
    assert np.abs(later - everywhere).max() > 1e-4 and np.abs(later - plain).max() > 1e-4
