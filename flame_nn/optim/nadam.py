"""NAdam (Adam with Nesterov momentum, Dozat 2016), PyTorch's update rule with its momentum schedule:

    mu_t = b1 (1 - 0.5 * 0.96^(t psi)),  psi = momentum_decay ;  prod_t = mu_1 ... mu_t
    g += weight_decay * p   (decoupled_weight_decay: p *= 1 - lr weight_decay instead)
    m = lerp(m, g, 1 - b1) ;  v = b2 v + (1 - b2) g^2 ;  d = sqrt(v / (1 - b2^t)) + eps
    p -= lr (1 - mu_t) / (1 - prod_t) g / d + lr mu_{t+1} / (1 - prod_t mu_{t+1}) m / d
"""
from flame_core import backend

from .moments import check_args, init_moments, prepare, update_moments
from .optimizer import Optimizer, _closure_loss, grads_of


class NAdam(Optimizer):
    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3, *,
                 decoupled_weight_decay=False, maximize=False):
        check_args("NAdam", lr, betas, eps, weight_decay, momentum_decay=momentum_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                                      maximize=maximize))

    def _init_state(self, p, group):
        return init_moments(self, p, mu_product=1.0)

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps, psi = group["lr"], group["betas"], group["eps"], group["momentum_decay"]
            for p, g in grads_of(group):
                st, g, w = prepare(self, p, g, group)
                xp = backend.xp_of(w)
                t = st["step"]
                mu = b1 * (1.0 - 0.5 * 0.96 ** (t * psi))
                mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * psi))
                st["mu_product"] *= mu
                prod = st["mu_product"]
                m, v = st["exp_avg"].array, st["exp_avg_sq"].array
                update_moments(m, v, g, b1, b2)
                d = xp.sqrt(v / (1 - b2 ** t)) + eps
                upd = (lr * (1.0 - mu) / (1.0 - prod)) * g / d + (lr * mu_next / (1.0 - prod * mu_next)) * m / d
                w -= upd.astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
