"""RAdam (rectified Adam, Liu et al. 2019), PyTorch's update rule:

    g += weight_decay * p   (decoupled_weight_decay: p *= 1 - lr weight_decay instead)
    m = lerp(m, g, 1 - b1) ;  v = b2 v + (1 - b2) g^2 ;  mh = m / (1 - b1^t)
    rho_inf = 2 / (1 - b2) - 1 ;  rho_t = rho_inf - 2 t b2^t / (1 - b2^t)
    rho_t > 5:  r = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
                p -= lr mh r sqrt(1 - b2^t) / (sqrt(v) + eps)
    otherwise:  p -= lr mh   (the variance estimate is not yet trusted: SGD with momentum)
"""
import math

from flame_core import backend

from .moments import check_args, init_moments, prepare, update_moments
from .optimizer import Optimizer, _closure_loss, grads_of


class RAdam(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 decoupled_weight_decay=False, maximize=False):
        check_args("RAdam", lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay, maximize=maximize))

    def _init_state(self, p, group):
        return init_moments(self, p)

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            rho_inf = 2 / (1 - b2) - 1
            for p, g in grads_of(group):
                st, g, w = prepare(self, p, g, group)
                xp = backend.xp_of(w)
                t = st["step"]
                m, v = st["exp_avg"].array, st["exp_avg_sq"].array
                update_moments(m, v, g, b1, b2)
                bc2 = 1 - b2 ** t
                mh = m / (1 - b1 ** t)
                rho_t = rho_inf - 2 * t * (b2 ** t) / bc2
                if rho_t > 5.0:
                    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                    upd = mh * lr * (math.sqrt(bc2) / (xp.sqrt(v) + eps)) * rect
                else:
                    upd = mh * lr
                w -= upd.astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
