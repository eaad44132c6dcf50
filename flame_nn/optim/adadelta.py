"""Adadelta (Zeiler 2012), PyTorch's update rule:

    g += weight_decay * p ;  v = rho v + (1 - rho) g^2 ;  delta = sqrt(u + eps) / sqrt(v + eps) * g
    u = rho u + (1 - rho) delta^2 ;  p -= lr delta
`foreach`, `capturable` and `differentiable` are accepted at their defaults only: FLAME updates parameter by
parameter, outside the autograd, with the step count on the host.
"""
from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss, grads_of, reject_unsupported


class Adadelta(Optimizer):
    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):
        for k, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if v < 0:
                raise ValueError(f"Adadelta: invalid {k}={v} (must be >= 0)")
        if not 0 <= rho <= 1:
            raise ValueError(f"Adadelta: invalid rho={rho} (must be in [0, 1])")
        reject_unsupported("Adadelta", foreach=foreach, capturable=capturable, differentiable=differentiable)
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = self.state[p] = {"step": 0, "square_avg": as_tensor(xp.zeros_like(p.array)),
                              "acc_delta": as_tensor(xp.zeros_like(p.array))}
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, rho, eps = group["lr"], group["rho"], group["eps"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group)
                w = p.array
                xp = backend.xp_of(w)
                v, u = st["square_avg"].array, st["acc_delta"].array
                v *= rho
                v += (1 - rho) * (g * g)
                delta = xp.sqrt(u + eps) / xp.sqrt(v + eps) * g
                u *= rho
                u += (1 - rho) * (delta * delta)
                w -= (lr * delta).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
