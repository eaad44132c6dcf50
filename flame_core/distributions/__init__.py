"""torch.distributions' core: Distribution, Normal, LogNormal, HalfNormal, Cauchy, Uniform, Exponential, Laplace,
Gumbel, Weibull, StudentT, Chi2, Bernoulli, Categorical, OneHotCategorical, Geometric, Poisson, Binomial, Gamma, Beta,
Dirichlet, MultivariateNormal, Independent, MixtureSameFamily, kl_divergence / register_kl (PyTorch's names,
parameters and formulas)."""
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
from .multivariate_normal import MultivariateNormal
from .normal import LogNormal, Normal
from .one_hot_categorical import OneHotCategorical
from .student_t import Chi2, StudentT
from .uniform import Uniform

__all__ = ["Bernoulli", "Beta", "Binomial", "Categorical", "Cauchy", "Chi2", "Dirichlet", "Distribution", "Exponential",
           "Gamma", "Geometric", "Gumbel", "HalfNormal", "Independent", "Laplace", "LogNormal", "MixtureSameFamily",
           "MultivariateNormal", "Normal", "OneHotCategorical", "Poisson", "StudentT", "Uniform", "Weibull",
           "broadcast_all", "kl_divergence", "register_kl"]
