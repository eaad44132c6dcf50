"""The SDXL `ddpm` sampler (flame_models.samplers.sample_ddpm on schedules.ddim_sigmas with set_alpha_to_one)
against diffusers' DDPMScheduler (tests/fixtures/make_ddpm_sampler_fixtures.py): its table and every step on the
fixed denoiser with the reference's noise draws replayed (DDPM keeps VP samples: compared after scaling), through
flame_models.sdxl.sample too, and as ai-toolkit's SDXL preview sampler name."""
import json
import math
import os

import numpy as np
import pytest
from sdxl_fixtures import FIXTURES, assert_close, fixed_model, t

from flame_core.io import load_file
from flame_models.samplers import DRAWS_NOISE, SAMPLERS, STOCHASTIC, DDPMSchedule, Denoiser, ddim_sigmas


def fixtures():
    tensors = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "sampler_ddpm.safetensors")).items()}
    with open(os.path.join(FIXTURES, "sampler_ddpm.json")) as f:
        return tensors, json.load(f)


CASES = sorted(fixtures()[1])


@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_ddpmscheduler(name):
    ref, meta = fixtures()
    cfg = meta[name]["config"]
    sigmas, ts = ddim_sigmas(DDPMSchedule(), meta[name]["steps"], cfg["timestep_spacing"], cfg["steps_offset"],
                             set_alpha_to_one=True)
    np.testing.assert_array_equal(ts, ref[f"{name}.timesteps"])
    assert sigmas[-1] == 0.0   # the last step goes to x0
    scale = [math.sqrt(float(s) ** 2 + 1.0) for s in sigmas]   # VE sample = VP sample * sqrt(sigma^2 + 1)
    traj, draws = ref[f"{name}.trajectory"], ref[f"{name}.noise_draws"]
    states = []
    denoiser = Denoiser(fixed_model(ref["pattern"]), DDPMSchedule(), cfg["prediction_type"])
    SAMPLERS["ddpm"](denoiser, t(traj[0] * scale[0]), sigmas, ts, noise=lambda i, x: t(draws[i]),
                     callback=lambda i, x, x0, s: states.append(x.numpy()))
    assert len(states) == meta[name]["steps"]
    for i, got in enumerate(states):
        assert_close(got / scale[i + 1], traj[i + 1], 2e-5, f"{name} step {i}")


def test_ddpm_takes_no_eta_and_draws_noise():
    assert "ddpm" in DRAWS_NOISE and "ddpm" not in STOCHASTIC
    from flame_models.sdxl import pipeline
    assert "ddpm" in pipeline.SAMPLERS


def test_ai_toolkits_sdxl_preview_sampler_is_accepted():
    from flame_models.training.config import config_from_dict
    cfg = config_from_dict({"model": {"arch": "sdxl"}, "synthetic": {}, "train": {"noise_scheduler": "ddpm"},
                            "sample": {"sampler": "ddpm"}}, check_files=False)
    assert cfg.sample.sampler == "ddpm"


def test_sample_with_ddpm_is_seeded_and_refuses_eta_and_karras():
    from sdxl_fixtures import DIFFUSERS_DIR, io

    import flame_core as flame
    from flame_models.sdxl import load_unet, sample
    unet = load_unet(DIFFUSERS_DIR, dtype=flame.float32, progress=False)
    tio = io()
    ctx, y = t(tio["context"]), t(tio["y"])
    kw = dict(height=64, width=64, steps=3, sampler="ddpm", progress=False)
    a, b = sample(unet, ctx, y, seed=5, **kw), sample(unet, ctx, y, seed=5, **kw)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.isfinite(a.numpy()).all() and np.abs(a.numpy() - sample(unet, ctx, y, seed=6, **kw).numpy()).max() > 0
    ddim = sample(unet, ctx, y, seed=5, **{**kw, "sampler": "ddim"}).numpy()
    assert np.abs(a.numpy() - ddim).max() > 1e-3          # its step noise and its last step to x0
    with pytest.raises(ValueError, match="eta applies to"):
        sample(unet, ctx, y, seed=5, eta=0.5, **kw)
    with pytest.raises(ValueError, match="walks its own timesteps"):
        sample(unet, ctx, y, seed=5, scheduler="karras", **kw)
