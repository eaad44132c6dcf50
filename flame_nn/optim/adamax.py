"""Adamax (Adam with the infinity norm), PyTorch's update rule:

    g += weight_decay * p ;  m = lerp(m, g, 1 - b1) ;  u = max(b2 u, |g| + eps) ;  p -= lr / (1 - b1^t) * m / u
"""
from flame_core import backend

from .moments import check_args, init_moments
from .optimizer import Optimizer, _closure_loss, grads_of


class Adamax(Optimizer):
    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, maximize=False):
        check_args("Adamax", lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))

    def _init_state(self, p, group):
        return init_moments(self, p, "exp_inf")

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group)
                w = p.array
                xp = backend.xp_of(w)
                m, u = st["exp_avg"].array, st["exp_inf"].array
                m += (g - m) * (1 - b1)          # lerp(m, g, 1 - b1), as PyTorch
                u *= b2
                xp.maximum(u, xp.abs(g) + eps, out=u)
                w -= (lr / (1 - b1 ** st["step"]) * m / u).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
