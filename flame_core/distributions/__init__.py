"""torch.distributions' core: Distribution, Normal, LogNormal, Uniform, Exponential, Laplace, Bernoulli, Categorical,
Gamma, Beta, kl_divergence / register_kl (PyTorch's names, parameters and formulas)."""
from .bernoulli import Bernoulli
from .beta import Beta
from .categorical import Categorical
from .distribution import Distribution, broadcast_all
from .exponential import Exponential
from .gamma import Gamma
from .kl import kl_divergence, register_kl
from .laplace import Laplace
from .normal import LogNormal, Normal
from .uniform import Uniform

__all__ = ["Bernoulli", "Beta", "Categorical", "Distribution", "Exponential", "Gamma", "Laplace", "LogNormal",
           "Normal", "Uniform", "broadcast_all", "kl_divergence", "register_kl"]
