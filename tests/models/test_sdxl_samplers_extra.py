"""Heun, DPM2, DPM2 ancestral, DPM++ 2M SDE, UniPC and LCM (flame_models.samplers) against diffusers'
HeunDiscreteScheduler, KDPM2DiscreteScheduler, KDPM2AncestralDiscreteScheduler, DPMSolverMultistepScheduler
(sde-dpmsolver++), UniPCMultistepScheduler and LCMScheduler: the sigma /
timestep tables (diffusers interleaves the two model calls of a Heun / KDPM2 step in them), every step on the fixed
denoiser of tests/fixtures/make_sampler_fixtures.py (the reference's noise draws replayed), guided sampling with the
tiny UNet through flame_models.sdxl.sample, and its option checks."""
import functools
import json
import math
import os

import numpy as np
import pytest
from sdxl_fixtures import DIFFUSERS_DIR, FIXTURES, assert_close, fixed_model, io, t

import flame_core as flame
from flame_core.io import load_file
from flame_models.samplers import (
    DRAWS_NOISE,
    SAMPLERS,
    STOCHASTIC,
    DDPMSchedule,
    Denoiser,
    ancestral_sigmas,
    dpm_sigmas,
    get_sigmas,
    kdpm2_sigmas,
    lcm_sigmas,
)
from flame_models.sdxl import load_unet, pipeline, sample
from flame_models.sdxl.generate import SAMPLER_NAMES

SAMPLER_OF = {"HeunDiscreteScheduler": "heun", "KDPM2DiscreteScheduler": "dpm_2",
              "KDPM2AncestralDiscreteScheduler": "dpm_2_ancestral", "DPMSolverMultistepScheduler": "dpmpp_2m_sde",
              "LCMScheduler": "lcm", "UniPCMultistepScheduler": "unipc"}
TABLE_OF = {"heun": get_sigmas, "dpm_2": kdpm2_sigmas, "dpm_2_ancestral": kdpm2_sigmas, "dpmpp_2m_sde": dpm_sigmas,
            "lcm": lambda schedule, steps, *spacing: lcm_sigmas(schedule, steps),   # (LCM's own timesteps)
            "unipc": dpm_sigmas}
VP = ("dpmpp_2m_sde", "lcm", "unipc")   # the samplers whose diffusers scheduler keeps VP samples
ODE_OF = {"dpm_2_ancestral": "dpm_2", "dpmpp_2m_sde": "dpmpp_2m"}     # the same sampler with eta 0


@functools.lru_cache(maxsize=None)
def _fixtures():
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "samplers_extra.safetensors")).items()}
    with open(os.path.join(FIXTURES, "samplers_extra.json")) as f:
        return tensors, json.load(f)


def fixtures():
    tensors, meta = _fixtures()
    return dict(tensors), meta


CASES = [name for name in _fixtures()[1] if name != "guided"]


def _table(name):
    """(sampler, sigmas, timesteps) of a case, by our table function."""
    meta = fixtures()[1][name]
    cfg, sampler = meta["config"], SAMPLER_OF[meta["scheduler"]]
    scheduler = "karras" if cfg.get("use_karras_sigmas") else "normal"
    sigmas, ts = TABLE_OF[sampler](DDPMSchedule(), meta["steps"], scheduler, cfg["timestep_spacing"],
                                   cfg["steps_offset"])
    return sampler, sigmas, ts


# ----------------------------------------------------------------------------- the tables
@pytest.mark.parametrize("name", CASES)
def test_tables_match_diffusers(name):
    """Heun's table is diffusers' [σ0, σ1, σ1, ..., σn-1, σn-1, 0] with [t0, t1, t1, ..., tn-1, tn-1] (its second call
    of a step gets the next σ's timestep); the KDPM2 schedulers' [σ0, σ1, σ1, ..., 0, 0, 0] with
    [t0, tm0, t1, tm1, ..., tn-1] (tm: the midpoint σ's fractional timestep)."""
    ref, meta = fixtures()
    sampler, sigmas, ts = _table(name)
    schedule = DDPMSchedule()
    want_s, want_t = ref[f"{name}.sigmas"], ref[f"{name}.timesteps"]
    n = meta[name]["steps"]
    if sampler == "heun":
        want_s = np.append(want_s[::2], want_s[-1])
        np.testing.assert_allclose(want_t[1::2], ts[1:], rtol=1e-5, atol=2e-3)   # a step's second call: σ''s t
    elif sampler in ("dpm_2", "dpm_2_ancestral"):
        want_s = want_s[::2]
        if sampler == "dpm_2":            # midpoints between σ and σ'
            mid = np.exp(0.5 * (np.log(sigmas[:n - 1]) + np.log(sigmas[1:n])))
            np.testing.assert_allclose(mid, ref[f"{name}.sigmas_interpol"][1:2 * n - 1:2], rtol=5e-5)
        else:                             # midpoints between σ and σ_down
            down = np.array([ancestral_sigmas(float(sigmas[i]), float(sigmas[i + 1]))[0] for i in range(n - 1)])
            mid = np.exp(0.5 * (np.log(sigmas[:n - 1]) + np.log(down)))
            np.testing.assert_allclose(mid, ref[f"{name}.sigmas_interpol"][0:2 * n - 2:2], rtol=5e-5)
        # the midpoint's timestep: the denoiser's lookup of σ_m (float32 σ_m in the reference)
        np.testing.assert_allclose(schedule.sigma_to_t(mid), want_t[1::2], rtol=1e-5, atol=1e-3)
    want_t = want_t[::2] if sampler not in VP else want_t
    np.testing.assert_allclose(sigmas, want_s, rtol=5e-5, atol=1e-9)   # float32 reference
    np.testing.assert_allclose(ts, want_t, rtol=1e-5, atol=2e-3)
    if sampler != "heun" and "karras" in name:
        np.testing.assert_array_equal(ts, np.round(ts))               # rounded Karras timesteps


def test_kdpm2_table_is_eulers_with_rounded_karras_timesteps():
    schedule = DDPMSchedule()
    for scheduler in ("normal", "karras"):
        es, et = get_sigmas(schedule, 7, scheduler)
        ks, kt = kdpm2_sigmas(schedule, 7, scheduler)
        np.testing.assert_array_equal(ks, es)
        np.testing.assert_array_equal(kt, et if scheduler == "normal" else np.round(et))
    assert np.abs(et - np.round(et)).max() > 0.01                     # Euler's Karras timesteps are fractional
    with pytest.raises(ValueError, match="scheduler"):
        kdpm2_sigmas(schedule, 4, "exponential")


# ----------------------------------------------------------------------------- the update rules
@pytest.mark.parametrize("name", CASES)
def test_sampler_trajectory_matches_diffusers(name):
    """Every step of our sampler equals the diffusers scheduler's (at the scheduler calls that end a step), on the
    same denoiser, table and noise draws. DPM-Solver, UniPC and LCM keep VP samples (x / sqrt(sigma^2 + 1)),
    compared after scaling; the others keep VE samples as ours. UniPC's steps are its predictor's results (each
    corrected at the start of the next step, as diffusers' scheduler does)."""
    ref, meta = fixtures()
    m = meta[name]
    sampler, sigmas, ts = _table(name)
    vp = sampler in VP
    scale = [math.sqrt(float(s) ** 2 + 1.0) if vp else 1.0 for s in sigmas]
    traj = ref[f"{name}.trajectory"]
    states = []
    draws = ref.get(f"{name}.noise_draws")
    kwargs = {} if draws is None else {"noise": lambda i, x: t(draws[i])}     # draw i: step i's
    x = t(traj[0] * scale[0])
    denoiser = Denoiser(fixed_model(ref["pattern"]), DDPMSchedule(), m["config"]["prediction_type"])
    SAMPLERS[sampler](denoiser, x, sigmas, ts, callback=lambda i, x, x0, s: states.append(x.numpy()), **kwargs)
    assert len(states) == len(m["step_ends"]) == m["steps"]
    for i, got in enumerate(states):
        assert_close(got / scale[i + 1], traj[m["step_ends"][i]], 2e-5, f"{name} step {i}")
    # the initial noise scale sample() uses, in the scheduler's space (DPM-Solver, UniPC and LCM start from the noise)
    s0 = float(sigmas[0])
    want = 1.0 if vp else (math.sqrt(s0 * s0 + 1) if m["config"]["timestep_spacing"] == "leading" else s0)
    assert m["init_noise_sigma"] == pytest.approx(want, rel=5e-5)


def test_model_calls_per_step():
    """Heun and DPM2 call the model twice a step and once for the last (Euler into 0); Heun's second call is at σ'
    with σ''s timestep, DPM2's at the midpoint σ_m with the denoiser's lookup of its timestep."""
    schedule = DDPMSchedule()
    sigmas, ts = get_sigmas(schedule, 4)
    calls = []

    def model(x_in, tt):
        calls.append(tt)
        return x_in * 0.5
    d = Denoiser(model, schedule)
    x = flame.ones(1, 4, 2, 2) * float(sigmas[0])
    SAMPLERS["heun"](d, x, sigmas, ts)
    np.testing.assert_array_equal(calls, [ts[0], ts[1], ts[1], ts[2], ts[2], ts[3], ts[3]])
    calls.clear()
    SAMPLERS["dpm_2"](d, x, sigmas, ts)
    mids = schedule.sigma_to_t(np.sqrt(sigmas[:3] * sigmas[1:4]))
    np.testing.assert_allclose(calls, [ts[0], mids[0], ts[1], mids[1], ts[2], mids[2], ts[3]], rtol=1e-12)


def test_eta_zero_gives_the_deterministic_samplers():
    schedule = DDPMSchedule()
    d = Denoiser(lambda x, tt: (x * 0.7).tanh(), schedule)
    for stochastic, ode in ODE_OF.items():
        sigmas, ts = TABLE_OF[stochastic](schedule, 6, "karras")
        x = flame.ones(1, 4, 2, 2) * float(sigmas[0])
        a = SAMPLERS[stochastic](d, x, sigmas, ts, eta=0.0, generator=flame.Generator().manual_seed(1))
        np.testing.assert_array_equal(a.numpy(), SAMPLERS[ode](d, x, sigmas, ts).numpy())


@pytest.mark.parametrize("sampler", ["dpm_2_ancestral", "dpmpp_2m_sde", "lcm"])
def test_stochastic_samplers_with_a_generator_are_seeded(sampler):
    schedule = DDPMSchedule()
    sigmas, ts = TABLE_OF[sampler](schedule, 5)
    d = Denoiser(lambda x, tt: x * 0.5, schedule)
    x = flame.ones(1, 4, 2, 2) * float(sigmas[0])
    a, b, c = (SAMPLERS[sampler](d, x, sigmas, ts, generator=flame.Generator().manual_seed(s)) for s in (3, 3, 4))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.abs(a.numpy() - c.numpy()).max() > 1e-3


def test_sampler_lists_agree():
    assert tuple(SAMPLERS) == pipeline.SAMPLERS
    assert set(SAMPLER_NAMES) == set(SAMPLERS)
    assert set(STOCHASTIC) == {"euler_ancestral", "dpm_2_ancestral", "dpmpp_2m_sde", "ddim"}
    assert set(DRAWS_NOISE) == set(STOCHASTIC) | {"lcm", "ddpm"}


def test_unipc_calls_the_model_once_a_step_and_its_corrector_acts():
    """UniPC: one model call per step (the corrector reuses the next step's output); its second-order steps differ
    from DPM-Solver++(2M)'s on the same table; one step is the first call's x0."""
    schedule = DDPMSchedule()
    sigmas, ts = dpm_sigmas(schedule, 5, "karras")
    calls = []

    def model(x_in, tt):
        calls.append(tt)
        return (x_in * 0.7).tanh()
    d = Denoiser(model, schedule)
    x = flame.ones(1, 4, 2, 2) * float(sigmas[0])
    u = SAMPLERS["unipc"](d, x, sigmas, ts)
    np.testing.assert_array_equal(calls, ts)
    assert np.abs(u.numpy() - SAMPLERS["dpmpp_2m"](d, x, sigmas, ts).numpy()).max() > 1e-4
    s1, t1 = dpm_sigmas(schedule, 1)
    np.testing.assert_allclose(SAMPLERS["unipc"](d, x, s1, t1).numpy(), d(x, float(s1[0]), float(t1[0])).numpy(),
                               rtol=1e-6)


def test_lcm_table_and_its_limits():
    """LCM's table: `steps` of the 50 distillation timesteps 19, 39, ..., 999 at evenly spaced indices, σ 0 last; one
    step is the consistency output at t = 999; more steps than the distillation schedule's, no timesteps, or
    another schedule are refused."""
    schedule = DDPMSchedule()
    sigmas, ts = lcm_sigmas(schedule, 1)
    assert ts.tolist() == [999.0] and sigmas[-1] == 0.0
    assert lcm_sigmas(schedule, 50)[1].tolist() == list(range(999, 0, -20))
    # diffusers' LCMScheduler.set_timesteps(8, original_inference_steps=25) (diffusers 0.42.1)
    assert lcm_sigmas(schedule, 8, original_steps=25)[1].tolist() == [999, 879, 759, 639, 519, 399, 279, 159]
    with pytest.raises(ValueError, match="steps must be in \\[1, original_steps = 50\\]"):
        lcm_sigmas(schedule, 51)
    d = Denoiser(lambda x, tt: x * 0.5, schedule)
    with pytest.raises(ValueError, match="needs the table's timesteps"):
        SAMPLERS["lcm"](d, flame.ones(1, 4, 2, 2), sigmas, None)


# ----------------------------------------------------------------------------- guided sampling with the UNet
@pytest.fixture(scope="module")
def unet():
    return load_unet(DIFFUSERS_DIR, dtype=flame.float32, progress=False)


@pytest.mark.parametrize("name, sampler", [("guided_heun", "heun"), ("guided_dpm_2", "dpm_2")])
def test_sample_matches_diffusers(unet, name, sampler):
    """sample() with the tiny UNet and CFG equals diffusers' scheduler loop: heun (leading, ε, initial noise
    √(σ_max² + 1)), dpm_2 (trailing Karras, v, initial noise σ_max)."""
    ref, meta = fixtures()
    g = meta["guided"][name]
    spacing = g["config"].get("timestep_spacing", "leading")
    tio = io()
    z = sample(unet, t(tio["context"]), t(tio["y"]), t(tio["guided_neg_context"]), t(tio["guided_neg_y"]),
               height=128, width=128, steps=g["steps"], cfg=g["cfg"], sampler=sampler,
               scheduler="karras" if g["config"].get("use_karras_sigmas") else "normal",
               prediction_type=g["prediction_type"], timestep_spacing=spacing, noise=t(tio["guided_noise"]),
               progress=False)
    # dpm_2: diffusers takes the midpoints' fractional timesteps from its float32 sigmas, ~1e-4 off ours (float64;
    # test_tables_match_diffusers' atol), and the tiny random UNet's time embedding (up to 1 rad per timestep) makes
    # that 6e-5 of the result; given diffusers' midpoint timesteps we agree to 6e-6
    assert_close(z, ref[name], 1e-4 if sampler == "dpm_2" else 2e-5, name)


@pytest.mark.parametrize("sampler", ["heun", "dpm_2", "dpm_2_ancestral", "dpmpp_2m_sde", "unipc"])
def test_sample_runs_each_new_sampler(unet, sampler):
    tio = io()
    ctx, y = t(tio["context"]), t(tio["y"])
    kw = dict(height=64, width=64, steps=3, sampler=sampler, progress=False)
    a = sample(unet, ctx, y, seed=5, **kw)
    b = sample(unet, ctx, y, seed=5, **kw)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.shape == (2, 4, 8, 8) and a.dtype == flame.float32 and np.isfinite(a.numpy()).all()
    c = sample(unet, ctx, y, seed=5, scheduler="karras", **kw)
    assert np.isfinite(c.numpy()).all() and np.abs(a.numpy() - c.numpy()).max() > 1e-4
    if sampler in STOCHASTIC:
        # the step noise comes from seed + 1: the same initial noise with another seed changes the result, and
        # eta 0 is the deterministic sampler
        noise = pipeline.get_noise(2, 64, 64, 5, unet.device)
        d = sample(unet, ctx, y, seed=7, noise=noise, **kw)
        assert np.abs(a.numpy() - d.numpy()).max() > 1e-4
        ode = sample(unet, ctx, y, seed=5, **dict(kw, sampler=ODE_OF[sampler]))
        np.testing.assert_array_equal(sample(unet, ctx, y, seed=5, eta=0.0, **kw).numpy(), ode.numpy())


def test_sample_runs_lcm(unet):
    """sampler='lcm' through sample(): seeded (initial noise from seed, step noise from seed + 1), one step is the
    consistency output of the first call alone (no noise drawn), karras and eta refused (its own timesteps, no eta)."""
    tio = io()
    ctx, y = t(tio["context"]), t(tio["y"])
    kw = dict(height=64, width=64, steps=4, sampler="lcm", cfg=1.5, progress=False)
    a = sample(unet, ctx, y, seed=5, **kw)
    np.testing.assert_array_equal(a.numpy(), sample(unet, ctx, y, seed=5, **kw).numpy())
    assert a.shape == (2, 4, 8, 8) and np.isfinite(a.numpy()).all()
    noise = pipeline.get_noise(2, 64, 64, 5, unet.device)
    assert np.abs(a.numpy() - sample(unet, ctx, y, seed=7, noise=noise, **kw).numpy()).max() > 1e-4
    one = dict(kw, steps=1)
    np.testing.assert_array_equal(sample(unet, ctx, y, seed=7, noise=noise, **one).numpy(),
                                  sample(unet, ctx, y, seed=8, noise=noise, **one).numpy())
    with pytest.raises(ValueError, match="lcm walks its own timesteps"):
        sample(unet, ctx, y, seed=5, scheduler="karras", **kw)
    with pytest.raises(ValueError, match="eta applies to .*, not lcm"):
        sample(unet, ctx, y, seed=5, eta=0.5, **kw)


@pytest.mark.parametrize("sampler", ["dpm_2_ancestral", "dpmpp_2m_sde", "lcm"])
def test_pipeline_seeds_are_per_image(unet, sampler):
    """The new stochastic samplers draw each image's step noise from its own seed, as euler_ancestral does."""
    tio = io()
    cond = {"prompt_embeds": tio["context"], "pooled_prompt_embeds": tio["pooled"]}
    kw = dict(height=32, width=64, steps=2, cfg=3.0, sampler=sampler,
              scheduler="normal" if sampler == "lcm" else "karras")
    both = pipeline.sample_latents(unet, cond, seeds=[5, 6], **kw).numpy()
    alone = pipeline.sample_latents(unet, cond, seeds=[6], rows=[1], **kw).numpy()
    np.testing.assert_allclose(both[1:], alone, rtol=1e-5, atol=1e-5)
    assert not np.allclose(both[0], both[1])


def test_sample_rejects_options_that_do_not_apply(unet):
    tio = io()
    ctx, y = t(tio["context"]), t(tio["y"])
    kw = dict(height=64, width=64, steps=2, progress=False)
    for sampler in ("heun", "dpm_2"):
        with pytest.raises(ValueError, match=f"eta applies to .*, not {sampler}"):
            sample(unet, ctx, y, sampler=sampler, eta=0.5, **kw)
    with pytest.raises(ValueError, match="unknown sampler"):
        sample(unet, ctx, y, sampler="dpmpp_3m_sde", **kw)
    with pytest.raises(ValueError, match="scheduler"):
        sample(unet, ctx, y, sampler="heun", scheduler="exponential", **kw)
    with pytest.raises(ValueError, match="sampler"):
        pipeline.sample_latents(unet, {}, height=64, width=64, steps=2, cfg=1.0, sampler="dpmpp_sde", seeds=[0])
