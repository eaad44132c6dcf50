"""Lion (lion-pytorch's `Lion`, its arguments and defaults): the sign of an interpolated momentum is the update.

    p *= 1 - lr * wd                      (wd / initial lr with decoupled_weight_decay)
    p -= lr * sign(b1 m + (1 - b1) g)
    m  = b2 m + (1 - b2) g

On the GPU the float32 parameters of a group take one launch per step (flame_core.kernels.optim_multi, the same
roundings); the rest the per-operation path below.
"""
from flame_core import as_tensor, backend

from . import multi_tensor as MT
from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device


class Lion(Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, decoupled_weight_decay=False):
        if not lr > 0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if len(betas) != 2 or not all(0 <= b <= 1 for b in betas):
            raise ValueError(f"Lion: betas must be two numbers in [0, 1], got {betas}")
        if weight_decay < 0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        self._init_lr = lr  # the reference divides weight_decay by the constructor's lr when decoupled
        self.decoupled_wd = decoupled_weight_decay
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            if self.decoupled_wd:
                wd = wd / self._init_lr
            done = self._fused_step(group, lr, b1, b2, wd)
            for p, g in grads_of(group):
                if id(p) in done:
                    continue
                w = p.array
                xp = backend.xp_of(w)
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"exp_avg": as_tensor(xp.zeros_like(w))}
                m = state_on_device(st, p)["exp_avg"].array
                if wd:
                    w *= 1 - lr * wd
                update = xp.sign(m * b1 + g * (1 - b1))
                w -= (lr * update).astype(w.dtype, copy=False)
                m *= b2
                m += (1 - b2) * g
                p._version[0] += 1
        return loss

    def _fused_step(self, group, lr, b1, b2, wd):
        """One launch for the group's float32 GPU parameters; returns the ids it updated."""
        if not MT.enabled():
            return ()
        rows, params = MT.gather(self, group, ("exp_avg",), lambda a: {"exp_avg": backend.xp_of(a).zeros_like(a)})
        if not rows:
            return ()
        MT.kernels.lion_step(MT.table_of(self, rows), lr=lr, beta1=b1, beta2=b2, decay=1 - lr * wd if wd else 1.0)
        return MT.stepped(params)
