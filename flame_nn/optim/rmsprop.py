"""RMSprop, PyTorch's update rule:

    g += weight_decay * p ;  v = alpha v + (1 - alpha) g^2
    centered: m = alpha m + (1 - alpha) g ;  avg = sqrt(v - m^2) + eps      else avg = sqrt(v) + eps
    momentum: b = momentum b + g / avg ;  p -= lr b                          else p -= lr g / avg
"""
from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss, grads_of


class RMSprop(Optimizer):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, *,
                 maximize=False):
        if lr < 0 or eps < 0 or momentum < 0 or weight_decay < 0 or alpha < 0:
            raise ValueError(f"RMSprop: invalid lr={lr}, alpha={alpha}, eps={eps}, weight_decay={weight_decay} or "
                             f"momentum={momentum} (all must be >= 0)")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered, maximize=maximize))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = {"step": 0, "square_avg": as_tensor(xp.zeros_like(p.array))}
        if group["momentum"] > 0:
            st["momentum_buffer"] = as_tensor(xp.zeros_like(p.array))
        if group["centered"]:
            st["grad_avg"] = as_tensor(xp.zeros_like(p.array))
        self.state[p] = st
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, alpha, eps, mom, centered = group["lr"], group["alpha"], group["eps"], group["momentum"], \
                group["centered"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group)
                w = p.array
                xp = backend.xp_of(w)
                v = st["square_avg"].array
                v *= alpha
                v += (1 - alpha) * (g * g)
                if centered:
                    m = st["grad_avg"].array
                    m *= alpha
                    m += (1 - alpha) * g
                    avg = xp.sqrt(v - m * m) + eps
                else:
                    avg = xp.sqrt(v) + eps
                if mom > 0:
                    b = st["momentum_buffer"].array
                    b *= mom
                    b += g / avg
                    w -= (lr * b).astype(w.dtype, copy=False)
                else:
                    w -= (lr * g / avg).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
