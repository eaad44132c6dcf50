"""Adagrad, PyTorch's update rule:

    g += weight_decay * p ;  clr = lr / (1 + (t - 1) lr_decay) ;  s += g^2 ;  p -= clr g / (sqrt(s) + eps)
with s starting at initial_accumulator_value (the state is created with the optimizer, as PyTorch does).
"""
from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss, grads_of


class Adagrad(Optimizer):
    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, *,
                 maximize=False):
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or initial_accumulator_value < 0 or eps < 0:
            raise ValueError(f"Adagrad: invalid lr={lr}, lr_decay={lr_decay}, weight_decay={weight_decay}, "
                             f"initial_accumulator_value={initial_accumulator_value} or eps={eps} (all >= 0)")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps,
                                      maximize=maximize))
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = {"step": 0, "sum": as_tensor(xp.full(p.array.shape, group["initial_accumulator_value"],
                                              dtype=p.array.dtype))}
        self.state[p] = st
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, lr_decay, eps = group["lr"], group["lr_decay"], group["eps"]
            for p, g in grads_of(group):
                st, g = self._prepare(p, g, group)
                w = p.array
                xp = backend.xp_of(w)
                clr = lr / (1 + (st["step"] - 1) * lr_decay)
                s = st["sum"].array
                s += g * g
                w -= (clr * g / (xp.sqrt(s) + eps)).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
