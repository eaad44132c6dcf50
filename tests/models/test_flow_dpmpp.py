"""DPM++ 2M for the flow-matching families (flame_models/samplers/flow.py, sampler="dpmpp_2m"): every step against
diffusers' DPMSolverMultistepScheduler as a flow sampler on a fixed velocity model along the SD3 / Flux sigma tables
(tests/fixtures/make_flow_sampler_fixtures.py), through the step function alone and through SD3's and Flux's
denoising loops (Flux's with its CUDA graphs on a GPU: the history is a graph input and output), the coefficient
table's rules, and the option on generate and the previews."""
import numpy as np
import pytest
from flow_cases import ARRAYS, META, cases, check_loops, noise, velocity
from sd3_helpers import npy

import flame_core as flame
from flame_models.samplers.flow import FLOW_SAMPLERS, MULTISTEP, dpmpp_2m_coefficients, flow_step, step_kind

CASES = cases("DPMSolverMultistepScheduler")


def _tolerance(ref, sigmas):
    # float32 steps of a smooth field; the data prediction x - s v and the step's ratios round a little more than
    # Euler's step (the fixture's own float32 arithmetic differs in order from FLAME's coefficients in float64)
    return 2e-6 * max(1.0, float(np.abs(ref).max())) * (1 + 1e-3 / sigmas[-2])


def test_the_fixture_has_the_cases():
    assert len(CASES) == 6
    assert {META[c]["steps"] for c in CASES} == {1, 2, 5, 10, 20, 6}


@pytest.mark.parametrize("case", CASES)
def test_every_step_matches_diffusers(case, device):
    m = META[case]
    sigmas, steps = m["sigmas"], m["steps"]
    ref = ARRAYS[f"{case}.trajectory"].numpy()
    assert len(sigmas) == steps + 1 and sigmas[-1] == 0.0 and len(ref) == steps
    step = flow_step(velocity(device), "dpmpp_2m")
    x = noise(device)
    m_prev = flame.zeros_like(x)
    atol = _tolerance(ref, sigmas)
    with flame.no_grad():
        for i in range(steps):
            t = flame.full((1,), float(np.float32(sigmas[i]) * np.float32(1000)), device=device)
            c = flame.tensor(dpmpp_2m_coefficients(sigmas, i), dtype=flame.float32, device=device)
            x, m_prev = step(x, t, None, None, m_prev, c)
            np.testing.assert_allclose(npy(x), ref[i], rtol=0, atol=atol, err_msg=f"{case}, step {i}")


@pytest.mark.parametrize("case", ["dpmpp_2m_shift3_5", "dpmpp_2m_shift1_10"])
def test_sd3_and_flux_loops_match_diffusers(case, device):
    m = META[case]
    check_loops(case, device, "dpmpp_2m", _tolerance(ARRAYS[f"{case}.trajectory"].numpy(), m["sigmas"]), "euler")


def test_the_coefficients():
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    first = dpmpp_2m_coefficients(sig, 0)
    # from s = 1 (alpha 0): x' = s' x + (1 - s') m, Euler's step in the data prediction's terms
    assert first == (1.0, 0.75, 0.25, 0.0)
    # after s = 1 the previous interval is infinite in lambda: first order again
    assert dpmpp_2m_coefficients(sig, 1)[3] == 0.0
    s, c_x, c_m, c_d = dpmpp_2m_coefficients(sig, 2)
    lam = [np.log((1 - v) / v) for v in (0.75, 0.5, 0.25)]
    h, h_prev = lam[2] - lam[1], lam[1] - lam[0]
    assert s == 0.5 and c_x == pytest.approx(0.5) and c_m == pytest.approx(0.75 * (1 - np.exp(-h)))
    assert c_d == pytest.approx(0.5 * c_m * h / h_prev) and c_d > 0
    assert dpmpp_2m_coefficients(sig, 3) == (0.25, 0.0, 1.0, 0.0)   # into 0: x' = m
    with pytest.raises(ValueError, match="decreasing to 0; step 1 goes from 0.5 to 0.5"):
        dpmpp_2m_coefficients([1.0, 0.5, 0.5, 0.0], 1)
    with pytest.raises(IndexError, match="step 4 of a table of 4 steps"):
        dpmpp_2m_coefficients(sig, 4)


def test_step_kinds_and_names():
    assert FLOW_SAMPLERS == ("euler", "heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc")
    assert MULTISTEP == {"dpmpp_2m", "dpmpp_2m_sde", "unipc"}
    assert [step_kind("dpmpp_2m", i, 3) for i in range(3)] == ["dpmpp_2m"] * 3
    assert [step_kind("heun", i, 3) for i in range(3)] == ["heun", "heun", "euler"]


def test_a_first_order_step_is_eulers(device):
    """x' = (s'/s) x + (1 - s')(1 - e^-h) (x - s v) is x + (s' - s) v with alpha = 1 - s (flow.py's docstring)."""
    rng = np.random.default_rng(3)
    x = flame.tensor(rng.standard_normal((2, 5, 3)).astype(np.float32), device=device)
    v = flame.tensor(rng.standard_normal((2, 5, 3)).astype(np.float32), device=device)
    dpm, euler = flow_step(lambda x, t: v, "dpmpp_2m"), flow_step(lambda x, t: v, "euler")
    for sig in ([0.9, 0.6, 0.0], [1.0, 0.3, 0.0], [0.5, 0.0]):
        for i in range(len(sig) - 1):
            c = dpmpp_2m_coefficients(sig, i)   # (its second-order weight left out: the first-order step)
            got, m = dpm(x, None, None, None, flame.zeros_like(x),
                         flame.tensor((c[0], c[1], c[2], 0.0), dtype=flame.float32, device=device))
            want = euler(x, None, None, flame.full((1,), sig[i + 1] - sig[i], device=device))
            np.testing.assert_allclose(npy(got), npy(want), rtol=0, atol=2e-6)
            np.testing.assert_allclose(npy(m), npy(x - sig[i] * v), rtol=0, atol=1e-6)
