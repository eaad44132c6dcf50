"""torch.special's names: the gamma family, the normal distribution's functions, the modified Bessel functions of the
first kind, the regularized incomplete gamma functions, the entropy and logs with a zero factor, and the aliases
PyTorch keeps there for functions that also live at the top level."""
from .ops.bessel import i0, i0e, i1, i1e
from .ops.elementwise import erf, exp, log1p, round, sigmoid
from .ops.incomplete_gamma import gammainc, gammaincc
from .ops.math_ops import erfc, erfinv, exp2, expm1, logit, sinc, xlogy
from .ops.reduction import log_softmax, logsumexp, softmax
from .ops.special_fns import digamma, entr, lgamma, log_ndtr, mvlgamma, ndtr, ndtri, polygamma, xlog1py, zeta

gammaln = lgamma
psi = digamma
expit = sigmoid
multigammaln = mvlgamma
modified_bessel_i0, modified_bessel_i1 = i0, i1


__all__ = ["digamma", "entr", "erf", "erfc", "erfinv", "exp2", "expit", "expm1", "gammaln", "log1p", "log_ndtr",
           "log_softmax", "logit", "logsumexp", "multigammaln", "mvlgamma", "ndtr", "ndtri", "polygamma", "psi",
           "round", "sinc", "softmax", "xlog1py", "xlogy", "zeta", "lgamma", "exp", "i0", "i0e", "i1", "i1e",
           "modified_bessel_i0", "modified_bessel_i1", "gammainc", "gammaincc"]
