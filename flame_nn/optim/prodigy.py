"""Prodigy (prodigyopt's `Prodigy`, its arguments and defaults; Mishchenko & Defazio 2023): Adam whose step size
D is estimated on the fly from the distance travelled from the initial point.

With dlr = d * lr * bias_correction and, per parameter, p0 its initial value and s a running sum:
    num = beta3 num + (d / d0) dlr <g, p0 - p> ;  m = b1 m + d (1 - b1) g ;  v = b2 v + d^2 (1 - b2) g^2
    s = beta3 s + (d / d0) dlr g            (d / d0 * d with safeguard_warmup)
    d_hat = d_coef num / sum|s| ;  d = min(max(d, d_hat) -> d_max, d * growth_rate)
    p -= dlr * m / (sqrt(v) + d eps)        (p *= 1 - decay dlr first with decoupled weight decay)
The estimate (d, d_max, d_numerator, k, ...) lives in the parameter groups, as in the reference. Sharded (fsdp)
estimates are not supported here: FLAME's data-parallel ranks hold whole parameters.
On the GPU a step whose parameters are all float32 in one group (slice_p 1, beta1 > 0, decoupled or no weight
decay) takes two launches (flame_core.kernels.optim_multi: the moments and the two sums, then the weights) and one
synchronisation for the sums; everything else the per-operation path below.
"""
import math

from flame_core import as_tensor, backend

from . import multi_tensor as MT
from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device

RUNNING_KEYS = ("d", "d_max", "d_numerator", "d_denom", "d_hat", "k")


class Prodigy(Optimizer):
    running_keys = RUNNING_KEYS
    per_parameter = False  # (see Optimizer.per_parameter)

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0.0, decouple=True,
                 use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float("inf"),
                 fsdp_in_use=False, slice_p=1):
        if not 0.0 < d0:
            raise ValueError(f"Prodigy: invalid d0 value: {d0}")
        if not 0.0 < lr:
            raise ValueError(f"Prodigy: invalid learning rate: {lr}")
        if not 0.0 < eps:
            raise ValueError(f"Prodigy: invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Prodigy: invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Prodigy: invalid beta parameter at index 1: {betas[1]}")
        if fsdp_in_use:
            raise ValueError("Prodigy: fsdp_in_use is not supported (FLAME does not shard parameters across ranks)")
        if int(slice_p) != slice_p or slice_p < 1:
            raise ValueError(f"Prodigy: slice_p must be an integer >= 1, got {slice_p}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), beta3=beta3, eps=eps, weight_decay=weight_decay,
                                      d=d0, d0=d0, d_max=d0, d_numerator=0.0, d_coef=d_coef, k=0,
                                      growth_rate=growth_rate, use_bias_correction=use_bias_correction,
                                      decouple=decouple, safeguard_warmup=safeguard_warmup, fsdp_in_use=False,
                                      slice_p=int(slice_p)))
        self.d0 = d0

    def _fused_rows(self, b1):
        """The kernel rows (param, grad, p0 or None, exp_avg, exp_avg_sq, s) of a step the kernels can take whole,
        with the params, or None."""
        if not MT.enabled() or len(self.param_groups) != 1:
            return None
        group = self.param_groups[0]
        if group["slice_p"] != 1 or b1 <= 0 or (group["weight_decay"] != 0 and not group["decouple"]) \
                or group["lr"] <= 0:
            return None
        rows, params = [], []
        for p, g in grads_of(group):
            a = p.array
            if not MT.fusable(a, g):
                return None
            st = self.state.get(p)
            st = self._init_state(p, b1, 1) if st is None else state_on_device(st, p)
            p0 = st["p0"].array
            p0 = None if p0.ndim == 0 else p0  # an all-zero initial point: the kernel reads zeros
            m, v, sg = st["exp_avg"].array, st["exp_avg_sq"].array, st["s"].array
            if not all(MT.usable(x, a.size) for x in (m, v, sg)) or not (p0 is None or MT.usable(p0, a.size)):
                return None
            rows.append((a, g, p0, m, v, sg))
            params.append(p)
        return (rows, params) if rows else None

    def _fused_step(self, b1, b2, beta3, d, dlr, d_numerator):
        """The whole step through the kernels when they can take it (returns True), else False (nothing done)."""
        got = self._fused_rows(b1)
        if got is None:
            return False
        rows, params = got
        group = self.param_groups[0]
        d0 = group["d0"]
        table = MT.table_of(self, rows)
        dot, d_denom = MT.kernels.prodigy_stats(table, beta1=b1, m_coef=d * (1 - b1), beta2=b2,
                                                v_coef=d * d * (1 - b2), beta3=beta3,
                                                s_coef=(d / d0) * (d if group["safeguard_warmup"] else dlr))
        if d_denom == 0:  # no gradient (or an all-zero one): the reference returns without a step
            return True
        global_d_numerator = d_numerator + (d / d0) * dlr * dot
        d_hat = group["d_coef"] * global_d_numerator / d_denom
        d_max = group["d_max"]
        if d == d0:
            d = max(d, d_hat)
        d_max = max(d_max, d_hat)
        d = min(d_max, d * group["growth_rate"])
        group.update(d_numerator=global_d_numerator, d_denom=d_denom, d=d, d_max=d_max, d_hat=d_hat)
        decay = group["weight_decay"]
        MT.kernels.prodigy_update(table, dlr=dlr, d_eps=d * group["eps"], decay=1 - decay * dlr if decay else 1.0)
        for p in params:
            self.state[p]["step"] += 1
        MT.stepped(params)
        group["k"] = group["k"] + 1
        return True

    def _init_state(self, p, b1, slice_p):
        w = p.array
        xp = backend.xp_of(w)
        flat = w.reshape(-1)[::slice_p]
        st = {"step": 0, "s": as_tensor(xp.zeros_like(flat)),
              # an all-zero parameter keeps a scalar zero (the reference saves the memory the same way)
              "p0": as_tensor(flat.copy() if bool(xp.any(w)) else xp.zeros((), w.dtype)),
              "exp_avg_sq": as_tensor(xp.zeros_like(w))}
        if b1 > 0:
            st["exp_avg"] = as_tensor(xp.zeros_like(w))
        self.state[p] = st
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        beta3 = group["beta3"] if group["beta3"] is not None else math.sqrt(b2)
        k, d, d_max, d_coef = group["k"], group["d"], group["d_max"], group["d_coef"]
        lr = max(g["lr"] for g in self.param_groups)
        bias_correction = ((1 - b2 ** (k + 1)) ** 0.5) / (1 - b1 ** (k + 1)) if group["use_bias_correction"] else 1
        dlr = d * lr * bias_correction
        growth_rate = group["growth_rate"]
        d_numerator = group["d_numerator"] * beta3
        if self._fused_step(b1, b2, beta3, d, dlr, d_numerator):
            return loss
        delta_numerator, d_denom = 0.0, 0.0
        grads = {}
        for group in self.param_groups:
            decay, group_lr, d0, slice_p = group["weight_decay"], group["lr"], group["d0"], group["slice_p"]
            if group_lr not in (lr, 0.0):
                raise RuntimeError("Prodigy: different lr values in different parameter groups are only supported "
                                   "for values of 0")
            for p, g in grads_of(group):
                w = p.array
                if decay != 0 and not group["decouple"]:
                    g = g + decay * w  # coupled (L2) weight decay
                grads[id(p)] = g
                st = self.state.get(p)
                st = self._init_state(p, b1, slice_p) if st is None else state_on_device(st, p)
                if group_lr > 0.0:
                    xp = backend.xp_of(w)
                    sg = g.reshape(-1)[::slice_p]
                    diff = st["p0"].array - w.reshape(-1)[::slice_p]
                    delta_numerator += (d / d0) * dlr * float(xp.dot(sg, diff) if diff.ndim else xp.sum(sg * diff))
                    if b1 > 0:
                        m = st["exp_avg"].array
                        m *= b1
                        m += (d * (1 - b1)) * g
                    v = st["exp_avg_sq"].array
                    v *= b2
                    v += (d * d * (1 - b2)) * (g * g)
                    s = st["s"].array
                    s *= beta3
                    s += ((d / d0) * (d if group["safeguard_warmup"] else dlr)) * sg
                    d_denom += float(xp.abs(s).sum())
        d_hat = d
        if d_denom == 0:  # no gradient (or an all-zero one): the reference returns without a step
            return loss
        global_d_numerator, global_d_denom = d_numerator + delta_numerator, d_denom
        if lr > 0.0:
            d_hat = d_coef * global_d_numerator / global_d_denom
            if d == group["d0"]:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * growth_rate)
        for group in self.param_groups:
            group.update(d_numerator=global_d_numerator, d_denom=global_d_denom, d=d, d_max=d_max, d_hat=d_hat)
            decay, eps = group["weight_decay"], group["eps"]
            for p, _ in grads_of(group):
                g = grads[id(p)]
                st = self.state[p]
                w = p.array
                xp = backend.xp_of(w)
                st["step"] += 1
                denom = xp.sqrt(st["exp_avg_sq"].array) + d * eps
                if decay != 0 and group["decouple"]:
                    w *= 1 - decay * dlr
                upd = dlr * st["exp_avg"].array / denom if b1 > 0 else (dlr * d) * g / denom
                w -= upd.astype(w.dtype, copy=False)
                p._version[0] += 1
            group["k"] = group["k"] + 1
        return loss


