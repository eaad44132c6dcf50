"""Rprop (resilient backpropagation, Riedmiller & Braun 1993), PyTorch's update rule, elementwise:

    s = sign(g * prev) ;  step_size = clamp(step_size * (etaplus if s > 0, etaminus if s < 0, 1 if s == 0),
                                             *step_sizes)
    where s < 0 the gradient is taken as 0 (no move, and no sign change seen next step) ;  p -= sign(g) step_size
    prev = g
with step_size starting at lr. No weight decay (as PyTorch).
"""
from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss, grads_of, reject_unsupported


class Rprop(Optimizer):
    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable=False, foreach=None,
                 maximize=False, differentiable=False):
        if lr < 0:
            raise ValueError(f"Rprop: invalid lr={lr} (must be >= 0)")
        if not 0 < etas[0] < 1 < etas[1]:
            raise ValueError(f"Rprop: invalid etas={tuple(etas)} (need 0 < etaminus < 1 < etaplus)")
        reject_unsupported("Rprop", capturable=capturable, foreach=foreach, differentiable=differentiable)
        super().__init__(params, dict(lr=lr, etas=tuple(etas), step_sizes=tuple(step_sizes), maximize=maximize))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = self.state[p] = {"step": 0, "prev": as_tensor(xp.zeros_like(p.array)),
                              "step_size": as_tensor(xp.full_like(p.array, group["lr"]))}
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            (eta_minus, eta_plus), (lo, hi) = group["etas"], group["step_sizes"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group, l2=False)
                w = p.array
                xp = backend.xp_of(w)
                prev, size = st["prev"].array, st["step_size"].array
                s = xp.sign(g * prev)
                size *= xp.where(s > 0, eta_plus, xp.where(s < 0, eta_minus, 1.0)).astype(size.dtype, copy=False)
                xp.clip(size, lo, hi, out=size)
                prev[...] = xp.where(s < 0, 0, g)
                w -= (xp.sign(prev) * size).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
