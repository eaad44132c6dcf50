"""The flow-matching schedulers (flame_models/samplers/flow_schedules.py): simple / karras / exponential / beta
tables of SD3, Flux-dev and Qwen-Image against diffusers 0.42.1's FlowMatchEulerDiscreteScheduler, the Beta quantile
against SciPy (tests/fixtures/make_flow_schedule_fixtures.py), the samplers walking the respaced tables, and the
errors."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from sd3_helpers import diffusers_dir, inputs, io, npy

import flame_core as flame
from flame_models.bfl.sampling import get_schedule
from flame_models.qwen_image import sampling as qwen_sampling
from flame_models.samplers.flow_schedules import FLOW_SCHEDULERS, beta_cdf, beta_ppf, check_flow_scheduler, respace
from flame_models.sd3 import get_sigmas, load_sd3, sample
from flame_models.sd3.sampling import denoise

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "flow_schedules" /
                      "flow_schedules.json").read_text())
CASES = sorted(FIXTURE["cases"])


def _family_table(case):
    c = FIXTURE["cases"][case]
    n = c["steps"]
    if c["family"] == "sd3":
        return get_sigmas(n, 3.0)
    if c["family"] == "flux":
        return get_schedule(n, c["tokens"], shift=True)
    return [float(s) for s in qwen_sampling.sigmas(n, c["tokens"])]


def test_the_fixture_covers_every_scheduler_and_family():
    assert {FIXTURE["cases"][c]["schedule"] for c in CASES} == set(FLOW_SCHEDULERS)
    assert {FIXTURE["cases"][c]["family"] for c in CASES} == {"sd3", "flux", "qwen_image"}


@pytest.mark.parametrize("case", CASES)
def test_tables_match_diffusers(case):
    c = FIXTURE["cases"][case]
    got = respace(_family_table(case), c["schedule"])
    assert len(got) == c["steps"] + 1 and got[-1] == 0.0
    # diffusers' tables are float32
    np.testing.assert_allclose(got, c["sigmas"], rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose([1000 * s for s in got[:-1]], c["timesteps"], rtol=1e-6, atol=2e-4)
    if c["schedule"] != "simple" and c["steps"] > 2:   # a new spacing, between the same end points
        base = _family_table(case)
        assert got[0] == base[0] and got[-2] == pytest.approx(base[-2], rel=1e-12)
        assert max(abs(a - b) for a, b in zip(got, base)) > 1e-3


def test_beta_quantiles_match_scipy():
    for a, b, p, ppf, cdf in FIXTURE["beta"]:
        x = beta_ppf(p, a, b)
        assert abs(x - ppf) <= 1e-12 or (p > 1 - 1e-6 and abs(x - ppf) <= 1e-9), (a, b, p, x, ppf)
        assert beta_cdf(p, a, b) == pytest.approx(cdf, rel=1e-13, abs=1e-15)
        if 0 < p < 1 - 1e-6:   # (beyond, x sits within a few ulps of 1, where the CDF moves by more than p's gap)
            assert beta_cdf(x, a, b) == pytest.approx(p, rel=1e-12, abs=1e-15)


def test_the_spacings():
    base = get_sigmas(8, 3.0)
    hi, lo = base[0], base[-2]
    karras, expo, beta = (respace(base, s) for s in ("karras", "exponential", "beta"))
    # exponential: a constant ratio between neighbours; karras: constant steps in sigma^(1/7)
    ratios = [a / b for a, b in zip(expo[:-2], expo[1:-1])]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    roots = np.diff([s ** (1 / 7) for s in karras[:-1]])
    np.testing.assert_allclose(roots, roots[0], rtol=1e-10)
    # beta(0.6, 0.6) puts more steps at both ends than in the middle
    gaps = np.diff(beta[:-1])
    assert abs(gaps[0]) < abs(gaps[3]) and abs(gaps[-1]) < abs(gaps[3])
    for table in (karras, expo, beta):
        assert table[0] == hi and table[-2] == pytest.approx(lo) and table[-1] == 0.0
    assert respace([1.0, 0.0], "beta") == [1.0, 0.0] == respace([1.0, 0.0], "karras")
    assert respace(base, "simple") == base


def test_bad_tables_and_names_are_refused():
    with pytest.raises(ValueError, match="unknown flow-matching scheduler 'sgm_uniform': choose one of simple, "
                                         "karras, exponential, beta"):
        check_flow_scheduler("sgm_uniform")
    with pytest.raises(ValueError, match="sigmas decreasing to 0"):
        respace([1.0, 0.5, 0.6, 0.0], "karras")
    with pytest.raises(ValueError, match="sigmas decreasing to 0"):
        respace([1.0, 0.5], "beta")
    with pytest.raises(ValueError, match=r"a probability in \[0, 1\]"):
        beta_ppf(1.5, 0.6, 0.6)
    assert math.isclose(beta_ppf(0.5, 0.6, 0.6), 0.5, abs_tol=1e-14)   # symmetric


def test_sd3_samples_along_the_respaced_table(device):
    """sample(scheduler=...) is denoise along respace(get_sigmas(...)); another image than "simple"'s; an unknown
    scheduler is refused before any model call."""
    arrays = io("plain")
    model = load_sd3(diffusers_dir("plain"), dtype=flame.float32, device=device)
    ctx, y, noise = inputs(arrays, flame.float32, device, ("context", "y", "noise"))
    args = dict(height=48, width=80, steps=4, cfg=1.0, latents=noise)
    got = npy(sample(model, ctx, y, scheduler="beta", sampler="dpmpp_2m", **args))
    want = npy(denoise(model, noise, respace(get_sigmas(4), "beta"), ctx, y, sampler="dpmpp_2m"))
    np.testing.assert_array_equal(got, want)
    simple = npy(sample(model, ctx, y, sampler="dpmpp_2m", **args))
    assert np.abs(simple - got).max() > 1e-4
    with pytest.raises(ValueError, match="unknown flow-matching scheduler 'normal'"):
        sample(model, ctx, y, scheduler="normal", **args)
