"""python -m flame_models.generate with SD3 and SDXL models: PNGs with their parameters, seeds, negative prompts, SDXL's
samplers and size conditioning, SD3's skip-layer guidance and T5-less runs, fp8 and memory-budget runs, and bad
input refused before any work (exit 2, the file or option named)."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from flame_models.generate import generate, main
from flame_models.sdxl import save_sdxl, save_unet

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SD3 = os.path.join(FIXTURES, "sd3_pipeline", "pipeline")
SDXL_FIXTURE = os.path.join(FIXTURES, "sdxl_pipeline")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """The SDXL fixture as a diffusers folder (its configs in config.json files) and as FLAME's SAI file."""
    from sdxl_tiny import sdxl_tiny_parts
    parts = sdxl_tiny_parts()
    d = tmp_path_factory.mktemp("sdxl")
    save_sdxl(parts, str(d / "sdxl-tiny"), layout="diffusers")
    save_sdxl(parts, str(d / "sdxl-tiny.safetensors"), layout="sai")
    save_unet(parts.unet, str(d / "unet.safetensors"), layout="sai")
    return {"folder": str(d / "sdxl-tiny"), "sai": str(d / "sdxl-tiny.safetensors"),
            "unet": str(d / "unet.safetensors")}


def pixels(images):
    return np.stack([np.asarray(im).astype(np.int16) for im in images])


def run(model, prompts="a photo of a cat", **kw):
    # on the cpu, in float32, whatever FLAME_DEVICE says (tests/models/test_sd_pipelines_gpu.py runs on cuda)
    kw = dict(dict(width=64, height=32, steps=2, seed=7, progress=False, log=lambda *a: None, device="cpu"), **kw)
    return pixels(generate(model, prompts, **kw))


def _fails(capsys, argv, *needles):
    rc = main(argv + ["--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert line, err
    for n in needles:
        assert n in err, (n, err)
    return err


# ----------------------------------------------------------------------------- SD3
def test_sd3_command_writes_pngs_with_their_parameters(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--model", SD3, "--prompt", "a photo of a cat", "--prompt", "a house by a lake", "--negative-prompt",
               "blurry", "--num-images", "2", "--batch-size", "3", "--width", "64", "--height", "48", "--steps", "5",
               "--cfg", "4", "--seed", "11", "--slg-layers", "0", "--slg-scale", "2", "--output", str(out),
               "--no-progress", "--device", "cpu"])
    assert rc == 0
    names = sorted(os.listdir(out))
    assert names == [f"{i:05d}-{s}.png" for i, s in enumerate([11, 12] * 2)]
    im = Image.open(out / names[3])
    assert im.size == (64, 48) and im.mode == "RGB"
    params = im.text["parameters"]
    assert params.startswith("a house by a lake\nNegative prompt: blurry\nSteps: 5, Sampler: Euler, ")
    for field in ("CFG scale: 4", "Seed: 12", "Size: 64x48", "Model: pipeline", "Shift: 3", "SLG: layers 0 scale 2"):
        assert field in params
    info = json.loads(im.text["flame"])
    assert info["family"] == "sd3" and info["negative_prompt"] == "blurry" and info["variant"] == "sd3.5-medium"
    assert info["skip_layer_guidance"] == {"layers": [0], "scale": 2.0} and info["t5"].endswith("text_encoder_3")
    # the seed in the file regenerates the image, whatever the batch
    again = run(SD3, "a house by a lake", negative_prompt="blurry", width=64, height=48, steps=5, cfg=4.0, seed=12,
                slg_layers="0", slg_scale=2.0)
    assert np.abs(again[0] - np.asarray(im).astype(np.int16)).max() <= 1     # (batched matmuls round apart)


def test_sd3_options_change_the_image(tmp_path):
    base = run(SD3, cfg=3.0)
    assert np.abs(run(SD3, cfg=3.0, negative_prompt="a dog") - base).mean() > 0.5
    assert np.abs(run(SD3, cfg=3.0, no_t5=True) - base).mean() > 0.5
    # skip-layer guidance acts on steps i with 0.01 N < i < 0.3 N: none of 3, step 1 of 5
    np.testing.assert_array_equal(run(SD3, cfg=3.0, slg_layers=[0], slg_scale=3.0, steps=3),
                                  run(SD3, cfg=3.0, steps=3))
    assert np.abs(run(SD3, cfg=3.0, slg_layers=[0], slg_scale=3.0, steps=5)
                  - run(SD3, cfg=3.0, steps=5)).mean() > 0.5
    assert run(SD3, cfg=1.0).shape == (1, 32, 64, 3)          # Turbo-style: no negative pass


def test_sd3_fp8_and_budget():
    plain = run(SD3, cfg=3.0)
    fp8 = run(SD3, cfg=3.0, fp8=True)
    assert 0 < np.abs(fp8 - plain).mean() < 12                  # rounded weights: close, not equal
    stats = {}
    budget = run(SD3, cfg=3.0, fp8=True, max_gpu_memory="64MiB", stats=stats)
    np.testing.assert_array_equal(budget, fp8)                  # streaming moves bytes, not numbers
    assert set(stats) == {"text encoders", "transformer", "vae"}


# ----------------------------------------------------------------------------- SDXL
def test_sdxl_command_with_sampler_and_size_conditioning(sdxl, tmp_path):
    out = tmp_path / "out"
    rc = main(["--model", sdxl["folder"], "--prompt", "a photo of a cat", "--width", "96", "--height", "64",
               "--steps", "3", "--cfg", "6", "--sampler", "dpmpp_2m", "--karras", "--seed", "3", "--original-size",
               "128x96", "--crop", "8,16", "--output", str(out), "--no-progress", "--device", "cpu"])
    assert rc == 0
    im = Image.open(out / "00000-3.png")
    assert im.size == (96, 64)
    params = im.text["parameters"]
    assert params.startswith("a photo of a cat\nSteps: 3, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6")
    assert "Negative prompt" not in params and "Model: sdxl-tiny" in params
    info = json.loads(im.text["flame"])
    assert info["family"] == "sdxl" and info["original_size"] == [96, 128] and info["crop_coords"] == [8, 16]
    assert info["target_size"] == [64, 96] and info["sampler"] == "dpmpp_2m" and info["scheduler"] == "karras"
    kw = dict(width=96, height=64, steps=3, cfg=6.0, sampler="dpmpp_2m", karras=True, seed=3)
    again = run(sdxl["folder"], original_size="128x96", crop="8,16", **kw)
    np.testing.assert_array_equal(again[0], np.asarray(im).astype(np.int16))
    assert np.abs(run(sdxl["folder"], **kw) - again).mean() > 0.5       # the size conditioning matters


def test_sdxl_samplers_negatives_and_long_captions(sdxl):
    kw = dict(width=64, height=64, cfg=5.0)
    base = run(sdxl["folder"], **kw)
    assert np.abs(run(sdxl["folder"], sampler="euler_ancestral", **kw) - base).mean() > 0.5
    # DPM++ 2M runs on DPMSolverMultistepScheduler's table, not Euler's (its update rule against diffusers':
    # tests/models/test_sdxl_sampling.py)
    assert np.abs(run(sdxl["folder"], sampler="dpmpp_2m", **kw) - base).mean() > 0.5
    assert np.abs(run(sdxl["folder"], sampler="dpmpp_2m", steps=4, **kw) - run(sdxl["folder"], steps=4, **kw)).mean() \
        > 0.5
    assert np.abs(run(sdxl["folder"], negative_prompt="a dog", **kw) - base).mean() > 0.5
    long = " ".join(["a very long prompt that keeps going"] * 20)
    assert np.abs(run(sdxl["folder"], long, max_token_length=150, **kw) - run(sdxl["folder"], long, **kw)).mean() \
        > 0.5
    # FLAME's SAI file of the same model (configs in its metadata) gives the same pictures
    np.testing.assert_array_equal(run(sdxl["sai"], tokenizer=SDXL_FIXTURE, **kw), base)
    # ancestral sampling: a seed gives the same picture whatever the batch
    one = run(sdxl["folder"], ["a cat", "a dog"], sampler="euler_ancestral", batch_size=1, **kw)
    two = run(sdxl["folder"], ["a cat", "a dog"], sampler="euler_ancestral", batch_size=2, **kw)
    assert np.abs(one - two).max() <= 1


def test_sdxl_fp8_and_budget(sdxl):
    plain = run(sdxl["folder"])
    fp8 = run(sdxl["folder"], fp8=True)
    assert 0 < np.abs(fp8 - plain).mean() < 12
    stats = {}
    np.testing.assert_array_equal(run(sdxl["folder"], fp8=True, max_gpu_memory="64MiB", stats=stats), fp8)
    assert set(stats) == {"text encoders", "unet", "vae"}


# ----------------------------------------------------------------------------- bad input: exit 2, named
def test_bad_inputs_are_named(sdxl, capsys):
    flux = os.path.join(FIXTURES, "flux_pipeline", "pipeline")
    _fails(capsys, ["--model", flux, "--arch", "sdxl", "--prompt", "x"], f"--arch sdxl: {flux} is not an SDXL UNet",
           "FluxPipeline")
    flux_file = os.path.join(flux, "transformer", "diffusion_pytorch_model.safetensors")
    _fails(capsys, ["--model", flux_file, "--arch", "sd3", "--prompt", "x"],
           f"--arch sd3: {flux_file} is not an SD3 / SD3.5 MMDiT: it looks like a Flux transformer")
    _fails(capsys, ["--model", sdxl["unet"], "--prompt", "x"], "clip_g: missing", "--clip-g", sdxl["unet"])
    _fails(capsys, ["--model", flux, "--prompt", "x", "--cfg", "3"],
           "--cfg: an SD3 / SDXL / Chroma / Qwen-Image option; this model is Flux")
    _fails(capsys, ["--model", SD3, "--prompt", "x", "--guidance", "3"], "--guidance: Flux's embedded guidance")
    _fails(capsys, ["--model", SD3, "--prompt", "x", "--sampler", "ddim"],
           "--sampler ddim: SD3 samples with euler, heun, dpmpp_2m, dpmpp_2m_sde or unipc")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--slg-scale", "2"], "--slg-scale: an SD3 option")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--width", "80"],
           "--width 80: SDXL needs a positive multiple of 32")
    _fails(capsys, ["--model", SD3, "--prompt", "x", "--cfg", "1", "--negative-prompt", "y"],
           "--negative-prompt: without classifier-free guidance")
    _fails(capsys, ["--model", SD3, "--prompt", "x", "--slg-layers", "5"], "--slg-layers [5]: [5] are not joint "
                                                                           "blocks")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--sampler", "ddim", "--karras"], "--karras")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--scheduler", "beta"],
           "--scheduler: a Flux / SD3 / Flux Kontext / Chroma / Qwen-Image option; this model is SDXL: --karras gives "
           "Karras sigmas")
    _fails(capsys, ["--model", SD3, "--prompt", "x", "--karras"],
           "--karras: an SDXL option; this model is SD3: use --scheduler karras")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--sampler", "lcm", "--karras"],
           "--karras: lcm walks its own timesteps")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--sampler", "lcm", "--steps", "60"],
           "--steps 60: lcm takes at most 50")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--original-size", "big"], "--original-size 'big'")
    _fails(capsys, ["--model", sdxl["folder"], "--prompt", "x", "--lora", SD3 + "/vae/config.json"],
           "--lora", "config.json")
