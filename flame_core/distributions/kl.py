"""kl_divergence(p, q) and register_kl, as torch.distributions.kl: closed forms for pairs of one family (Normal,
LogNormal, HalfNormal, Cauchy, Uniform, Exponential, Laplace, Bernoulli, Categorical, OneHotCategorical, Gamma, Beta,
Dirichlet, MultivariateNormal, Gumbel, Geometric, Poisson, Independent of such)."""
import math

from .. import linalg
from ..ops.activation import softplus
from ..ops.special_fns import digamma, lgamma
from .bernoulli import Bernoulli
from .beta import Beta
from .categorical import Categorical
from .cauchy import Cauchy
from .dirichlet import Dirichlet
from .discrete_counts import Geometric, Poisson
from .exponential import Exponential
from .gamma import Gamma
from .gumbel import _EULER, Gumbel
from .half_normal import HalfNormal
from .independent import Independent, _sum_rightmost
from .laplace import Laplace
from .multivariate_normal import MultivariateNormal
from .normal import LogNormal, Normal
from .one_hot_categorical import OneHotCategorical
from .uniform import Uniform

_KL = {}


def register_kl(type_p, type_q):
    """Decorator registering fn(p, q) as the KL divergence of a (type_p, type_q) pair."""
    def deco(fn):
        _KL[(type_p, type_q)] = fn
        return fn
    return deco


def kl_divergence(p, q):
    """KL(p || q) for a registered pair of distributions (the most specific registration of their types)."""
    for tp in type(p).__mro__:
        for tq in type(q).__mro__:
            fn = _KL.get((tp, tq))
            if fn is not None:
                return fn(p, q)
    raise NotImplementedError(f"kl_divergence: no formula registered for ({type(p).__name__}, {type(q).__name__})")


_INF = math.inf


@register_kl(Normal, Normal)
def _kl_normal_normal(p, q):
    var_ratio = (p.scale / q.scale).pow(2)
    t1 = ((p.loc - q.loc) / q.scale).pow(2)
    return 0.5 * (var_ratio + t1 - 1 - var_ratio.log())


@register_kl(LogNormal, LogNormal)
def _kl_lognormal_lognormal(p, q):
    return _kl_normal_normal(p.base_dist, q.base_dist)


@register_kl(Uniform, Uniform)
def _kl_uniform_uniform(p, q):
    result = ((q.high - q.low) / (p.high - p.low)).log()
    return result.masked_fill((q.low > p.low) | (q.high < p.high), _INF)


@register_kl(Exponential, Exponential)
def _kl_exponential_exponential(p, q):
    rate_ratio = q.rate / p.rate
    return -rate_ratio.log() + rate_ratio - 1


@register_kl(Laplace, Laplace)
def _kl_laplace_laplace(p, q):
    scale_ratio = p.scale / q.scale
    loc_abs_diff = (p.loc - q.loc).abs()
    return -scale_ratio.log() + loc_abs_diff / q.scale + scale_ratio * (-loc_abs_diff / p.scale).exp() - 1


@register_kl(Bernoulli, Bernoulli)
def _kl_bernoulli_bernoulli(p, q):
    t1 = p.probs * (softplus(-q.logits) - softplus(-p.logits))
    t1 = t1.masked_fill(q.probs == 0, _INF).masked_fill(p.probs == 0, 0.0)
    t2 = (1 - p.probs) * (softplus(q.logits) - softplus(p.logits))
    t2 = t2.masked_fill(q.probs == 1, _INF).masked_fill(p.probs == 1, 0.0)
    return t1 + t2


@register_kl(Categorical, Categorical)
def _kl_categorical_categorical(p, q):
    t = p.probs * (p.logits - q.logits)
    t = t.masked_fill((q.probs == 0).expand(*t.shape), _INF).masked_fill((p.probs == 0).expand(*t.shape), 0.0)
    return t.sum(-1)


@register_kl(Gamma, Gamma)
def _kl_gamma_gamma(p, q):
    t1 = q.concentration * (p.rate / q.rate).log()
    t2 = lgamma(q.concentration) - lgamma(p.concentration)
    t3 = (p.concentration - q.concentration) * digamma(p.concentration)
    t4 = (q.rate - p.rate) * (p.concentration / p.rate)
    return t1 + t2 + t3 + t4


@register_kl(Beta, Beta)
def _kl_beta_beta(p, q):
    sp = p.concentration1 + p.concentration0
    sq = q.concentration1 + q.concentration0
    t1 = lgamma(sp) - lgamma(sq)
    t2 = (lgamma(p.concentration1) - lgamma(q.concentration1)) + (lgamma(p.concentration0) - lgamma(q.concentration0))
    t3 = ((p.concentration1 - q.concentration1) * (digamma(p.concentration1) - digamma(sp))
          + (p.concentration0 - q.concentration0) * (digamma(p.concentration0) - digamma(sp)))
    return t1 - t2 + t3


@register_kl(HalfNormal, HalfNormal)
def _kl_halfnormal_halfnormal(p, q):
    return _kl_normal_normal(p.base_dist, q.base_dist)


@register_kl(Cauchy, Cauchy)
def _kl_cauchy_cauchy(p, q):
    t1 = ((p.scale + q.scale).pow(2) + (p.loc - q.loc).pow(2)).log()
    return t1 - (4 * p.scale * q.scale).log()


@register_kl(OneHotCategorical, OneHotCategorical)
def _kl_onehot_onehot(p, q):
    return _kl_categorical_categorical(p._categorical, q._categorical)


@register_kl(Dirichlet, Dirichlet)
def _kl_dirichlet_dirichlet(p, q):
    sp, sq = p.concentration.sum(-1), q.concentration.sum(-1)
    t1 = lgamma(sp) - lgamma(sq)
    t2 = (lgamma(p.concentration) - lgamma(q.concentration)).sum(-1)
    t3 = p.concentration - q.concentration
    t4 = digamma(p.concentration) - digamma(sp).unsqueeze(-1)
    return t1 - t2 + (t3 * t4).sum(-1)


@register_kl(MultivariateNormal, MultivariateNormal)
def _kl_mvn_mvn(p, q):
    from .. import broadcast_shapes
    if p.event_shape != q.event_shape:
        raise ValueError("kl_divergence: multivariate normals of different event shapes "
                         f"{tuple(p.event_shape)} and {tuple(q.event_shape)}")
    lp, lq = p._unbroadcasted_scale_tril, q._unbroadcasted_scale_tril
    half_term1 = (lq.diagonal(dim1=-2, dim2=-1).log().sum(-1) - lp.diagonal(dim1=-2, dim2=-1).log().sum(-1))
    n = p.event_shape[0]
    batch = tuple(broadcast_shapes(tuple(lq.shape[:-2]), tuple(lp.shape[:-2])))
    x = linalg.solve_triangular(lq.expand(*(batch + (n, n))), lp.expand(*(batch + (n, n))), upper=False)
    term2 = (x * x).sum((-2, -1))
    diff = q.loc - p.loc
    shape = tuple(broadcast_shapes(tuple(diff.shape[:-1]), tuple(lq.shape[:-2])))
    z = linalg.solve_triangular(lq.expand(*(shape + (n, n))), diff.expand(*(shape + (n,))).unsqueeze(-1),
                                upper=False).squeeze(-1)
    term3 = (z * z).sum(-1)
    return half_term1 + 0.5 * (term2 + term3 - n)


@register_kl(Independent, Independent)
def _kl_independent_independent(p, q):
    if p.reinterpreted_batch_ndims != q.reinterpreted_batch_ndims:
        raise NotImplementedError("kl_divergence: Independent distributions of different reinterpreted_batch_ndims")
    return _sum_rightmost(kl_divergence(p.base_dist, q.base_dist), p.reinterpreted_batch_ndims)


@register_kl(Poisson, Poisson)
def _kl_poisson_poisson(p, q):
    return p.rate * (p.rate.log() - q.rate.log()) - (p.rate - q.rate)


@register_kl(Geometric, Geometric)
def _kl_geometric_geometric(p, q):
    return -p.entropy() - (-q.probs).log1p() / p.probs - q.logits


@register_kl(Gumbel, Gumbel)
def _kl_gumbel_gumbel(p, q):
    ct1 = p.scale / q.scale
    ct2 = q.loc / q.scale
    ct3 = p.loc / q.scale
    t1 = -ct1.log() - ct2 + ct3
    t2 = ct1 * _EULER
    t3 = (ct2 + lgamma(1 + ct1) - ct3).exp()
    return t1 + t2 + t3 - (1 + _EULER)
