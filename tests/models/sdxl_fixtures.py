"""Shared helpers of the SDXL tests: the golden fixtures of tests/fixtures/make_sdxl_fixtures.py (diffusers'
UNet2DConditionModel on a tiny random config, SDXL base's key layout, diffusers' schedulers on a fixed denoiser)."""
import functools
import gzip
import json
import os

import numpy as np

import flame_core as flame
from flame_core.io import load_file

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sdxl")
DIFFUSERS_DIR = os.path.join(FIXTURES, "tiny")
# the suite also runs with FLAME_DEVICE=cuda: float32 on the GPU (cuBLAS, the conv and attention kernels) rounds
# differently, so no bound there is tighter than this (tests/models/test_sdxl_gpu.py has the GPU's own checks)
RTOL_FLOOR = 1e-4 if flame.default_device().type == "cuda" else 0.0
SAI_FILE = os.path.join(FIXTURES, "tiny_sai.safetensors")


@functools.lru_cache(maxsize=None)
def _io():
    return {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "tiny_io.safetensors")).items()}


def io():
    """The tiny UNet's inputs, y, outputs, gradients and guided runs (float32 / int64 NumPy arrays)."""
    return dict(_io())


@functools.lru_cache(maxsize=None)
def _schedulers():
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "schedulers.safetensors")).items()}
    with open(os.path.join(FIXTURES, "schedulers.json")) as f:
        return tensors, json.load(f)


def schedulers():
    tensors, meta = _schedulers()
    return dict(tensors), meta


@functools.lru_cache(maxsize=None)
def sdxl_base_keys():
    """{SAI key: (diffusers key, shape)} of SDXL base, from diffusers on the meta device."""
    with gzip.open(os.path.join(FIXTURES, "sdxl_base_keys.json.gz")) as f:
        return {k: (d, tuple(s)) for k, (d, s) in json.loads(f.read()).items()}


def sdxl_base_config():
    with open(os.path.join(FIXTURES, "sdxl_base_config.json")) as f:
        return json.load(f)


def diffusers_config():
    with open(os.path.join(DIFFUSERS_DIR, "config.json")) as f:
        return json.load(f)


def t(a, device=None, dtype=None):
    a = np.asarray(a)
    return flame.tensor(a, dtype=dtype, device=device) if dtype is not None else flame.tensor(a, device=device)


def unet_inputs(ref, device=None, frac=False):
    """(x, timesteps, context, y) of the fixture as tensors."""
    ts = ref["timesteps_frac"] if frac else ref["timesteps"]
    return (t(ref["x"], device), t(ts, device), t(ref["context"], device), t(ref["y"], device))


def assert_close(got, want, rtol, what=""):
    """|got - want| <= rtol * max|want| everywhere (scale-relative: outputs mix large and tiny values)."""
    rtol = max(rtol, RTOL_FLOOR)
    got = got.float().numpy() if isinstance(got, flame.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got.astype(np.float64) - want).max())
    scale = float(np.abs(want).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x {scale:.3g}"
    return err / scale


def fixed_model(pattern):
    """tanh(0.8 x_in) + pattern * t / 1000: the scheduler fixtures' stand-in for a UNet (tests/fixtures/
    make_sdxl_fixtures.fixed_model)."""
    p = t(pattern)

    def model(x_in, timestep):
        return (x_in * 0.8).tanh() + p * (float(timestep) / 1000.0)
    return model
