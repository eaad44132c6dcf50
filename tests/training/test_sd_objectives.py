"""The objectives the SD3 and SDXL families train with, against float64 NumPy written from the formulas: SDXL's DDPM
(scaled-linear schedule, ε / v targets, min-SNR-γ weights, zero-terminal SNR, the timestep range, noise offset) and
SD3's loss weightings (diffusers' compute_loss_weighting_for_sd3) and 'mode' timestep density."""
import math

import numpy as np
import pytest

import flame_core as flame
from flame_models.training import objective as O
from flame_models.training.ddpm_objective import DDPM
from flame_models.training.timesteps import sample_sigmas


def _abar(zero_terminal_snr=False):
    betas = np.linspace(math.sqrt(0.00085), math.sqrt(0.012), 1000) ** 2
    abar = np.cumprod(1.0 - betas)
    if zero_terminal_snr:  # Lin et al. 2023, Algorithm 1: sqrt(abar) shifted to end at 0, scaled to keep its start
        s = np.sqrt(abar)
        s = (s - s[-1]) * s[0] / (s[0] - s[-1])
        abar = s ** 2
    return abar


def _t(a, device=None):
    return flame.tensor(np.asarray(a, np.float32), device=device)


def _per_sample_mse(pred, target):
    return ((pred.astype(np.float64) - target) ** 2).reshape(len(pred), -1).mean(axis=1)


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_ddpm_noising_and_both_targets(zero_terminal_snr, device, rng):
    x0, eps = rng.standard_normal((3, 4, 4, 6)), rng.standard_normal((3, 4, 4, 6))
    t = np.array([0.0, 417.0, 999.0])
    abar = _abar(zero_terminal_snr)[t.astype(int)].reshape(-1, 1, 1, 1)
    for pred_type in ("epsilon", "v_prediction"):
        obj = DDPM(pred_type, zero_terminal_snr=zero_terminal_snr)
        xt = obj.noisy(_t(x0, device), _t(eps, device), _t(t, device)).numpy()
        np.testing.assert_allclose(xt, np.sqrt(abar) * x0 + np.sqrt(1 - abar) * eps, rtol=1e-5, atol=1e-5)
        target = obj.target(_t(x0, device), _t(eps, device), _t(t, device)).numpy()
        want = eps if pred_type == "epsilon" else np.sqrt(abar) * eps - np.sqrt(1 - abar) * x0
        np.testing.assert_allclose(target, want, rtol=1e-5, atol=1e-5)
    if zero_terminal_snr:  # the last step is pure noise, and v there is -x0
        assert obj.schedule.alphas_cumprod[-1] < 1e-20
        np.testing.assert_allclose(xt[2], eps[2], atol=1e-6)
        np.testing.assert_allclose(target[2], -x0[2], atol=1e-6)
    # the first ᾱ is the plain schedule's either way
    assert obj.schedule.alphas_cumprod[0] == pytest.approx(1 - 0.00085, rel=1e-12)


def test_ddpm_timesteps_are_integers_in_the_range_and_reproducible():
    obj = DDPM(min_timestep=200, max_timestep=700)
    draws = [obj.sample_timesteps(4000, generator=flame.Generator("cpu").manual_seed(s)).numpy() for s in (1, 1, 2)]
    t = draws[0]
    assert t.dtype == np.float32 and np.all(t == np.round(t)) and t.min() >= 200 and t.max() <= 699
    assert t.min() == 200 and t.max() == 699                             # both ends reached in 4000 draws
    assert abs(t.mean() - 449.5) < 10                                    # uniform over [200, 700)
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    one = DDPM(min_timestep=5, max_timestep=6).sample_timesteps(3, generator=flame.Generator("cpu").manual_seed(0))
    np.testing.assert_array_equal(one.numpy(), [5, 5, 5])
    with pytest.raises(ValueError, match=r"0 <= min_timestep < max_timestep <= 1000"):
        DDPM(min_timestep=10, max_timestep=10)


@pytest.mark.parametrize("pred_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_min_snr_gamma_weights_and_the_weighted_loss(pred_type, zero_terminal_snr, device, rng):
    obj = DDPM(pred_type, zero_terminal_snr=zero_terminal_snr, min_snr_gamma=5.0)
    t = np.array([0.0, 50.0, 300.0, 999.0])
    abar = _abar(zero_terminal_snr)[t.astype(int)]
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = abar / (1 - abar)
        want = np.minimum(snr, 5.0) / (snr if pred_type == "epsilon" else snr + 1)
    want = np.nan_to_num(want)                                        # SNR 0 (zero-terminal t = 999): weight 0
    w = obj.weights(_t(t, device)).numpy()
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
    assert w[0] < 1 and (pred_type == "v_prediction" or w[2] == pytest.approx(1.0))  # low noise down-weighted
    pred, target = rng.standard_normal((4, 4, 2, 2)), rng.standard_normal((4, 4, 2, 2))
    loss = obj.loss(_t(pred, device), _t(target, device), _t(t, device)).item()
    assert loss == pytest.approx(np.mean(want * _per_sample_mse(pred.astype(np.float32), target)), rel=1e-5)
    plain = DDPM(pred_type).loss(_t(pred, device), _t(target, device), _t(t, device)).item()
    assert plain == pytest.approx(np.mean((pred.astype(np.float32) - target) ** 2), rel=1e-5)
    with pytest.raises(ValueError, match="needs the timesteps"):
        obj.loss(_t(pred, device), _t(target, device))


@pytest.mark.parametrize("objective", [lambda off: DDPM(noise_offset=off), lambda off: O.FlowMatching(
    noise_offset=off)])
def test_noise_offset_adds_a_per_sample_channel_constant(objective, device):
    shape = (2, 3, 4, 5)
    plain = objective(0.0).sample_noise(shape, generator=flame.Generator(device).manual_seed(7), device=device)
    np.testing.assert_array_equal(plain.numpy(), flame.randn(*shape, generator=flame.Generator(device).manual_seed(7),
                                                             dtype=flame.float32, device=device).numpy())
    g = flame.Generator(device).manual_seed(7)
    eps = flame.randn(*shape, generator=g, dtype=flame.float32, device=device).numpy()
    off = flame.randn(2, 3, 1, 1, generator=g, dtype=flame.float32, device=device).numpy()
    got = objective(0.1).sample_noise(shape, generator=flame.Generator(device).manual_seed(7), device=device).numpy()
    np.testing.assert_allclose(got, eps + 0.1 * off, rtol=1e-6, atol=1e-7)
    d = got - eps
    assert np.ptp(d, axis=(2, 3)).max() < 1e-6 and np.abs(d).max() > 1e-3   # constant over h, w; not zero


# ----------------------------------------------------------------------------- SD3: weightings and 'mode'
def test_sd3_loss_weightings_are_diffusers_formulas(device, rng):
    sigma = np.array([0.05, 0.3, 0.5, 0.9])
    want = {"sigma_sqrt": sigma ** -2.0, "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))}
    pred, target = rng.standard_normal((4, 16, 2, 2)), rng.standard_normal((4, 16, 2, 2))
    mse = _per_sample_mse(pred.astype(np.float32), target.astype(np.float32))
    for scheme in O.WEIGHTING_SCHEMES:
        timestep_type = scheme if scheme in O.DENSITY_SCHEMES else "logit_normal"
        obj = O.FlowMatching(timestep_type, weighting_scheme=scheme)
        w = want.get(scheme, np.ones(4))
        if scheme in want:
            np.testing.assert_allclose(obj.weights(_t(sigma, device)).numpy(), w, rtol=1e-5)
        else:
            assert obj.weights(_t(sigma, device)) is None
        loss = obj.loss(_t(pred, device), _t(target, device), _t(sigma, device)).item()
        assert loss == pytest.approx(np.mean(w * mse), rel=1e-5), scheme
    with pytest.raises(ValueError, match="needs the timesteps"):
        O.FlowMatching("logit_normal", weighting_scheme="cosmap").loss(_t(pred), _t(target))
    with pytest.raises(ValueError, match=r"weighting scheme 'mode' draws timesteps by its density"):
        O.FlowMatching("logit_normal", weighting_scheme="mode")


def test_mode_timesteps_follow_the_sd3_papers_density():
    u = flame.rand(1000, generator=flame.Generator("cpu").manual_seed(3), dtype=flame.float64, device="cpu").numpy()
    got = sample_sigmas("mode", 1000, generator=flame.Generator("cpu").manual_seed(3), mode_scale=1.29).numpy()
    want = 1 - u - 1.29 * (np.cos(math.pi * u / 2) ** 2 - 1 + u)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got.min() >= 0 and got.max() <= 1
    # mode_scale > 0 puts more mass in the middle than the uniform draw it comes from
    assert np.mean(np.abs(got - 0.5) < 0.25) > np.mean(np.abs(u - 0.5) < 0.25) + 0.1
    with pytest.raises(ValueError, match="mode_scale must lie in"):
        sample_sigmas("mode", 4, mode_scale=2.0)
