"""FreeU on the SDXL UNet (flame_models/sdxl/freeu.py, SDXLUNet.enable_freeu) against diffusers 0.42.1
(tests/fixtures/make_freeu_fixtures.py): its fourier_filter on planes of every parity and the 1- and 2-wide edge
cases, and UNet2DConditionModel.enable_freeu on the tiny UNet at two settings; the factors' parsing; generate
--freeu (the picture changes, the PNG records it, other families refuse it)."""
import json
import os

import numpy as np
import pytest
from sdxl_fixtures import DIFFUSERS_DIR, FIXTURES, assert_close, io, unet_inputs

import flame_core as flame
from flame_core.io import load_file
from flame_models.sdxl import load_unet
from flame_models.sdxl.freeu import SDXL_DEFAULTS, fourier_filter, parse_freeu

REF = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "freeu.safetensors")).items()}
FILTERS = sorted(k for k in REF if k.startswith("filter_out_"))
SETTINGS = {"a": dict(s1=0.9, s2=0.2, b1=1.3, b2=1.4), "b": dict(s1=0.6, s2=0.4, b1=1.1, b2=1.2)}


def test_the_fixture_has_every_case():
    assert len(FILTERS) == 27 and {"out_a", "out_b"} <= set(REF)


@pytest.mark.parametrize("key", FILTERS)
def test_fourier_filter_is_diffusers(key):
    _, _, hw, s = key.split("_")
    x = REF[f"filter_in_{hw}"]
    got = fourier_filter(flame.tensor(x), float(s))
    assert got.dtype == flame.float32 and tuple(got.shape) == x.shape
    err = np.abs(got.numpy().astype(np.float64) - REF[key]).max()
    assert err <= 2e-6 * np.abs(x).max(), (key, err)


def test_fourier_filter_keeps_the_dtype_and_is_the_identity_at_scale_one():
    x = flame.tensor(REF["filter_in_8x12"]).to(flame.bfloat16)
    out = fourier_filter(x, 1.0)
    assert out.dtype == flame.bfloat16
    np.testing.assert_array_equal(out.float().numpy(), x.float().numpy())


@pytest.fixture(scope="module")
def unet64():
    return load_unet(DIFFUSERS_DIR, dtype=flame.float64, progress=False)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_unet_with_freeu_is_diffusers(unet64, name):
    ref = io()
    unet64.enable_freeu(**SETTINGS[name])
    try:
        with flame.no_grad():
            out = unet64(*unet_inputs(ref))
    finally:
        unet64.disable_freeu()
    assert_close(out, REF[f"out_{name}"], 1e-6, name)
    assert np.abs(out.numpy() - ref["out"]).max() > 0.1          # (FreeU changes the output)
    with flame.no_grad():
        assert_close(unet64(*unet_inputs(ref)), ref["out"], 5e-6, "disabled")


def test_parse_freeu():
    assert parse_freeu(None) is None and parse_freeu(False) is None
    assert parse_freeu(True) == parse_freeu("default") == SDXL_DEFAULTS
    assert parse_freeu("b1=1.1, s2=0.5") == dict(SDXL_DEFAULTS, b1=1.1, s2=0.5)
    assert parse_freeu({"s1": 1}) == dict(SDXL_DEFAULTS, s1=1.0)
    for bad, match in (("b1", "name=value pairs"), ("b3=1", "unknown factor"), ("b1=x", "b1: a finite number"),
                       ({"s1": float("nan")}, "s1: a finite number"), ({"b2": True}, "b2: a finite number"),
                       (3, "a dict")):
        with pytest.raises(ValueError, match=match):
            parse_freeu(bad)
    with pytest.raises(ValueError, match="s2"):
        load_unet(DIFFUSERS_DIR, dtype=flame.float32, progress=False).enable_freeu(0.9, "inf", 1.3, 1.4)


def test_generate_with_freeu(tmp_path, capsys):
    from sdxl_tiny import sdxl_tiny_folder

    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.generate import generate, main
    folder = sdxl_tiny_folder(tmp_path / "sdxl")
    kw = dict(steps=3, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu", dtype="fp32")
    plain = np.asarray(generate(folder, "a cat", **kw)[0], np.int16)
    out = tmp_path / "out"
    with_freeu = np.asarray(generate(folder, "a cat", freeu={"b1": 1.5, "s1": 0.5}, output=str(out), **kw)[0],
                            np.int16)
    assert np.abs(with_freeu - plain).max() > 0
    from PIL import Image
    info = json.loads(Image.open(out / os.listdir(out)[0]).text["flame"])
    assert info["freeu"] == dict(SDXL_DEFAULTS, b1=1.5, s1=0.5)
    cli = tmp_path / "cli"
    assert main(["--model", folder, "--prompt", "a cat", "--steps", "3", "--seed", "2", "--width", "32", "--height",
                 "32", "--freeu", "b1=1.5,s1=0.5", "--output", str(cli), "--no-progress", "--device", "cpu",
                 "--dtype", "fp32"]) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(cli / os.listdir(cli)[0]), np.int16), with_freeu)
    base = ["--prompt", "x", "--steps", "3", "--output", str(tmp_path / "o"), "--no-progress", "--device", "cpu"]
    assert main(["--model", folder, "--freeu", "b1=big"] + base) == 2
    assert "--freeu: FreeU b1: a finite number" in capsys.readouterr().err
    flux = tiny_flux_files(tmp_path / "flux", seed=1)
    assert main(["--model", os.path.dirname(flux.transformer), "--freeu"] + base) == 2
    assert "--freeu: an SDXL option; this model is Flux" in capsys.readouterr().err
