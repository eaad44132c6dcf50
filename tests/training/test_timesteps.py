"""Timestep sampling: each distribution against its analytic CDF (Kolmogorov-Smirnov), known values, errors."""
import math

import numpy as np
import pytest

import flame_core as flame
from flame_models.training import timesteps as T

N = 20000
KS_LIMIT = 1.63 / math.sqrt(N)  # 1% critical value of the one-sample KS statistic


def _phi(x):
    return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(x) / math.sqrt(2.0)))


def _logit(s):
    return np.log(s) - np.log1p(-s)


def _ks(samples, cdf):
    x = np.sort(samples)
    f = cdf(x)
    n = len(x)
    return max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(0, n) / n))


def _draw(kind, **kw):
    g = flame.Generator("cpu").manual_seed(7)
    s = T.sample_sigmas(kind, N, generator=g, **kw)
    assert s.shape == (N,) and s.dtype == flame.float32
    return s.numpy().astype(np.float64)


def test_sigmoid_matches_cdf():
    s = _draw("sigmoid", sigmoid_scale=1.5)
    assert _ks(s, lambda x: _phi(_logit(x) / 1.5)) < KS_LIMIT


def test_logit_normal_matches_cdf():
    s = _draw("logit_normal", logit_mean=0.4, logit_std=0.8)
    assert _ks(s, lambda x: _phi((_logit(x) - 0.4) / 0.8)) < KS_LIMIT


def test_uniform_matches_cdf():
    s = _draw("uniform")
    assert s.min() >= 0 and s.max() < 1
    assert _ks(s, lambda x: x) < KS_LIMIT


def test_shift_matches_cdf():
    k = 3.0
    s = _draw("shift", shift=k)
    # inverse of k·u/(1+(k-1)·u): u = s / (k - (k-1)·s); u = sigmoid(n)
    assert _ks(s, lambda x: _phi(_logit(x / (k - (k - 1) * x)))) < KS_LIMIT
    assert np.median(s) == pytest.approx(0.75, abs=0.01)  # the median u = 0.5 maps to 3·0.5/2 = 0.75


def test_flux_shift_matches_cdf():
    e = math.exp(1.15)
    s = _draw("flux_shift", num_tokens=4096)
    # inverse of e·u/(e·u + 1 - u): u = s / (e·(1 - s) + s)
    assert _ks(s, lambda x: _phi(_logit(x / (e * (1 - x) + x)))) < KS_LIMIT
    assert np.median(s) == pytest.approx(e / (e + 1), abs=0.01)


def test_known_values():
    assert T.flux_mu(256) == pytest.approx(0.5)
    assert T.flux_mu(4096) == pytest.approx(1.15)
    assert T.flux_mu(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840)
    assert float(T.flux_time_shift(0.5, 1.15)) == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 1))
    assert float(T.flux_time_shift(0.0, 1.15)) == 0.0
    assert float(T.flux_time_shift(1.0, 1.15)) == 1.0
    assert float(T.shift_sigmas(0.5, 3.0)) == pytest.approx(0.75)
    assert float(T.shift_sigmas(0.25, 1.0)) == pytest.approx(0.25)


def test_same_state_same_sigmas_and_device(device):
    g = flame.Generator("cpu").manual_seed(3)
    T.sample_sigmas("sigmoid", 5, generator=g)
    state = g.get_state()
    a = T.sample_sigmas("flux_shift", 4, generator=g, num_tokens=1024, device=device)
    g2 = flame.Generator("cpu").manual_seed(99)
    g2.set_state(state)
    b = T.sample_sigmas("flux_shift", 4, generator=g2, num_tokens=1024, device=device)
    assert a.device == flame.device(device)
    np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())


def test_errors():
    with pytest.raises(ValueError, match="logit_normal"):
        T.sample_sigmas("lognormal", 2)
    with pytest.raises(ValueError, match="num_tokens"):
        T.sample_sigmas("flux_shift", 2)
    with pytest.raises(ValueError, match="shift must be > 0"):
        T.sample_sigmas("shift", 2, shift=0.0)


@pytest.mark.parametrize("kind", ["sigmoid", "logit_normal", "uniform", "linear", "shift", "mode", "chroma"])
def test_content_and_style_favour_high_and_low_noise(kind):
    """ai-toolkit's content_or_style: σ at the quantile 1 - u^3 (content) or u^3 (style) of the type's distribution;
    balanced is the distribution itself. Their medians sit at its 87.4 % and 12.6 % quantiles (1 - 0.5^3 = 0.875)."""
    draws = {b: T.sample_sigmas(kind, 20000, generator=flame.Generator("cpu").manual_seed(3), bias=b).numpy()
             for b in ("balanced", "content", "style")}
    q = {b: np.median(v) for b, v in draws.items()}
    assert q["style"] < q["balanced"] < q["content"]
    np.testing.assert_allclose(q["content"], np.quantile(draws["balanced"], 0.875), atol=0.02)
    np.testing.assert_allclose(q["style"], np.quantile(draws["balanced"], 0.125), atol=0.02)
    assert all(((v >= 0) & (v <= 1)).all() for v in draws.values())
    with pytest.raises(ValueError, match="unknown bias"):
        T.sample_sigmas(kind, 2, bias="texture")


def test_linear_is_ai_toolkits_table_of_1000_timesteps():
    """ai-toolkit's 'linear': σ = t / 1000 for t on linspace(1000, 1, 1000), indexed by randint(0, 999) -- every
    value in {1.000, 0.999, ..., 0.002} about equally often, never 0.001."""
    s = T.sample_sigmas("linear", 200000, generator=flame.Generator("cpu").manual_seed(1), dtype=flame.float64).numpy()
    k = np.round(s * 1000).astype(int)
    np.testing.assert_allclose(s, k / 1000, atol=1e-12)
    assert k.min() == 2 and k.max() == 1000
    counts = np.bincount(k, minlength=1001)[2:]
    assert counts.min() > 0.7 * counts.mean() and counts.max() < 1.3 * counts.mean()
