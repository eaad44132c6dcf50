"""DPM++ 2M SDE for the flow-matching families (flame_models/samplers/flow.py, sampler="dpmpp_2m_sde"): every step
against diffusers' DPMSolverMultistepScheduler with algorithm_type "sde-dpmsolver++" as a flow sampler, each step's
noise given to both (tests/fixtures/make_flow_sampler_fixtures.py); through the step function and SD3's and Flux's
denoising loops (Flux's with its CUDA graphs on a GPU: the noise is a graph input drawn before each replay); the
coefficients; the seeded step noise (an image's whatever its batch); and the refusals."""
import numpy as np
import pytest
from flow_cases import ARRAYS, META, cases, check_loops, flux_denoise, noise, velocity
from sd3_helpers import npy

import flame_core as flame
from flame_models.samplers.flow import (
    STOCHASTIC,
    dpmpp_2m_coefficients,
    dpmpp_2m_sde_coefficients,
    flow_step,
    multistep_state,
    step_noise,
)

CASES = cases("DPMSolverMultistepScheduler/sde-dpmsolver++")


def _tolerance(ref, sigmas):
    return 4e-6 * max(1.0, float(np.abs(ref).max())) * (1 + 1e-3 / sigmas[-2])


def test_the_fixture_has_the_cases():
    assert len(CASES) == 4 and STOCHASTIC == {"dpmpp_2m_sde"}


@pytest.mark.parametrize("case", CASES)
def test_every_step_matches_diffusers(case, device):
    m = META[case]
    sigmas, steps = m["sigmas"], m["steps"]
    ref, zs = ARRAYS[f"{case}.trajectory"].numpy(), ARRAYS[f"{case}.noise"].numpy()
    step = flow_step(velocity(device), "dpmpp_2m_sde")
    x = noise(device)
    (m_prev,) = multistep_state("dpmpp_2m_sde", x)
    atol = _tolerance(ref, sigmas)
    with flame.no_grad():
        for i in range(steps):
            t = flame.full((1,), float(np.float32(sigmas[i]) * np.float32(1000)), device=device)
            c = flame.tensor(dpmpp_2m_sde_coefficients(sigmas, i), dtype=flame.float32, device=device)
            x, m_prev = step(x, t, None, None, m_prev, flame.tensor(zs[i], device=device), c)
            np.testing.assert_allclose(npy(x), ref[i], rtol=0, atol=atol, err_msg=f"{case}, step {i}")


@pytest.mark.parametrize("case", ["dpmpp_2m_sde_shift3_5", "dpmpp_2m_sde_shift1_10"])
def test_sd3_and_flux_loops_match_diffusers(case, device):
    m = META[case]
    sigmas = m["sigmas"]
    ref, zs = ARRAYS[f"{case}.trajectory"].numpy(), ARRAYS[f"{case}.noise"].numpy()
    atol = _tolerance(ref, sigmas)
    drawn = []

    def given(i, x):
        drawn.append(i)
        return flame.tensor(zs[i], device=x.device)
    check_loops(case, device, "dpmpp_2m_sde", atol, "dpmpp_2m", step_noise=given)
    assert drawn == list(range(m["steps"])) * 2          # (SD3's loop, then Flux's: each step's noise once)
    with pytest.raises(ValueError, match="dpmpp_2m_sde draws fresh noise at every step: pass step_noise"):
        flux_denoise(device, sigmas, sampler="dpmpp_2m_sde")


def test_the_coefficients():
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    s, c_x, c_m, c_d, c_z = dpmpp_2m_sde_coefficients(sig, 0)
    # from s = 1 (lambda -inf): x' = alpha' m + s' z, the data prediction noised back to s'
    assert (s, c_x, c_m, c_d, c_z) == (1.0, 0.0, 0.25, 0.0, 0.75)
    lam = [np.log((1 - v) / v) for v in (0.75, 0.5, 0.25)]
    h, h_prev = lam[2] - lam[1], lam[1] - lam[0]
    s, c_x, c_m, c_d, c_z = dpmpp_2m_sde_coefficients(sig, 2)
    assert c_x == pytest.approx(0.5 * np.exp(-h)) and c_m == pytest.approx(0.75 * (1 - np.exp(-2 * h)))
    assert c_d == pytest.approx(0.5 * c_m * h / h_prev) and c_z == pytest.approx(0.25 * np.sqrt(1 - np.exp(-2 * h)))
    # the noise keeps the marginal: c_x^2 s^2 + c_z^2 = s'^2 e^-2h + s'^2 (1 - e^-2h) = s'^2 at a fixed m
    assert (c_x * 0.5) ** 2 + c_z ** 2 == pytest.approx(0.25 ** 2)
    assert dpmpp_2m_sde_coefficients(sig, 1)[3] == dpmpp_2m_coefficients(sig, 1)[3] == 0.0
    assert dpmpp_2m_sde_coefficients(sig, 3) == (0.25, 0.0, 1.0, 0.0, 0.0)   # into 0: x' = m, no noise
    with pytest.raises(ValueError, match="decreasing to 0"):
        dpmpp_2m_sde_coefficients([1.0, 0.5, 0.5, 0.0], 1)


def test_an_images_step_noise_is_its_own_whatever_its_batch(device):
    x3 = flame.zeros(3, 5, 4, device=device)
    together = step_noise([7, 8, 9], device)
    alone = step_noise([8], device)
    a = [npy(together(i, x3)) for i in range(2)]
    b = [npy(alone(i, x3[1:2])) for i in range(2)]
    for i in range(2):
        np.testing.assert_array_equal(a[i][1:2], b[i])
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[0][0], a[0][2])
    batch = step_noise(7, device)                      # one stream for a batch drawn from one seed
    assert batch(0, x3).shape == (3, 5, 4)
    with pytest.raises(ValueError, match="step noise for 3 images from 1 seeds"):
        alone(0, x3)


def _pipeline_checks(sample_latents, model, cond, start, **kw):
    """A pipeline's dpmpp_2m_sde from seeds: image j's as when drawn alone (its step noise from seed j + 1), not
    DPM++ 2M's; refused with latents= (`start`) and no seeds."""
    kw = dict(kw, height=32, width=32, steps=4, sampler="dpmpp_2m_sde")
    with flame.no_grad():
        both = sample_latents(model, cond, seeds=[3, 4], **kw).numpy()
        one = sample_latents(model, cond, seeds=[4], rows=[1], **kw).numpy()
        ode = sample_latents(model, cond, seeds=[3, 4], **dict(kw, sampler="dpmpp_2m")).numpy()
    np.testing.assert_allclose(both[1:], one, rtol=0, atol=1e-5)
    assert np.isfinite(both).all() and np.abs(both - ode).max() > 1e-3
    with pytest.raises(ValueError, match="dpmpp_2m_sde draws its step noise from the images' seeds"):
        sample_latents(model, cond, latents=start, **kw)


def test_flux_and_sd3_pipelines_draw_it_from_the_seeds():
    from sd3_helpers import diffusers_dir

    from flame_models.flux import pipeline as flux_pipeline
    from flame_models.flux.tiny import tiny_flux_parts
    from flame_models.sd3 import load_sd3
    from flame_models.sd3 import pipeline as sd3_pipeline
    rng = np.random.default_rng(0)
    flux = tiny_flux_parts(seed=0)["transformer"]
    p = flux.params
    cond = {"prompt_embeds": rng.standard_normal((2, 4, p.context_in_dim)).astype(np.float32),
            "pooled_prompt_embeds": rng.standard_normal((2, p.vec_in_dim)).astype(np.float32)}
    _pipeline_checks(flux_pipeline.sample_latents, flux, cond, flame.zeros(1, 4, 64),
                     guidance=3.5 if p.guidance_embed else None)
    sd3 = load_sd3(diffusers_dir("plain"), dtype=flame.float32, device="cpu")
    p = sd3.params
    cond = {"prompt_embeds": rng.standard_normal((2, 5, p.context_in_dim)).astype(np.float32),
            "pooled_prompt_embeds": rng.standard_normal((2, p.pooled_in_dim)).astype(np.float32)}
    _pipeline_checks(sd3_pipeline.sample_latents, sd3, cond, flame.zeros(1, 16, 4, 4), cfg=1.0)
