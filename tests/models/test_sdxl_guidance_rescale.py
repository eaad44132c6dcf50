"""generate's SDXL guidance_rescale (--guidance-rescale; diffusers' guidance_rescale, whose sampler is checked against
diffusers in test_sdxl_sampling.py): the picture changes, the PNG records it, a value outside [0, 1], one without CFG
and one for another family are refused before anything loads."""
import json
import os

import numpy as np
from PIL import Image

from flame_models.generate import generate, main


def test_generate_with_guidance_rescale(tmp_path, capsys):
    from sdxl_tiny import sdxl_tiny_folder

    from flame_models.bfl.tiny import tiny_flux_files
    folder = sdxl_tiny_folder(tmp_path / "sdxl")
    kw = dict(steps=3, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu", dtype="fp32")
    plain = np.asarray(generate(folder, "a cat", **kw)[0], np.int16)
    zero = np.asarray(generate(folder, "a cat", guidance_rescale=0.0, **kw)[0], np.int16)
    np.testing.assert_array_equal(zero, plain)
    out = tmp_path / "out"
    rescaled = np.asarray(generate(folder, "a cat", guidance_rescale=0.7, output=str(out), **kw)[0], np.int16)
    assert np.abs(rescaled - plain).max() > 0
    im = Image.open(out / os.listdir(out)[0])
    assert json.loads(im.text["flame"])["guidance_rescale"] == 0.7 and "CFG rescale: 0.7" in im.text["parameters"]
    cli = tmp_path / "cli"
    base = ["--prompt", "a cat", "--steps", "3", "--seed", "2", "--width", "32", "--height", "32", "--no-progress",
            "--device", "cpu", "--dtype", "fp32"]
    assert main(["--model", folder, "--guidance-rescale", "0.7", "--output", str(cli)] + base) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(cli / os.listdir(cli)[0]), np.int16), rescaled)
    for extra, words in ((["--guidance-rescale", "1.5"], "--guidance-rescale 1.5: a number in [0, 1]"),
                         (["--guidance-rescale", "0.5", "--cfg", "1"], "--guidance-rescale: rescales classifier-free")):
        assert main(["--model", folder, "--output", str(tmp_path / "o")] + base + extra) == 2
        assert words in capsys.readouterr().err, words
    flux = tiny_flux_files(tmp_path / "flux", seed=1)
    assert main(["--model", os.path.dirname(flux.transformer), "--guidance-rescale", "0.5",
                 "--output", str(tmp_path / "o")] + base) == 2
    assert "--guidance-rescale: an SDXL option; this model is Flux" in capsys.readouterr().err
