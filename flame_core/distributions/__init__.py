"""torch.distributions' core: Distribution, Normal, LogNormal, HalfNormal, Cauchy, Uniform, Exponential, Laplace,
Gumbel, Weibull, StudentT, Chi2, Bernoulli, Categorical, OneHotCategorical, Geometric, Poisson, Binomial, Gamma, Beta,
Multinomial, Dirichlet, MultivariateNormal, Independent, MixtureSameFamily, TransformedDistribution and its
transforms (flame_core.distributions.transforms), Pareto, RelaxedBernoulli, RelaxedOneHotCategorical, kl_divergence /
register_kl (PyTorch's names, parameters and formulas)."""
from . import transforms
from .bernoulli import Bernoulli
from .beta import Beta
from .categorical import Categorical
from .cauchy import Cauchy
from .dirichlet import Dirichlet
from .discrete_counts import Binomial, Geometric, Poisson
from .distribution import Distribution, broadcast_all
from .exponential import Exponential
from .gamma import Gamma
from .gumbel import Gumbel, Weibull
from .half_normal import HalfNormal
from .independent import Independent
from .kl import kl_divergence, register_kl
from .laplace import Laplace
from .mixture_same_family import MixtureSameFamily
from .multinomial import Multinomial
from .multivariate_normal import MultivariateNormal
from .normal import LogNormal, Normal
from .one_hot_categorical import OneHotCategorical
from .student_t import Chi2, StudentT
from .transformed_distribution import (
    ExpRelaxedCategorical,
    LogitRelaxedBernoulli,
    Pareto,
    RelaxedBernoulli,
    RelaxedOneHotCategorical,
    TransformedDistribution,
)
from .uniform import Uniform

__all__ = ["Bernoulli", "Beta", "Binomial", "Categorical", "Cauchy", "Chi2", "Dirichlet", "Distribution", "Exponential",
           "Gamma", "Geometric", "Gumbel", "HalfNormal", "Independent", "Laplace", "LogNormal", "MixtureSameFamily",
           "Multinomial", "MultivariateNormal", "Normal", "OneHotCategorical", "Poisson", "StudentT", "Uniform",
           "Weibull", "broadcast_all", "kl_divergence", "register_kl", "transforms", "TransformedDistribution",
           "Pareto", "RelaxedBernoulli", "RelaxedOneHotCategorical", "LogitRelaxedBernoulli", "ExpRelaxedCategorical"]
