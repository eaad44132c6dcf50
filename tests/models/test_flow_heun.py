"""The flow-matching Heun sampler (flame_models/samplers/flow.py) of SD3 and Flux: its table and every step against
diffusers' FlowMatchHeunDiscreteScheduler on a fixed velocity model (tests/fixtures/make_flow_sampler_fixtures.py;
FlowMatchEulerDiscreteScheduler as a control), SD3's sample() with the tiny MMDiT, Euler unchanged, option errors."""
import numpy as np
import pytest
from flow_cases import ARRAYS, META, noise, sd3_denoise, velocity
from sd3_helpers import diffusers_dir, inputs, io, npy

import flame_core as flame
from flame_models.bfl import sampling as flux_sampling
from flame_models.samplers.flow import FLOW_SAMPLERS, check_flow_sampler, flow_step, step_kind
from flame_models.sd3 import get_sigmas, load_sd3, sample

CASES = sorted(k for k, m in META.items()   # (the multistep ones: test_flow_dpmpp, _dpmpp_sde, _unipc)
               if m["scheduler"] in ("FlowMatchHeunDiscreteScheduler", "FlowMatchEulerDiscreteScheduler"))


@pytest.mark.parametrize("case", CASES)
def test_tables_match_diffusers(case):
    m = META[case]
    sigmas = get_sigmas(m["steps"], m["shift"])
    if m["scheduler"] == "FlowMatchHeunDiscreteScheduler":  # diffusers lists each inner sigma / timestep twice
        want = [sigmas[0], *[s for s in sigmas[1:-1] for _ in range(2)], 0.0]
        times = [1000 * s for s in want[:1] + want[1:-1:2]]
        np.testing.assert_allclose(m["timesteps"][::2], times, rtol=1e-6)
        np.testing.assert_allclose(m["timesteps"][1::2], times[1:], rtol=1e-6)
    else:
        want = sigmas
    np.testing.assert_allclose(m["sigmas"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_every_step_matches_diffusers(case, device):
    """Heun's trajectory holds the Euler prediction, then the corrected sample, per step (the last: Euler alone)."""
    m = META[case]
    kind = "heun" if m["scheduler"] == "FlowMatchHeunDiscreteScheduler" else "euler"
    ref = ARRAYS[f"{case}.trajectory"]
    sigmas, steps = get_sigmas(m["steps"], m["shift"]), m["steps"]
    x, got, v = noise(device), [], velocity(device)

    def t_of(s):
        return flame.full((1,), 1000 * s, dtype=flame.float32, device=device)
    for i in range(steps):
        args = (t_of(sigmas[i]), t_of(sigmas[i + 1]), flame.full((1,), sigmas[i + 1] - sigmas[i], device=device))
        if step_kind(kind, i, steps) == "heun":
            got.append(npy(flow_step(v, "euler")(x, *args)))
        x = flow_step(v, step_kind(kind, i, steps))(x, *args)
        got.append(npy(x))
    assert len(got) == len(ref) == (2 * steps - 1 if kind == "heun" else steps)
    # float32 over a few steps of a smooth field; looser near sigma 0: diffusers' Heun takes its derivative through
    # x0 = x - sigma v and back, (x - x0) / sigma, whose rounding grows as 1 / sigma (x3 at sigma 0.001)
    sigma_min = sigmas[-2]
    atol = 2e-6 * (1 + 2e-3 / sigma_min) * max(1.0, np.abs(ref).max())
    for i, (a, b) in enumerate(zip(got, ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"call {i}")
    # the family's loop (SD3's denoise: timesteps, dt and Heun's last step) ends where diffusers' does
    out = sd3_denoise(device, sigmas, sampler=kind)
    np.testing.assert_allclose(npy(out), ref[-1], rtol=0, atol=atol)


def test_step_kinds():
    assert [step_kind("heun", i, 3) for i in range(3)] == ["heun", "heun", "euler"]
    assert [step_kind("euler", i, 3) for i in range(3)] == ["euler"] * 3
    assert FLOW_SAMPLERS == ("euler", "heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc")
    assert check_flow_sampler("heun") == "heun"


def _sd3(device, **kw):
    arrays = io("plain")
    model = load_sd3(diffusers_dir("plain"), dtype=flame.float32, device=device)
    ctx, y, noise = inputs(arrays, flame.float32, device, ("context", "y", "noise"))
    return model, dict(context=ctx, y=y, height=48, width=80, latents=noise, cfg=1.0, **kw)


def test_sd3_sample_heun_end_to_end(device):
    """Two Heun steps of the tiny MMDiT by hand: a corrected step to sigma_1, then Euler into 0 (3 model calls)."""
    model, args = _sd3(device, steps=2)
    calls = []

    def v(x, s):
        calls.append(s)
        t = flame.full((x.shape[0],), 1000 * s, dtype=flame.float32, device=device)
        return model(x, t, args["y"], args["context"])
    s0, s1, _ = get_sigmas(2)
    x = args["latents"]
    v0 = v(x, s0)
    x = x + (s1 - s0) * (0.5 * (v0 + v(x + (s1 - s0) * v0, s1)))
    x = x + (0 - s1) * v(x, s1)
    out = npy(sample(model, sampler="heun", **args))
    ref = npy(x)
    assert calls == [s0, s1, s1] and out.shape == (2, 16, 6, 10)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    euler = npy(sample(model, **args))
    assert np.abs(euler - out).max() > 1e-3 * np.abs(ref).max()  # a different sampler, not Euler renamed
    np.testing.assert_array_equal(euler, npy(sample(model, sampler="euler", **args)))
    # one step is Euler's step into 0 for both
    np.testing.assert_array_equal(npy(sample(model, **{**args, "steps": 1})),
                                  npy(sample(model, sampler="heun", **{**args, "steps": 1})))


def test_unknown_samplers_are_refused(device):
    model, args = _sd3(device, steps=2)
    with pytest.raises(ValueError, match="unknown flow-matching sampler 'ddim': choose one of euler, heun, dpmpp_2m"):
        sample(model, sampler="ddim", **args)
    with pytest.raises(ValueError, match="unknown flow-matching sampler 'flowmatch'"):
        flux_sampling.denoise(None, None, None, None, None, None, [1.0, 0.0], sampler="flowmatch")
    with pytest.raises(ValueError, match="unknown flow-matching sampler"):
        flow_step(lambda x, t: x, "Heun")
