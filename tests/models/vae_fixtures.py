"""Shared helpers of the VAE tests: the golden fixtures of tests/fixtures/make_vae_fixtures.py (diffusers'
AutoencoderKL on two tiny random configs) and comparisons against them."""
import json
import os

import numpy as np

import flame_core as flame
from flame_core.io import load_file, safe_open

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "vae")
NAMES = ("sdxl_tiny", "flux_tiny")
GROUPS = 2  # the fixtures' norm_num_groups (a bare LDM file cannot say it)


def folder(name):
    return os.path.join(FIXTURES, name)


def diffusers_file(name):
    return os.path.join(FIXTURES, name, "diffusion_pytorch_model.safetensors")


def ldm_file(name):
    return os.path.join(FIXTURES, f"{name}_ldm.safetensors")


def io(name):
    """(tensors as float32 NumPy arrays, tiling settings) of a fixture's inputs and outputs."""
    path = os.path.join(FIXTURES, f"{name}_io.safetensors")
    with safe_open(path) as f:
        meta = json.loads(f.metadata()["tiling"])
    return {k: v.numpy() for k, v in load_file(path).items()}, meta


def diffusers_config(name):
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return json.load(f)


def t(a, device=None, dtype=flame.float32):
    return flame.tensor(np.asarray(a), dtype=dtype, device=device)


def assert_close(got, want, rtol=2e-5, what=""):
    """|got - want| <= rtol * max|want| everywhere (a scale-relative bound: outputs mix large and tiny values)."""
    got = got.float().numpy() if isinstance(got, flame.Tensor) else np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got.astype(np.float64) - want).max())
    scale = float(np.abs(want).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x {scale:.3g}"
    return err / scale


def check_against_fixture(vae, name, device=None, rtol=2e-5):
    """Encode mean, clamped logvar, the sample for the stored noise, and decode match diffusers' outputs."""
    ref, _ = io(name)
    with flame.no_grad():
        dist = vae.encode_dist(t(ref["images"], device))
        assert_close(dist.mean, ref["mean"], rtol, f"{name} mean")
        assert_close(dist.logvar, ref["logvar"], rtol, f"{name} logvar")
        assert_close(dist.sample(noise=t(ref["noise"], device)), ref["sample"], rtol, f"{name} sample")
        assert_close(vae.decode(t(ref["latents"], device)), ref["decoded"], rtol, f"{name} decode")
