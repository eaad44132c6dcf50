"""flame_models.samplers and flame_models.sdxl.sample against diffusers: the DDPM schedule (also zero-terminal-SNR),
the sigma / timestep tables, the update rules of Euler, Euler ancestral, DPM++ 2M and DDIM on a fixed denoiser (the
reference's noise draws replayed), and guided sampling with the tiny UNet."""
import math

import numpy as np
import pytest
from sdxl_fixtures import DIFFUSERS_DIR, assert_close, fixed_model, io, schedulers, t

import flame_core as flame
from flame_models.samplers import (
    SAMPLERS,
    DDPMSchedule,
    Denoiser,
    ddim_sigmas,
    dpm_sigmas,
    get_sigmas,
    karras_sigmas,
    rescale_zero_terminal_snr,
    scaled_linear_betas,
    spaced_timesteps,
)
from flame_models.sdxl import load_unet, sample

SAMPLER_OF = {"EulerDiscreteScheduler": "euler", "EulerAncestralDiscreteScheduler": "euler_ancestral",
              "DPMSolverMultistepScheduler": "dpmpp_2m", "DDIMScheduler": "ddim"}


def _schedule(cfg):
    return DDPMSchedule(zero_terminal_snr=cfg.get("rescale_betas_zero_snr", False))


# ----------------------------------------------------------------------------- the schedule
def test_alphas_cumprod_match_diffusers():
    ref, _ = schedulers()
    assert_close(DDPMSchedule().alphas_cumprod, ref["alphas_cumprod"], 2e-6, "alphas_cumprod")
    z = DDPMSchedule(zero_terminal_snr=True)
    assert z.alphas_cumprod[-1] == 0.0 and ref["alphas_cumprod_zsnr"][-1] == 0.0
    assert_close(z.alphas_cumprod, ref["alphas_cumprod_zsnr"], 2e-6, "alphas_cumprod (zero SNR)")
    # the Euler schedulers stand 2^-24 in for the last 0, so that sigma_max = 4096 is finite
    euler = ref["alphas_cumprod_zsnr_euler"]
    assert euler[-1] == 2.0 ** -24
    # (diffusers' schedule is float32: 1 - alpha_bar near t = 0 keeps ~5 digits)
    np.testing.assert_allclose(z.sigmas, np.sqrt((1 - euler) / euler), rtol=5e-5)
    assert z.sigma_max == pytest.approx(4096.0, rel=1e-6)


def test_schedule_formulas():
    b = scaled_linear_betas(1000, 0.00085, 0.012)
    assert b[0] == pytest.approx(0.00085) and b[-1] == pytest.approx(0.012)
    np.testing.assert_allclose(np.sqrt(b), np.linspace(math.sqrt(0.00085), math.sqrt(0.012), 1000), rtol=1e-12)
    s = DDPMSchedule()
    np.testing.assert_allclose(s.sigmas, np.sqrt((1 - s.alphas_cumprod) / s.alphas_cumprod), rtol=1e-12)
    assert s.sigma_min == pytest.approx(0.0292, abs=1e-4) and s.sigma_max == pytest.approx(14.6146, abs=1e-3)
    # zero terminal SNR keeps the first sqrt(alpha_bar) and zeroes the last
    zb = rescale_zero_terminal_snr(b)
    ab = np.cumprod(1 - zb)
    assert ab[-1] == pytest.approx(0.0, abs=1e-15)
    assert np.sqrt(ab[0]) == pytest.approx(np.sqrt(1 - b[0]), rel=1e-12)
    # sigma <-> t: integers are fixed points, fractions interpolate log sigma
    ts = np.array([0.0, 1.0, 37.0, 500.0, 998.0, 999.0])
    np.testing.assert_allclose(s.sigma_to_t(s.t_to_sigma(ts)), ts, atol=1e-9)
    mid = math.exp(0.5 * (s.log_sigmas[10] + s.log_sigmas[11]))
    assert s.sigma_to_t(mid) == pytest.approx(10.5, abs=1e-9)
    assert s.sigma_to_t(1e9) == pytest.approx(999.0) and s.sigma_to_t(1e-9) == pytest.approx(0.0)


def test_spacings_and_karras():
    np.testing.assert_array_equal(spaced_timesteps(1000, 4, "leading", 1), [751, 501, 251, 1])
    np.testing.assert_array_equal(spaced_timesteps(1000, 4, "trailing"), [999, 749, 499, 249])
    np.testing.assert_allclose(spaced_timesteps(1000, 4, "linspace"), [999, 666, 333, 0])
    k = karras_sigmas(5, 0.1, 10.0, rho=7.0)
    assert k[0] == pytest.approx(10.0) and k[-1] == pytest.approx(0.1)
    np.testing.assert_allclose(np.diff(k ** (1 / 7)), np.full(4, (0.1 ** (1 / 7) - 10 ** (1 / 7)) / 4), rtol=1e-12)
    with pytest.raises(ValueError, match="timestep_spacing"):
        spaced_timesteps(1000, 4, "uniform")
    with pytest.raises(ValueError, match="scheduler"):
        get_sigmas(DDPMSchedule(), 4, "exponential")
    with pytest.raises(ValueError, match="steps"):
        spaced_timesteps(1000, 0)
    with pytest.raises(ValueError, match="not the next timestep"):
        ddim_sigmas(DDPMSchedule(), 7, "trailing")


@pytest.mark.parametrize("name", ["euler_leading", "euler_linspace_karras", "euler_leading_karras",
                                  "euler_trailing_zsnr_v", "euler_ancestral_leading", "euler_ancestral_trailing_v"])
def test_euler_tables_match_diffusers(name):
    ref, meta = schedulers()
    cfg = meta[name]["config"]
    sigmas, ts = get_sigmas(_schedule(cfg), meta[name]["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                            cfg["timestep_spacing"], cfg["steps_offset"])
    np.testing.assert_allclose(sigmas, ref[f"{name}.sigmas"], rtol=5e-5, atol=1e-9)   # float32 reference
    np.testing.assert_allclose(ts, ref[f"{name}.timesteps"], rtol=1e-5, atol=2e-3)


@pytest.mark.parametrize("name", ["dpmpp_2m", "dpmpp_2m_karras_v"])
def test_dpm_tables_match_diffusers(name):
    # DPMSolverMultistepScheduler spaces steps + 1 points and drops the last; its Karras sigmas span the whole
    # training range at rounded timesteps (EulerDiscreteScheduler's span the spaced table, at fractional ones)
    ref, meta = schedulers()
    cfg = meta[name]["config"]
    sigmas, ts = dpm_sigmas(_schedule(cfg), meta[name]["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                            cfg["timestep_spacing"], cfg["steps_offset"])
    np.testing.assert_allclose(sigmas, ref[f"{name}.sigmas"], rtol=5e-5, atol=1e-9)   # float32 reference
    np.testing.assert_array_equal(ts, ref[f"{name}.timesteps"])
    euler, _ = get_sigmas(_schedule(cfg), meta[name]["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                          cfg["timestep_spacing"], cfg["steps_offset"])
    assert np.abs(euler - sigmas).max() > 0.1                     # not Euler's table
    with pytest.raises(ValueError, match="timestep_spacing"):
        dpm_sigmas(_schedule(cfg), 4, "normal", "uniform")


@pytest.mark.parametrize("name", ["ddim_leading", "ddim_trailing_zsnr_v"])
def test_ddim_timesteps_match_diffusers(name):
    ref, meta = schedulers()
    cfg = meta[name]["config"]
    sigmas, ts = ddim_sigmas(_schedule(cfg), meta[name]["steps"], cfg["timestep_spacing"], cfg["steps_offset"])
    np.testing.assert_array_equal(ts, ref[f"{name}.timesteps"])
    assert len(sigmas) == len(ts) + 1 and sigmas[-1] == pytest.approx(DDPMSchedule().sigma_min)


# ----------------------------------------------------------------------------- the update rules
@pytest.mark.parametrize("name", ["euler_leading", "euler_linspace_karras", "euler_leading_karras",
                                  "euler_trailing_zsnr_v", "euler_ancestral_leading", "euler_ancestral_trailing_v",
                                  "dpmpp_2m", "dpmpp_2m_karras_v", "ddim_leading", "ddim_leading_eta",
                                  "ddim_trailing_zsnr_v"])
def test_sampler_trajectory_matches_diffusers(name):
    """Every step of our sampler equals the diffusers scheduler's, on the same denoiser, table and noise draws.
    diffusers' DPM-Solver and DDIM keep VP samples (x / sqrt(sigma^2 + 1)); ours are VE, compared after scaling."""
    ref, meta = schedulers()
    m = meta[name]
    cfg, pred = m["config"], m["config"]["prediction_type"]
    sampler = SAMPLER_OF[m["scheduler"]]
    schedule = _schedule(cfg)
    if sampler == "dpmpp_2m":                   # diffusers' DPM table (test_dpm_tables_match_diffusers)
        sigmas, ts = dpm_sigmas(schedule, m["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                                cfg["timestep_spacing"], cfg["steps_offset"])
    elif sampler == "ddim":
        sigmas, ts = ddim_sigmas(schedule, m["steps"], cfg["timestep_spacing"], cfg["steps_offset"])
    else:
        sigmas, ts = get_sigmas(schedule, m["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                                cfg["timestep_spacing"], cfg["steps_offset"])
    vp = sampler in ("dpmpp_2m", "ddim")
    scale = [math.sqrt(float(s) ** 2 + 1.0) if vp else 1.0 for s in sigmas]
    traj = ref[f"{name}.trajectory"]
    states = []
    draws = ref.get(f"{name}.noise_draws")
    kwargs = {}
    if draws is not None:
        kwargs["noise"] = lambda i, x: t(draws[i])
    if m["eta"] is not None:
        kwargs["eta"] = m["eta"]
    elif sampler == "euler_ancestral":
        kwargs["eta"] = 1.0
    x = t(traj[0] * scale[0])
    denoiser = Denoiser(fixed_model(ref["pattern"]), schedule, pred)
    SAMPLERS[sampler](denoiser, x, sigmas, ts, callback=lambda i, x, x0, s: states.append(x.numpy()), **kwargs)
    # ZTSNR + DDIM: diffusers' ᾱ_T is exactly 0, ours 2^-24 (sigma 4096): x0 differs by 2^-12 of x at the first step.
    # ZTSNR + Euler: the float32 reference steps from x ~ 4096 noise (its rounding ~3e-5 of the result)
    rtol = {"ddim_trailing_zsnr_v": 2e-3, "euler_trailing_zsnr_v": 1e-4}.get(name, 2e-5)
    for i, got in enumerate(states):
        assert_close(got / scale[i + 1], traj[i + 1], rtol, f"{name} step {i}")
    # the initial noise scale sample() uses, in the scheduler's space (VP schedulers start from the noise itself)
    s0 = float(sigmas[0])
    want = 1.0 if vp else (math.sqrt(s0 * s0 + 1) if cfg["timestep_spacing"] == "leading" else s0)
    assert meta[name]["init_noise_sigma"] == pytest.approx(want, rel=5e-5)


def test_ancestral_with_generator_is_seeded():
    schedule = DDPMSchedule()
    sigmas, ts = get_sigmas(schedule, 5)
    d = Denoiser(lambda x, tt: x * 0.5, schedule)
    x = flame.ones(1, 4, 2, 2) * float(sigmas[0])
    a = SAMPLERS["euler_ancestral"](d, x, sigmas, ts, generator=flame.Generator().manual_seed(3))
    b = SAMPLERS["euler_ancestral"](d, x, sigmas, ts, generator=flame.Generator().manual_seed(3))
    c = SAMPLERS["euler_ancestral"](d, x, sigmas, ts, generator=flame.Generator().manual_seed(4))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.abs(a.numpy() - c.numpy()).max() > 1e-3


# ----------------------------------------------------------------------------- training helpers
def test_training_helpers():
    s = DDPMSchedule()
    rng = np.random.default_rng(0)
    x0, eps = rng.standard_normal((3, 4, 2, 2)).astype(np.float32), rng.standard_normal((3, 4, 2, 2)).astype(np.float32)
    steps = np.array([0, 500, 999])
    ab = s.alphas_cumprod[steps].reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(s.add_noise(t(x0), t(eps), t(steps)).numpy(),
                               np.sqrt(ab) * x0 + np.sqrt(1 - ab) * eps, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.velocity(t(x0), t(eps), steps).numpy(), np.sqrt(ab) * eps - np.sqrt(1 - ab) * x0,
                               rtol=1e-5, atol=1e-6)
    snr = s.snr(steps)
    np.testing.assert_allclose(snr, ab.reshape(-1) / (1 - ab.reshape(-1)))
    np.testing.assert_allclose(s.min_snr_weights(steps, 5.0), np.minimum(snr, 5.0) / snr, rtol=1e-6)
    np.testing.assert_allclose(s.min_snr_weights(steps, 5.0, "v_prediction"), np.minimum(snr, 5.0) / (snr + 1),
                               rtol=1e-6)
    assert s.min_snr_weights(steps, 5.0)[0] == pytest.approx(5.0 / snr[0])      # high SNR at t = 0: clipped
    z = DDPMSchedule(zero_terminal_snr=True)
    assert z.min_snr_weights([999], 5.0, "v_prediction")[0] == 0.0
    np.testing.assert_allclose(z.add_noise(t(x0), t(eps), [999, 999, 999]).numpy(), eps, atol=1e-7)
    with pytest.raises(ValueError, match="timesteps"):
        s.add_noise(t(x0), t(eps), [0, 1, 1000])
    with pytest.raises(ValueError, match="prediction_type"):
        s.min_snr_weights(steps, 5.0, "sample")


# ----------------------------------------------------------------------------- guided sampling with the UNet
@pytest.fixture(scope="module")
def unet():
    return load_unet(DIFFUSERS_DIR, dtype=flame.float32, progress=False)


def test_sample_euler_cfg_rescale_matches_diffusers(unet):
    ref = io()
    z = sample(unet, t(ref["context"]), t(ref["y"]), t(ref["guided_neg_context"]), t(ref["guided_neg_y"]),
               height=128, width=128, steps=4, cfg=5.0, sampler="euler", guidance_rescale=0.7,
               noise=t(ref["guided_noise"]), progress=False)
    assert_close(z, ref["guided_euler"], 2e-5, "euler + cfg + rescale")


def test_sample_ddim_v_zero_snr_matches_diffusers(unet):
    ref = io()
    z = sample(unet, t(ref["context"]), t(ref["y"]), t(ref["guided_neg_context"]), t(ref["guided_neg_y"]),
               height=128, width=128, steps=5, cfg=3.0, sampler="ddim", prediction_type="v_prediction",
               zero_terminal_snr=True, timestep_spacing="trailing", noise=t(ref["guided_noise"]), progress=False)
    # diffusers' DDIM has alpha_bar_T = 0 exactly, ours 2^-24 (see test_sampler_trajectory_matches_diffusers)
    assert_close(z, ref["guided_ddim_v_zsnr"], 2e-3, "ddim v zero-SNR")


def test_sample_defaults_and_unconditional_input(unet):
    ref = io()
    ctx, y = t(ref["context"]), t(ref["y"])
    kw = dict(height=64, width=64, steps=2, progress=False)
    a = sample(unet, ctx, y, seed=5, **kw)
    b = sample(unet, ctx, y, seed=5, **kw)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.shape == (2, 4, 8, 8) and a.dtype == flame.float32
    # no negative given: zero context, and y with its pooled part zeroed but its size embeddings kept
    neg_y = flame.cat([flame.zeros(2, 16), y[:, 16:]], dim=1)
    c = sample(unet, ctx, y, flame.zeros_like(ctx), neg_y, seed=5, **kw)
    np.testing.assert_array_equal(a.numpy(), c.numpy())
    d = sample(unet, ctx, y, flame.zeros_like(ctx), flame.zeros_like(y), seed=5, **kw)
    assert np.abs(a.numpy() - d.numpy()).max() > 1e-4
    # cfg = 1: the conditional prediction alone
    for sampler in ("euler_ancestral", "dpmpp_2m"):
        e = sample(unet, ctx, y, cfg=1.0, sampler=sampler, scheduler="karras", seed=1, **kw)
        assert np.isfinite(e.numpy()).all()


def test_sample_rejects_bad_arguments(unet):
    ref = io()
    ctx, y = t(ref["context"]), t(ref["y"])
    kw = dict(height=64, width=64, steps=2, progress=False)
    with pytest.raises(ValueError, match="unknown sampler"):
        sample(unet, ctx, y, sampler="lms", **kw)
    with pytest.raises(ValueError, match="ddim"):
        sample(unet, ctx, y, sampler="ddim", scheduler="karras", **kw)
    with pytest.raises(ValueError, match="eta"):
        sample(unet, ctx, y, sampler="euler", eta=0.5, **kw)
    with pytest.raises(ValueError, match="multiples of 32"):
        sample(unet, ctx, y, height=72, width=64, steps=2)
    with pytest.raises(ValueError, match="y must be"):
        sample(unet, ctx, y[:, :10], **kw)
    with pytest.raises(ValueError, match="context must be"):
        sample(unet, ctx[..., :8], y, **kw)
    with pytest.raises(ValueError, match="prediction_type"):
        sample(unet, ctx, y, prediction_type="x0", **kw)
    with pytest.raises(ValueError, match="noise must be"):
        sample(unet, ctx, y, noise=flame.zeros(1, 4, 8, 8), **kw)
