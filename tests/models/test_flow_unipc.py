"""UniPC for the flow-matching families (flame_models/samplers/flow.py, sampler="unipc"): every step against
diffusers' UniPCMultistepScheduler as a flow sampler on a fixed velocity model, along the SD3 / Flux sigma tables,
that table from below 1 and the scheduler's own flow sigmas (tests/fixtures/make_flow_sampler_fixtures.py); through
the step function alone and through SD3's and Flux's denoising loops (Flux's with its CUDA graphs on a
GPU: the three history tensors are graph inputs and outputs) and the coefficient table's rules. The previews and
generate's option: tests/training/test_flow_family_heun.py."""
import math

import numpy as np
import pytest
from flow_cases import ARRAYS, META, cases, check_loops, noise, velocity
from sd3_helpers import npy

import flame_core as flame
from flame_models.samplers.flow import flow_step, multistep_state, step_coefficients, unipc_coefficients

CASES = cases("UniPCMultistepScheduler")


def _tolerance(ref, sigmas):
    # float32 steps; the corrector's and predictor's weights combined in float64 then rounded (diffusers combines
    # its float32 terms in another order)
    return 4e-6 * max(1.0, float(np.abs(ref).max())) * (1 + 1e-3 / sigmas[-2])


def test_the_fixture_has_the_cases():
    assert len(CASES) == 9
    assert {META[c]["table"] for c in CASES} == {"euler", "below1", "own"}


@pytest.mark.parametrize("case", CASES)
def test_every_step_matches_diffusers(case, device):
    m = META[case]
    sigmas, steps = m["sigmas"], m["steps"]
    ref = ARRAYS[f"{case}.trajectory"].numpy()
    assert len(sigmas) == steps + 1 and sigmas[-1] == 0.0 and len(ref) == steps
    timesteps = m["timesteps"]
    step = flow_step(velocity(device), "unipc")
    x = noise(device)
    state = multistep_state("unipc", x)
    assert len(state) == 3
    atol = _tolerance(ref, sigmas)
    with flame.no_grad():
        for i in range(steps):
            t = flame.full((1,), float(np.float32(timesteps[i])), device=device)   # the scheduler's own timesteps
            c = flame.tensor(unipc_coefficients(sigmas, i), dtype=flame.float32, device=device)
            x, *state = step(x, t, None, None, *state, c)
            np.testing.assert_allclose(npy(x), ref[i], rtol=0, atol=atol, err_msg=f"{case}, step {i}")


@pytest.mark.parametrize("case", ["unipc_shift3_5_euler", "unipc_shift1_10_euler"])
def test_sd3_and_flux_loops_match_diffusers(case, device):
    m = META[case]
    check_loops(case, device, "unipc", _tolerance(ARRAYS[f"{case}.trajectory"].numpy(), m["sigmas"]), "dpmpp_2m")


def test_the_coefficients():
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    s, k0, k1, k2, k3, k4, p0, p1, p2 = unipc_coefficients(sig, 0)
    # step 0: no correction; from s = 1 (alpha 0, lambda -inf) the predictor is Euler's step in m's terms
    assert (s, k0, k1, k2, k3, k4) == (1.0, 1.0, 0.0, 0.0, 0.0, 0.0) and (p0, p1, p2) == (0.75, 0.25, 0.0)
    # step 1: an order-1 corrector (the first predictor's order) over an infinite interval (phi = B = -1), alpha =
    # 1 - 0.75: x_c = (s / s_prev) last + alpha m_prev - alpha (m - m_prev) / 2
    c = unipc_coefficients(sig, 1)
    assert c[1:6] == pytest.approx((0.0, 0.75, 0.25 - 0.125, 0.0, 0.125))
    assert c[8] == 0.0                                 # the predictor's difference weighs 0 after s = 1
    # step 2: the corrector at order 2 (step 1's predictor); its r1 is infinite: rho_1's term is 0
    c = unipc_coefficients(sig, 2)
    assert c[4] == 0.0 and c[8] != 0.0 and all(math.isfinite(v) for v in c)
    assert unipc_coefficients(sig, 3)[6:] == (0.0, 1.0, 0.0)             # into 0: x' = m
    # the higher-order terms are differences of data predictions: with m, m_prev and m_prev2 equal, the corrector
    # and the predictor are the first-order exponential step, whose m weight is alpha (1 - e^-h) = -alpha phi
    table = [0.9, 0.7, 0.4, 0.2, 0.0]
    lam = [math.log((1 - v) / v) for v in table[:-1]]
    for i in range(1, 4):
        s, k0, k1, k2, k3, k4, p0, p1, p2 = unipc_coefficients(table, i)
        assert k0 == 0.0 and k1 == pytest.approx(table[i] / table[i - 1])
        assert k2 + k3 + k4 == pytest.approx(-(1 - s) * math.expm1(-(lam[i] - lam[i - 1])))
        if table[i + 1] > 0:
            assert p0 == pytest.approx(table[i + 1] / s)
            assert p1 + p2 == pytest.approx(-(1 - table[i + 1]) * math.expm1(-(lam[i + 1] - lam[i])))
    assert unipc_coefficients(table, 2)[4] != 0.0                        # (order 2: a finite r1 weighs in)
    with pytest.raises(ValueError, match="decreasing to 0; step 1 goes from 0.5 to 0.5"):
        unipc_coefficients([1.0, 0.5, 0.5, 0.0], 2)
    with pytest.raises(IndexError, match="step 4 of a table of 4 steps"):
        unipc_coefficients(sig, 4)
    assert step_coefficients("unipc", sig, 2) == unipc_coefficients(sig, 2)

