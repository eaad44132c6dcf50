"""Flux's true classifier-free guidance (flame_models/bfl/true_cfg.py; flux.pipeline.sample_latents(neg=,
true_cfg=); generate --true-cfg / --negative-prompt) against diffusers' FluxPipeline with true_cfg_scale and a
negative prompt (tests/fixtures/make_flux_true_cfg_fixtures.py) on the tiny pipeline; the command line."""
import json
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
from flame_core.io import load_file
from flame_models.flux.pipeline import find_flux_files, load_text_encoders, load_transformer, pack, sample_latents

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "flux_pipeline")
REF = {k: v.numpy() for k, v in load_file(os.path.join(HERE, "true_cfg.safetensors")).items()}
with open(os.path.join(HERE, "true_cfg.json")) as f:
    META = json.load(f)


@pytest.fixture(scope="module")
def parts():
    files = find_flux_files(os.path.join(HERE, "pipeline"))
    with load_text_encoders(files, dtype=flame.float32, device="cpu") as enc:
        cond, neg = enc.encode([META["prompt"]]), enc.encode([META["negative"]])
    latents = load_file(os.path.join(HERE, "golden.safetensors"))["latents"].numpy()
    return load_transformer(files, dtype=flame.float32, device="cpu"), cond, neg, latents


@pytest.mark.parametrize("scale", META["scales"])
def test_true_cfg_is_diffusers(parts, scale):
    model, cond, neg, latents = parts
    z = sample_latents(model, cond, height=META["height"], width=META["width"], steps=META["steps"],
                       guidance=META["guidance"], latents=latents, neg=neg, true_cfg=scale)
    want = REF[f"latents_{scale:g}"]
    assert np.abs(pack(z).numpy() - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(want - REF["plain"]).max() > 1e-2                     # (the guidance moves the latents)


def test_scale_one_is_plain(parts):
    model, cond, neg, latents = parts
    z = sample_latents(model, cond, height=META["height"], width=META["width"], steps=META["steps"],
                       guidance=META["guidance"], latents=latents, neg=neg, true_cfg=1.0)
    assert np.abs(pack(z).numpy() - REF["plain"]).max() <= 1e-5 * np.abs(REF["plain"]).max()


def test_generate_true_cfg(tmp_path, capsys):
    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.generate import generate, main
    tiny = tiny_flux_files(tmp_path / "flux", seed=1)
    kw = dict(steps=3, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu", dtype="fp32")
    plain = np.asarray(generate(tiny, "a red square", **kw)[0], np.int16)
    same = np.asarray(generate(tiny, "a red square", true_cfg=1.0, **kw)[0], np.int16)
    np.testing.assert_array_equal(plain, same)
    out = tmp_path / "out"
    guided = np.asarray(generate(tiny, "a red square", true_cfg=3.0, negative_prompt="a blue circle",
                                 output=str(out), **kw)[0], np.int16)
    assert np.abs(guided - plain).max() > 0
    im = Image.open(out / os.listdir(out)[0])
    assert "Negative prompt: a blue circle" in im.text["parameters"] and "CFG scale: 3," in im.text["parameters"]
    info = json.loads(im.text["flame"])
    assert info["true_cfg"] == 3.0 and info["negative_prompt"] == "a blue circle"
    base = ["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--steps", "2", "--output",
            str(tmp_path / "o"), "--no-progress", "--device", "cpu"]
    for extra, needle in ((["--negative-prompt", "y"], "--negative-prompt: Flux reads it under true"),
                          (["--true-cfg", "0.5"], "--true-cfg 0.5: a finite number >= 1"),
                          (["--cfg", "3"], "true classifier-free guidance: --true-cfg")):
        assert main(base + extra) == 2, extra
        assert needle in capsys.readouterr().err, needle


def _by_hand(model, cond, neg, latents, scale, start, steps):
    """The plain model over the first `start` Euler steps, then true CFG over the rest: two denoise calls."""
    from flame_models.bfl.sampling import denoise, get_schedule, image_ids, text_ids, unpack
    from flame_models.bfl.true_cfg import with_true_cfg
    from flame_models.conditioning import prompt_rows
    dtype = model.img_in.weight.dtype
    x = flame.tensor(latents, device="cpu").to(flame.float32)   # (the model is on the cpu, whatever FLAME_DEVICE)
    txt, y = prompt_rows(cond, [0], "cpu", dtype)
    img_pos = image_ids(META["height"], META["width"], 1, device="cpu")
    txt_pos = text_ids(txt.shape[1], 1, device="cpu")
    ts = get_schedule(steps, x.shape[1], shift=True)
    x = denoise(model, x, img_pos, txt, txt_pos, y, ts[:start + 1], META["guidance"], cuda_graph=False)
    net = with_true_cfg(model, neg, [0], txt, scale, "cpu", dtype)
    x = denoise(net, x, img_pos, txt, txt_pos, y, ts[start:], META["guidance"], cuda_graph=False)
    return unpack(x, META["height"], META["width"]).numpy()


@pytest.mark.parametrize("start", [1, 3])
def test_true_cfg_from_a_later_step_runs_the_prompt_alone_before_it(parts, start):
    # SimpleTuner's validation_no_cfg_until_timestep: the steps before true_cfg_start run the prompt alone
    model, cond, neg, latents = parts
    kw = dict(height=META["height"], width=META["width"], steps=4, guidance=META["guidance"], latents=latents,
              neg=neg)
    z = sample_latents(model, cond, true_cfg=4.0, true_cfg_start=start, **kw).numpy()
    np.testing.assert_allclose(z, _by_hand(model, cond, neg, latents, 4.0, start, 4), rtol=0, atol=1e-6)
    everywhere = sample_latents(model, cond, true_cfg=4.0, **kw).numpy()
    plain = sample_latents(model, cond, **kw).numpy()
    assert np.abs(z - everywhere).max() > 1e-3 and np.abs(z - plain).max() > 1e-3
    np.testing.assert_array_equal(sample_latents(model, cond, true_cfg=4.0, true_cfg_start=0, **kw).numpy(),
                                  everywhere)
    np.testing.assert_array_equal(sample_latents(model, cond, true_cfg=4.0, true_cfg_start=4, **kw).numpy(), plain)


def test_a_multistep_sampler_keeps_its_history_across_the_switch(parts):
    model, cond, neg, latents = parts
    kw = dict(height=META["height"], width=META["width"], steps=4, guidance=META["guidance"], latents=latents,
              neg=neg, sampler="dpmpp_2m")
    plain = sample_latents(model, cond, **kw).numpy()
    everywhere = sample_latents(model, cond, true_cfg=3.0, **kw).numpy()
    later = sample_latents(model, cond, true_cfg=3.0, true_cfg_start=2, **kw).numpy()
    np.testing.assert_array_equal(sample_latents(model, cond, true_cfg=3.0, true_cfg_start=9, **kw).numpy(), plain)
    assert np.abs(later - plain).max() > 1e-3 and np.abs(later - everywhere).max() > 1e-3
    with pytest.raises(ValueError, match="cfg_start is the first step"):
        sample_latents(model, cond, true_cfg=3.0, true_cfg_start=-1, **kw)


def test_generate_true_cfg_start(tmp_path, capsys):
    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.generate import GenerateError, generate, main
    tiny = tiny_flux_files(tmp_path / "flux", seed=1)
    kw = dict(steps=3, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu", dtype="fp32",
              negative_prompt="a blue circle")
    every = np.asarray(generate(tiny, "a red square", true_cfg=3.0, **kw)[0], np.int16)
    same = np.asarray(generate(tiny, "a red square", true_cfg=3.0, true_cfg_start=0, **kw)[0], np.int16)
    np.testing.assert_array_equal(every, same)
    later = np.asarray(generate(tiny, "a red square", true_cfg=3.0, true_cfg_start=2, output=str(tmp_path / "o"),
                                **kw)[0], np.int16)
    assert np.abs(later - every).max() > 0
    meta = json.loads(Image.open(tmp_path / "o" / os.listdir(tmp_path / "o")[0]).text["flame"])
    assert (meta["true_cfg"], meta["true_cfg_start"]) == (3.0, 2)
    with pytest.raises(GenerateError, match="--true-cfg-start: the first step of true classifier-free guidance"):
        generate(tiny, "a red square", true_cfg_start=1, **{k: v for k, v in kw.items() if k != "negative_prompt"})
    with pytest.raises(GenerateError, match="--true-cfg-start -1: the first step of true CFG, an integer >= 0"):
        generate(tiny, "a red square", true_cfg=3.0, true_cfg_start=-1, **kw)
    base = ["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--steps", "2", "--width", "32",
            "--height", "32", "--no-progress", "--device", "cpu", "--seed", "1"]
    assert main(base + ["--output", str(tmp_path / "cli"), "--true-cfg", "2", "--true-cfg-start", "1"]) == 0
    meta = json.loads(Image.open(tmp_path / "cli" / os.listdir(tmp_path / "cli")[0]).text["flame"])
    assert (meta["true_cfg"], meta["true_cfg_start"]) == (2.0, 1)
    assert main(base + ["--output", str(tmp_path / "x"), "--true-cfg-start", "1"]) == 2
    assert "--true-cfg-start: the first step of true classifier-free guidance" in capsys.readouterr().err
