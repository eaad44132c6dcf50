"""generate's hires pass (hires_scale / --hires-scale, A1111's "Hires. fix"): the same pictures as the two passes run
by hand -- text-to-image at the first size, each image upscaled (Lanczos) and run through image-to-image from its own
seed --, whatever the prompts, images per prompt and batch; one init image per job (InitImage with a list); the PNG
fields; the refusals, before anything is loaded."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from flame_models.bfl.tiny import tiny_flux_files
from flame_models.generate import GenerateError, generate, main

QUIET = dict(progress=False, log=lambda *a: None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_flux_files(tmp_path_factory.mktemp("hires") / "flux", seed=1)


def pixels(images):
    return np.stack([np.asarray(im).astype(np.int16) for im in images])


def _by_hand(model, prompts, seed, num_images, size, big, steps, hires_steps, strength, **kw):
    first = generate(model, prompts, seed=seed, num_images=num_images, width=size[0], height=size[1], steps=steps,
                     **kw, **QUIET)
    out = []
    for k, im in enumerate(first):
        i, j = divmod(k, num_images)
        out += generate(model, prompts[i], seed=seed + j, width=big[0], height=big[1], steps=hires_steps,
                        init_image=im.resize(big, Image.LANCZOS), strength=strength, **kw, **QUIET)
    return pixels(out)


def test_flux_hires_is_the_two_passes_by_hand(tiny, tmp_path):
    prompts = ["a red square", "a blue circle"]
    out = tmp_path / "out"
    got = pixels(generate(tiny, prompts, seed=3, num_images=2, width=32, height=32, steps=3, hires_scale=1.5,
                          hires_strength=0.6, hires_steps=4, output=str(out), **QUIET))
    assert got.shape == (4, 48, 48, 3)
    want = _by_hand(tiny, prompts, 3, 2, (32, 32), (48, 48), 3, 4, 0.6)
    np.testing.assert_array_equal(got, want)
    names = sorted(os.listdir(out))
    assert len(names) == 4
    im = Image.open(out / names[0])
    assert im.size == (48, 48)
    assert "Size: 48x48, Denoising strength: 0.6, Hires steps: 4, Hires base size: 32x32" in im.text["parameters"]
    info = json.loads(im.text["flame"])
    assert info["hires"] == {"scale": 1.5, "base_size": [32, 32], "upscaler": "lanczos", "steps": 4,
                             "strength": 0.6}


def test_sdxl_hires_in_a_batch(tmp_path):
    """SDXL (its size floored to 32), two jobs in one batch of the second pass, each with its own init latents:
    euler_ancestral (run image by image inside the batch, so equal to the single runs bit for bit), and euler (one
    batched UNet call: equal up to the batch's float32 rounding)."""
    from sdxl_tiny import sdxl_tiny_folder
    folder = sdxl_tiny_folder(tmp_path / "sdxl")
    for sampler, tol in (("euler_ancestral", 0), ("euler", 1)):
        got = pixels(generate(folder, "a cat", seed=5, num_images=2, batch_size=2, width=32, height=32, steps=3,
                              hires_scale=2.2, sampler=sampler, **QUIET))
        assert got.shape == (2, 64, 64, 3)                              # 70.4 floored to 64
        want = _by_hand(folder, ["a cat"], 5, 2, (32, 32), (64, 64), 3, 3, 0.5, sampler=sampler)
        assert np.abs(got - want).max() <= tol, sampler
        assert np.abs(got[0] - got[1]).max() > 10                       # (two pictures, not one twice)


def test_what_hires_refuses(tiny, tmp_path, capsys):
    root = os.path.dirname(tiny.transformer)
    base = ["--model", root, "--prompt", "x", "--steps", "3", "--output", str(tmp_path / "o"), "--no-progress",
            "--device", "cpu"]
    img = tmp_path / "i.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(img)
    for extra, needle in ((["--hires-scale", "1"], "--hires-scale 1.0: a factor in (1, 4]"),
                          (["--hires-scale", "5"], "--hires-scale 5.0: a factor in (1, 4]"),
                          (["--hires-scale", "nan"], "a factor in (1, 4]"),
                          (["--hires-strength", "0.4"], "--hires-strength: applies to a hires pass"),
                          (["--hires-steps", "4"], "--hires-steps: applies to a hires pass"),
                          (["--hires-scale", "2", "--hires-strength", "0"], "--hires-strength"),
                          (["--hires-scale", "2", "--hires-steps", "0"], "--hires-steps 0"),
                          (["--hires-scale", "2", "--init-image", str(img)], "leave --init-image out")):
        assert main(base + extra) == 2, extra
        assert needle in capsys.readouterr().err, (extra, needle)
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
    with pytest.raises(GenerateError, match="2 images for 1 jobs"):
        generate(tiny, "x", steps=3, width=32, height=32, init_image=[str(img), str(img)], **QUIET)
    with pytest.raises(GenerateError, match="takes no mask"):
        generate(tiny, "x", steps=3, width=32, height=32, init_image=[str(img)], mask=str(img), **QUIET)


def test_the_png_names_the_familys_default_steps(tiny, tmp_path):
    out = tmp_path / "out"
    generate(tiny, "x", seed=1, width=32, height=32, hires_scale=1.5, output=str(out), **QUIET)   # dev: 28 steps
    im = Image.open(out / os.listdir(out)[0])
    assert "Steps: 28," in im.text["parameters"] and "Hires steps: 28, Hires base size: 32x32" in im.text["parameters"]
    assert json.loads(im.text["flame"])["hires"]["steps"] == 28
