"""ASGD (averaged SGD, Polyak & Juditsky 1992), PyTorch's update rule:

    g += weight_decay * p ;  p *= 1 - lambd eta ;  p -= eta g
    ax = p while mu == 1, else ax += mu (p - ax)          (the averaged parameter)
    eta = lr / (1 + lambd lr t)^alpha ;  mu = 1 / max(1, t - t0)
with eta = lr and mu = 1 at the start. `eta` and `mu` are host floats (PyTorch keeps 0-d tensors).
"""
from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss, grads_of, reject_unsupported


class ASGD(Optimizer):
    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, foreach=None,
                 maximize=False, differentiable=False, capturable=False):
        for k, v in (("lr", lr), ("weight_decay", weight_decay)):
            if v < 0:
                raise ValueError(f"ASGD: invalid {k}={v} (must be >= 0)")
        reject_unsupported("ASGD", foreach=foreach, differentiable=differentiable, capturable=capturable)
        super().__init__(params, dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                      maximize=maximize))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = self.state[p] = {"step": 0, "eta": float(group["lr"]), "mu": 1.0, "ax": as_tensor(xp.zeros_like(p.array))}
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, lambd, alpha, t0 = group["lr"], group["lambd"], group["alpha"], group["t0"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group)
                w, ax, eta = p.array, st["ax"].array, st["eta"]
                w *= 1 - lambd * eta
                w -= (eta * g).astype(w.dtype, copy=False)
                if st["mu"] != 1:
                    ax += (w - ax) * st["mu"]
                else:
                    ax[...] = w
                t = st["step"]
                st["eta"] = lr / (1 + lambd * lr * t) ** alpha
                st["mu"] = 1 / max(1, t - t0)
                p._version[0] += 1
        return loss
