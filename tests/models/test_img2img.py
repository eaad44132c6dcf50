"""Image-to-image (flame_models/samplers/img2img.py) against diffusers' img2img pipelines' scheduler use
(tests/fixtures/make_img2img_fixtures.py): the steps skipped at a strength, the noised start, and the last sample of
every sampler run on the remaining table -- the flow samplers through SD3's and Flux's denoising loops, SDXL's
through flame_models.samplers -- and the families' sample_latents with init_latents."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from flow_cases import FluxLike, SD3Like

import flame_core as flame
from flame_core.io import load_file
from flame_models.samplers import SAMPLERS, DDPMSchedule, Denoiser, ddim_sigmas, dpm_sigmas, get_sigmas, kdpm2_sigmas
from flame_models.samplers.img2img import check_strength, flow_start, skipped_steps, ve_start

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "img2img"
META = json.loads((FIXTURES / "img2img.json").read_text())["cases"]
ARRAYS = {k: v.numpy() for k, v in load_file(str(FIXTURES / "img2img.safetensors")).items()}
FLOW = sorted(k for k, m in META.items() if m["family"] == "flow")
SDXL = sorted(k for k, m in META.items() if m["family"] == "sdxl")


def _t(a, device):
    return flame.tensor(np.asarray(a, np.float32), device=device)


def test_skipped_steps_round_as_the_pipelines_do():
    for name, m in META.items():
        assert skipped_steps(m["steps"], m["strength"], m["family"]) == m["t_start"], name
    assert skipped_steps(10, 0.55, "flow") == 4 and skipped_steps(10, 0.55, "sdxl") == 5   # ceil-like / floor
    assert skipped_steps(4, 0.1, "flow") == 3          # the flow pipelines always run one step
    with pytest.raises(ValueError, match=r"strength 0.1 of 4 steps runs no step.*at least 10 steps"):
        skipped_steps(4, 0.1, "sdxl")
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), "0.5", None, True):
        with pytest.raises(ValueError, match="strength"):
            check_strength(bad)


def _stand_in(cls, device):
    model = cls(device)
    model.pattern = _t(ARRAYS["pattern"], device)
    return model


@pytest.mark.parametrize("name", FLOW)
def test_flow_img2img_matches_diffusers(name, device):
    """flow_start's noised latents are diffusers' scale_noise / add_noise at the first remaining sigma; SD3's and
    Flux's denoising loops on the remaining table end where the scheduler ends (its history started fresh)."""
    from flame_models.bfl import sampling as bfl
    from flame_models.sd3.sampling import denoise
    m = META[name]
    sigmas = ARRAYS[f"{name}.sigmas"].astype(np.float64)
    rest, x = flow_start(sigmas, _t(ARRAYS["init"], device), _t(ARRAYS["noise"], device), m["strength"])
    assert len(rest) == m["steps"] - m["t_start"] + 1
    np.testing.assert_allclose(x.numpy(), ARRAYS[f"{name}.start"], rtol=0, atol=1e-6)
    out = denoise(_stand_in(SD3Like, device), x, rest, flame.zeros(1, 2, 3, device=device),
                  flame.zeros(1, 3, device=device), sampler=m["sampler"])
    np.testing.assert_allclose(out.float().numpy(), ARRAYS[f"{name}.out"], rtol=0, atol=3e-5)
    seen = []
    out = bfl.denoise(_stand_in(FluxLike, device), x, None, None, None, None, rest, None, sampler=m["sampler"],
                      callback=lambda i, n: seen.append((i, n)))
    np.testing.assert_allclose(out.float().numpy(), ARRAYS[f"{name}.out"], rtol=0, atol=3e-5)
    assert seen == [(i, len(rest) - 1) for i in range(1, len(rest))]


SDXL_SAMPLER = {"EulerDiscreteScheduler": ("euler", get_sigmas), "HeunDiscreteScheduler": ("heun", get_sigmas),
                "KDPM2DiscreteScheduler": ("dpm_2", kdpm2_sigmas),
                "DPMSolverMultistepScheduler": ("dpmpp_2m", dpm_sigmas),
                "UniPCMultistepScheduler": ("unipc", dpm_sigmas), "DDIMScheduler": ("ddim", None)}
VP = ("dpmpp_2m", "unipc", "ddim")   # the schedulers that keep VP samples: x_ve / sqrt(sigma^2 + 1)


@pytest.mark.parametrize("name", SDXL)
def test_sdxl_img2img_matches_diffusers(name, device):
    """ve_start's x0 + σ·noise is the scheduler's add_noise in its space; each sampler on the remaining table ends on
    the scheduler's last sample."""
    m = META[name]
    cfg = m["config"]
    sampler, table = SDXL_SAMPLER[m["scheduler"]]
    schedule = DDPMSchedule()
    if sampler == "ddim":
        sigmas, ts = ddim_sigmas(schedule, m["steps"], cfg["timestep_spacing"], cfg["steps_offset"])
    else:
        sigmas, ts = table(schedule, m["steps"], "karras" if cfg.get("use_karras_sigmas") else "normal",
                           cfg["timestep_spacing"], cfg["steps_offset"])
    rest, rest_ts, x = ve_start(sigmas, _t(ARRAYS["init"], device), _t(ARRAYS["noise"], device), m["strength"], ts)
    assert len(rest) == len(rest_ts) + 1 == m["steps"] - m["t_start"] + 1
    s0 = float(rest[0])
    scale = 1.0 / math.sqrt(s0 * s0 + 1.0) if sampler in VP else 1.0
    np.testing.assert_allclose(x.numpy() * scale, ARRAYS[f"{name}.start"], rtol=0, atol=2e-5)
    p = _t(ARRAYS["pattern"], device)
    denoiser = Denoiser(lambda x_in, tt: (x_in * 0.8).tanh() + p * (float(tt) / 1000.0), schedule,
                        cfg["prediction_type"])
    out = SAMPLERS[sampler](denoiser, x, rest, rest_ts)
    s_last = float(rest[-1])
    out = out * (1.0 / math.sqrt(s_last * s_last + 1.0))   # (DDIM ends at ᾱ_0: its VP sample; else σ = 0)
    np.testing.assert_allclose(out.numpy(), ARRAYS[f"{name}.out"], rtol=0, atol=5e-5)
