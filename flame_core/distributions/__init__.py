"""torch.distributions' core: Distribution, Normal, LogNormal, HalfNormal, Cauchy, Uniform, Exponential, Laplace,
Bernoulli, Categorical, OneHotCategorical, Gamma, Beta, Dirichlet, MultivariateNormal, Independent, kl_divergence /
register_kl (PyTorch's names, parameters and formulas)."""
from .bernoulli import Bernoulli
from .beta import Beta
from .categorical import Categorical
from .cauchy import Cauchy
from .dirichlet import Dirichlet
from .distribution import Distribution, broadcast_all
from .exponential import Exponential
from .gamma import Gamma
from .half_normal import HalfNormal
from .independent import Independent
from .kl import kl_divergence, register_kl
from .laplace import Laplace
from .multivariate_normal import MultivariateNormal
from .normal import LogNormal, Normal
from .one_hot_categorical import OneHotCategorical
from .uniform import Uniform

__all__ = ["Bernoulli", "Beta", "Categorical", "Cauchy", "Dirichlet", "Distribution", "Exponential", "Gamma",
           "HalfNormal", "Independent", "Laplace", "LogNormal", "MultivariateNormal", "Normal", "OneHotCategorical",
           "Uniform", "broadcast_all", "kl_divergence", "register_kl"]
