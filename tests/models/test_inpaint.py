"""Inpainting (flame_models/samplers/inpaint.py) on the samplers' stand-in models, which act position by position
(v or x0 at a position depends on that position only): there the masked run must be, position by position, the
image-to-image run where the mask is 1 and the image's latents where it is 0 -- for every sampler, the stochastic
ones included, inside Flux's and SD3's CUDA step graphs on a GPU -- and a soft mask in between."""
import math

import numpy as np
import pytest
from flow_cases import FluxLike, SD3Like

import flame_core as flame
from flame_models.samplers import SAMPLERS, DDPMSchedule, Denoiser, ddim_sigmas, dpm_sigmas, get_sigmas, kdpm2_sigmas
from flame_models.samplers.flow import step_noise
from flame_models.samplers.img2img import flow_start, ve_start
from flame_models.samplers.inpaint import latent_mask, pool_mask, read_mask, ve_inpaint

rng = np.random.default_rng(5)
PATTERN = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
INIT = (rng.standard_normal((1, 4, 4, 4)) * 0.7).astype(np.float32)
NOISE = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
MASK = np.zeros((4, 4), np.float32)
MASK[1:3, :2] = 1.0     # repaint a 2 x 2 patch
MASK[0, 3] = 0.5        # and blend one position


def _t(a, device):
    return flame.tensor(np.asarray(a, np.float32), device=device)


def _stand_in(cls, device):
    m = cls(device)
    m.pattern = _t(PATTERN, device)
    return m


def _flow_sigmas(steps=8, shift=3.0):
    s = np.linspace(1.0, 1.0 / steps, steps)
    s = shift * s / (1 + (shift - 1) * s)
    return np.append(s, 0.0)


@pytest.mark.parametrize("sampler", ["euler", "heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc"])
@pytest.mark.parametrize("loop", ["sd3", "flux"])
def test_flow_inpainting_keeps_the_image_outside_the_mask(sampler, loop, device):
    from flame_models.bfl import sampling as bfl
    from flame_models.sd3.sampling import denoise
    init, noise = _t(INIT, device), _t(NOISE, device)
    rest, x = flow_start(_flow_sigmas(), init, noise, 0.8)
    m = latent_mask(MASK, (1, 4, 4, 4), device)

    def run(inpaint):
        z = step_noise([7], device) if sampler == "dpmpp_2m_sde" else None
        if loop == "sd3":
            return denoise(_stand_in(SD3Like, device), x, rest, flame.zeros(1, 2, 3, device=device),
                           flame.zeros(1, 3, device=device), sampler=sampler, step_noise=z,
                           inpaint=inpaint).float().numpy()
        return bfl.denoise(_stand_in(FluxLike, device), x, None, None, None, None, rest, None, sampler=sampler,
                           step_noise=z, inpaint=inpaint).float().numpy()

    free = run(None)
    got = run((m, init, noise))
    keep, paint = MASK == 0, MASK == 1
    np.testing.assert_allclose(got[..., keep], INIT[..., keep], rtol=0, atol=2e-5)       # the image
    np.testing.assert_allclose(got[..., paint], free[..., paint], rtol=0, atol=2e-5)     # as img2img
    assert np.abs(got[..., 0, 3] - INIT[..., 0, 3]).max() > 1e-3                       # blended, not kept
    assert np.abs(free[..., keep] - INIT[..., keep]).max() > 1e-2                       # (the mask did it)
    ones = run((latent_mask(np.ones((4, 4), np.float32), (1, 4, 4, 4), device), init, noise))
    np.testing.assert_allclose(ones, free, rtol=0, atol=1e-6)


SDXL_CASES = {"euler": get_sigmas, "heun": get_sigmas, "dpm_2": kdpm2_sigmas, "dpmpp_2m": dpm_sigmas,
              "unipc": dpm_sigmas, "ddim": None, "euler_ancestral": get_sigmas, "dpmpp_2m_sde": dpm_sigmas}


@pytest.mark.parametrize("sampler", sorted(SDXL_CASES))
def test_sdxl_inpainting_keeps_the_image_outside_the_mask(sampler, device):
    schedule = DDPMSchedule()
    sigmas, ts = (ddim_sigmas(schedule, 10) if sampler == "ddim" else SDXL_CASES[sampler](schedule, 10))
    init, noise = _t(INIT, device), _t(NOISE, device)
    rest, rest_ts, x = ve_start(sigmas, init, noise, 0.7, ts)
    p = _t(PATTERN, device)
    d = Denoiser(lambda x_in, tt: (x_in * 0.8).tanh() + p * (float(tt) / 1000.0), schedule)
    kw = {"generator": flame.Generator(device).manual_seed(3)} if sampler in ("euler_ancestral",
                                                                               "dpmpp_2m_sde") else {}

    def run(model):
        k = {n: flame.Generator(device).manual_seed(3) for n in kw}
        out = SAMPLERS[sampler](model, x, rest, rest_ts, **k)
        s_last = float(rest[-1])
        return (out * (1.0 / math.sqrt(s_last * s_last + 1.0))).numpy()

    free = run(d)
    got = run(ve_inpaint(d, latent_mask(MASK, (1, 4, 4, 4), device), init, noise))
    keep, paint = MASK == 0, MASK == 1
    # (DDIM ends at ᾱ_0, σ > 0: the image noised to it, in the VP scale; the others at σ = 0: the image)
    s_last = float(rest[-1])
    want = (INIT + s_last * NOISE) / math.sqrt(s_last * s_last + 1.0)
    np.testing.assert_allclose(got[..., keep], want[..., keep], rtol=0, atol=2e-5)
    np.testing.assert_allclose(got[..., paint], free[..., paint], rtol=0, atol=2e-5)


def test_latent_mask_and_read_mask(tmp_path, device):
    m = latent_mask(np.ones((1, 4, 4), np.float32), (2, 16, 4, 4), device)
    assert tuple(m.shape) == (2, 16, 4, 4)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) does not fit latents \(1, 16, 4, 4\)"):
        latent_mask(np.ones((3, 5), np.float32), (1, 16, 4, 4), device)
    with pytest.raises(ValueError, match=r"mask values must be in \[0, 1\].*got \[0, 2\]"):
        latent_mask(np.array([[0.0, 2.0]] * 2, np.float32), (1, 4, 2, 2), device)
    from PIL import Image
    a = np.zeros((40, 56), np.uint8)
    a[:, 28:] = 255                                     # the right half: repaint
    Image.fromarray(a).save(tmp_path / "mask.png")
    pixel = read_mask(str(tmp_path / "mask.png"), 48, 32)  # cover 48 x 32 (crop the sides)
    assert pixel.shape == (32, 48) and pixel.dtype == np.float32
    got = pool_mask(pixel)                                  # boxes of 8
    np.testing.assert_allclose(got[0, 1, 2], pixel[8:16, 16:24].mean(), rtol=1e-6)
    assert got.shape == (1, 4, 6) and got.dtype == np.float32
    np.testing.assert_allclose(got[0, :, :3], 0.0, atol=0.01)     # (LANCZOS rings by a level at the edge)
    np.testing.assert_allclose(got[0, :, 3:], 1.0, atol=0.01)
