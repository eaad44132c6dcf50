"""flame_core.distributions beyond the golden values (tests/core/test_torch_surface_golden.py, cases dist_* and kl_*):
draws (shapes, moments on 40000 samples against the closed forms), reparameterized gradients, argument validation,
the KL registry."""
import math

import numpy as np
import pytest

import flame_core as flame
from flame_core import distributions as D


def _t(v, device, grad=False):
    return flame.tensor(np.asarray(v, dtype=np.float64), dtype=flame.float64, device=device, requires_grad=grad)


def _np(t):
    return t.detach().cpu().numpy()


CASES = {
    "normal": lambda d: D.Normal(_t([0.5, -1.0], d), _t([1.0, 0.3], d)),
    "lognormal": lambda d: D.LogNormal(_t([0.0, 0.4], d), _t([0.25, 0.5], d)),
    "uniform": lambda d: D.Uniform(_t([-1.0, 2.0], d), _t([3.0, 2.5], d)),
    "exponential": lambda d: D.Exponential(_t([0.5, 4.0], d)),
    "laplace": lambda d: D.Laplace(_t([1.0, -2.0], d), _t([0.5, 2.0], d)),
    "bernoulli": lambda d: D.Bernoulli(probs=_t([0.1, 0.7], d)),
    "gamma": lambda d: D.Gamma(_t([0.3, 4.5], d), _t([1.0, 2.0], d)),
    "beta": lambda d: D.Beta(_t([0.4, 3.0], d), _t([0.6, 1.5], d)),
    "halfnormal": lambda d: D.HalfNormal(_t([0.5, 2.0], d)),
    "studentt": lambda d: D.StudentT(_t([6.0, 12.0], d), _t([1.0, -1.0], d), _t([0.5, 2.0], d)),
    "chi2": lambda d: D.Chi2(_t([0.7, 9.0], d)),
    "gumbel": lambda d: D.Gumbel(_t([1.0, -2.0], d), _t([0.5, 2.0], d)),
    "weibull": lambda d: D.Weibull(_t([1.0, 2.0], d), _t([0.8, 3.0], d)),
    "geometric": lambda d: D.Geometric(probs=_t([0.3, 0.8], d)),
    "poisson": lambda d: D.Poisson(_t([0.5, 4.0], d)),
    "poisson_large": lambda d: D.Poisson(_t([30.0, 700.0], d)),
    "binomial": lambda d: D.Binomial(_t([5.0, 40.0], d), probs=_t([0.3, 0.8], d)),
    "pareto": lambda d: D.Pareto(_t([1.0, 2.0], d), _t([4.5, 6.0], d)),
    "mixture": lambda d: D.MixtureSameFamily(D.Categorical(probs=_t([[0.3, 0.7], [0.5, 0.5]], d)),
                                             D.Normal(_t([[-2.0, 3.0], [0.0, 1.0]], d),
                                                      _t([[1.0, 0.5], [1.0, 2.0]], d))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_draws_have_the_shape_and_the_moments(device, name):
    flame.manual_seed(1)
    dist = CASES[name](device)
    assert dist.sample().shape == (2,) and dist.sample((3, 4)).shape == (3, 4, 2) and dist.sample(5).shape == (5, 2)
    x = _np(dist.sample((40000,)))
    mean, var = _np(dist.mean), _np(dist.variance)
    # the sample mean within 5 standard errors; the sample variance within 10 % (heavy tails: LogNormal, Gamma(0.3))
    np.testing.assert_array_less(np.abs(x.mean(0) - mean), 5 * np.sqrt(var / 40000))
    np.testing.assert_allclose(x.var(0), var, rtol=0.1)
    if name in ("poisson", "poisson_large"):   # the whole law: the frequencies of the counts near the mean
        from math import lgamma, log
        for j, lam in enumerate(_np(dist.rate)):
            for k in range(int(lam) - 2 if lam > 2 else 0, int(lam) + 3):
                want = np.exp(k * log(lam) - lam - lgamma(k + 1))
                assert abs((x[:, j] == k).mean() - want) < 5 * np.sqrt(want / 40000) + 1e-4, (lam, k)
    if name in ("exponential", "gamma", "lognormal", "halfnormal", "chi2", "weibull"):
        assert (x > 0).all()
    if name in ("geometric", "poisson", "poisson_large", "binomial"):
        assert (x >= 0).all() and (x == np.floor(x)).all()
    if name == "beta":
        assert ((x > 0) & (x < 1)).all()
    if name == "bernoulli":
        assert set(np.unique(x)) <= {0.0, 1.0}


def test_categorical_draws_follow_the_probabilities(device):
    flame.manual_seed(2)
    dist = D.Categorical(logits=_t([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], device))
    s = dist.sample((30000,))
    assert s.shape == (30000, 2) and s.dtype == flame.int64
    freq = np.stack([(_np(s) == k).mean(0) for k in range(3)], -1)
    np.testing.assert_allclose(freq, _np(dist.probs), atol=0.015)
    assert dist.sample().shape == (2,)
    np.testing.assert_array_equal(_np(dist.enumerate_support()), [[0, 0], [1, 1], [2, 2]])
    np.testing.assert_array_equal(_np(dist.mode), [2, 0])


@pytest.mark.parametrize("name", ["normal", "lognormal", "uniform", "exponential", "laplace"])
def test_rsample_carries_gradients_to_the_parameters(device, name):
    """d rsample / d parameter by the reparameterization, checked against the draw itself (e.g. Normal: d x / d loc =
    1, d x / d scale = eps = (x - loc) / scale)."""
    flame.manual_seed(3)
    a, b = _t([0.3, 1.2], device, True), _t([0.7, 2.0], device, True)
    dist = {"normal": lambda: D.Normal(a, b), "lognormal": lambda: D.LogNormal(a, b),
            "uniform": lambda: D.Uniform(a, a + b), "exponential": lambda: D.Exponential(b),
            "laplace": lambda: D.Laplace(a, b)}[name]()
    assert dist.has_rsample
    x = dist.rsample((6,))
    x.sum().backward()
    xv, av, bv = _np(x), _np(a), _np(b)
    if name == "normal":
        np.testing.assert_allclose(_np(a.grad), 6.0)
        np.testing.assert_allclose(_np(b.grad), ((xv - av) / bv).sum(0), rtol=1e-12)
    elif name == "lognormal":
        np.testing.assert_allclose(_np(a.grad), xv.sum(0), rtol=1e-12)
        np.testing.assert_allclose(_np(b.grad), (xv * (np.log(xv) - av) / bv).sum(0), rtol=1e-10)
    elif name == "uniform":
        np.testing.assert_allclose(_np(a.grad), 6.0)
        np.testing.assert_allclose(_np(b.grad), ((xv - av) / bv).sum(0), rtol=1e-12)
    elif name == "exponential":
        np.testing.assert_allclose(_np(b.grad), (-xv / bv).sum(0), rtol=1e-12)
    else:
        np.testing.assert_allclose(_np(a.grad), 6.0)
        np.testing.assert_allclose(_np(b.grad), ((xv - av) / bv).sum(0), rtol=1e-12)
    with flame.no_grad():
        assert not dist.sample().requires_grad


def test_gamma_and_beta_have_no_rsample(device):
    for dist in (D.Gamma(_t([1.0], device), _t([1.0], device)), D.Beta(_t([1.0], device), _t([2.0], device)),
                 D.Bernoulli(logits=_t([0.0], device))):
        assert not dist.has_rsample
        with pytest.raises(NotImplementedError, match="has no reparameterized sample"):
            dist.rsample()


def test_invalid_parameters_and_values_raise(device):
    with pytest.raises(ValueError, match="Normal: expected parameter scale to satisfy the constraint GreaterThan"):
        D.Normal(0.0, _t([1.0, -1.0], device))
    with pytest.raises(ValueError, match="Uniform: expected parameter low"):
        D.Uniform(2.0, 1.0)
    with pytest.raises(ValueError, match="Beta: expected parameter concentration0"):
        D.Beta(1.0, 0.0)
    with pytest.raises(ValueError, match="Bernoulli: pass either probs or logits"):
        D.Bernoulli(probs=_t([0.5], device), logits=_t([0.0], device))
    with pytest.raises(ValueError, match="Categorical: pass either probs or logits"):
        D.Categorical()
    with pytest.raises(ValueError, match="outside the support"):
        D.Exponential(_t([1.0], device)).log_prob(_t([-1.0], device))
    with pytest.raises(ValueError, match="outside the support"):
        D.Categorical(probs=_t([0.5, 0.5], device)).log_prob(flame.tensor([2], device=device))
    D.Normal(0.0, -1.0, validate_args=False)   # no check when asked
    with pytest.raises(TypeError, match="parameters must be tensors or numbers"):
        D.Normal("a", 1.0)


def test_numbers_take_the_tensor_parameters_dtype_and_broadcast(device):
    dist = D.Normal(_t([[0.0], [1.0]], device), 2.0)
    assert dist.batch_shape == (2, 1) and dist.scale.dtype == flame.float64
    assert D.Normal(0.0, 1.0).loc.dtype == flame.get_default_dtype()
    lp = dist.log_prob(_t([0.0, 1.0, 2.0], device))
    assert lp.shape == (2, 3)
    np.testing.assert_allclose(_np(lp)[0, 0], -math.log(2.0) - 0.5 * math.log(2 * math.pi), rtol=1e-12)


def test_kl_registry(device):
    p = D.Normal(_t([0.0], device), _t([1.0], device))
    np.testing.assert_allclose(_np(D.kl_divergence(p, p)), 0.0, atol=1e-15)
    with pytest.raises(NotImplementedError, match=r"no formula registered for \(Normal, Gamma\)"):
        D.kl_divergence(p, D.Gamma(1.0, 1.0))

    class Wide(D.Normal):
        pass

    np.testing.assert_allclose(_np(D.kl_divergence(Wide(0.0, 2.0), p)),
                               _np(D.kl_divergence(D.Normal(0.0, 2.0), p)))   # a subclass uses its base's formula

    @D.register_kl(Wide, D.Normal)
    def _wide(a, b):
        return a.loc * 0 + 7.0

    assert float(D.kl_divergence(Wide(0.0, 2.0), p).item()) == 7.0
    u = D.Uniform(0.0, 1.0)
    assert math.isinf(float(D.kl_divergence(u, D.Uniform(0.5, 2.0)).item()))


def test_multivariate_draws_and_the_three_parameterizations(device):
    flame.manual_seed(4)
    a = _t([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [-0.3, 0.2, 0.7]], device)
    cov = a @ a.mT
    loc = _t([1.0, -1.0, 0.5], device)
    byc = D.MultivariateNormal(loc, covariance_matrix=cov)
    byt = D.MultivariateNormal(loc, scale_tril=a)
    byp = D.MultivariateNormal(loc, precision_matrix=flame.linalg.inv(cov))
    for other in (byt, byp):
        np.testing.assert_allclose(_np(other.covariance_matrix), _np(cov), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(other.scale_tril), _np(a), rtol=1e-10, atol=1e-12)
    x = _np(byc.sample((40000,)))
    assert x.shape == (40000, 3)
    np.testing.assert_allclose(x.mean(0), _np(loc), atol=0.03)
    np.testing.assert_allclose(np.cov(x.T), _np(cov), atol=0.04)
    lg = _t([0.2, 0.1, -0.3], device, True)
    D.MultivariateNormal(lg, scale_tril=a).rsample((5,)).sum().backward()
    np.testing.assert_allclose(_np(lg.grad), 5.0)
    with pytest.raises(ValueError, match="exactly one of covariance_matrix"):
        D.MultivariateNormal(loc, covariance_matrix=cov, scale_tril=a)
    with pytest.raises(ValueError, match=r"the matrix must be \(..., 3, 3\)"):
        D.MultivariateNormal(loc, covariance_matrix=cov[:2, :2])


def test_dirichlet_cauchy_one_hot_and_independent(device):
    flame.manual_seed(5)
    d = D.Dirichlet(_t([[0.5, 2.0, 3.0], [1.0, 1.0, 1.0]], device))
    x = _np(d.sample((40000,)))
    assert x.shape == (40000, 2, 3)
    np.testing.assert_allclose(x.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(x.mean(0), _np(d.mean), atol=0.01)
    np.testing.assert_allclose(x.var(0), _np(d.variance), rtol=0.1)
    c = _np(D.Cauchy(_t([1.0], device), _t([2.0], device)).sample((40000,)))
    np.testing.assert_allclose(np.quantile(c, [0.25, 0.5, 0.75]), [-1.0, 1.0, 3.0], atol=0.1)   # loc -+ scale
    oh = D.OneHotCategorical(probs=_t([0.2, 0.3, 0.5], device))
    s = _np(oh.sample((20000,)))
    assert s.shape == (20000, 3) and (s.sum(-1) == 1).all() and set(np.unique(s)) == {0.0, 1.0}
    np.testing.assert_allclose(s.mean(0), [0.2, 0.3, 0.5], atol=0.015)
    ind = D.Independent(D.Normal(_t(np.zeros((2, 4)), device), 1.0), 1)
    assert ind.batch_shape == (2,) and ind.event_shape == (4,) and ind.has_rsample
    assert ind.sample((3,)).shape == (3, 2, 4) and ind.log_prob(ind.sample()).shape == (2,)
    with pytest.raises(ValueError, match="reinterpreted_batch_ndims 3 must be in"):
        D.Independent(D.Normal(_t(np.zeros((2, 4)), device), 1.0), 3)


def test_transformed_relaxed_and_multinomial_draws(device):
    T = D.transforms
    base = D.Normal(_t([0.0, 1.0], device), _t([1.0, 0.5], device))
    td = D.TransformedDistribution(base, [T.ExpTransform(), T.AffineTransform(1.0, 2.0)])
    flame.manual_seed(7)
    y = td.sample((4,))
    flame.manual_seed(7)
    np.testing.assert_allclose(_np(y), 1.0 + 2.0 * np.exp(_np(base.sample((4,)))), rtol=1e-12)
    x = _np(td.sample((40000,)))
    assert (x > 1).all() and td.batch_shape == (2,) and td.event_shape == ()
    back = td.transforms[1].inv(td.transforms[0](_t([0.3], device)))
    np.testing.assert_allclose(_np(back), (np.exp(0.3) - 1.0) / 2.0, rtol=1e-12)   # inverse of the affine part
    t = _t([0.5, 1.5], device, True)
    rb = D.RelaxedBernoulli(t[0], probs=_t([0.3, 0.8], device))
    r = rb.rsample((1000,))
    assert r.shape == (1000, 2) and ((_np(r) > 0) & (_np(r) < 1)).all()
    r.sum().backward()
    assert t.grad is not None and np.isfinite(_np(t.grad)).all()
    ro = D.RelaxedOneHotCategorical(_t(0.5, device), logits=_t([0.0, 1.0, 2.0], device))
    z = _np(ro.rsample((1000,)))
    np.testing.assert_allclose(z.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(np.bincount(z.argmax(-1), minlength=3) / 1000, _np(ro.probs), atol=0.05)
    m = D.Multinomial(10, probs=_t([0.2, 0.3, 0.5], device))
    c = _np(m.sample((20000,)))
    assert c.shape == (20000, 3) and (c.sum(-1) == 10).all()
    np.testing.assert_allclose(c.mean(0), _np(m.mean), atol=0.05)
    np.testing.assert_allclose(c.var(0), _np(m.variance), rtol=0.1)
    with pytest.raises(ValueError, match="total_count must be a non-negative int"):
        D.Multinomial(2.5, probs=_t([0.5, 0.5], device))
    with pytest.raises(TypeError, match="transforms must be Transforms"):
        D.TransformedDistribution(base, [lambda v: v])
