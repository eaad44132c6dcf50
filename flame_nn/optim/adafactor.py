"""Adafactor (transformers.optimization.Adafactor, its arguments and defaults; Shazeer & Stern 2018): factored
second moments (row and column means for parameters of 2+ dimensions), update clipping by its RMS, and a relative
step size when `relative_step`.

    beta2t = 1 - step^decay_rate ;  v_row, v_col (or v) = beta2t v + (1 - beta2t) (g^2 + eps1), means over the
    last / second-to-last dimension ;  u = g * rsqrt(v_row / mean(v_row))[..., None] * rsqrt(v_col)[..., None, :]
    u /= max(1, rms(u) / clip_threshold) ;  u *= lr_t ;  m = b1 m + (1 - b1) u (with beta1) ;  p -= lr_t wd p + u
lr_t = max(eps2, rms(p)) * (min(1e-2 or 1e-6 step, 1/sqrt(step)) when relative_step, else lr); without
scale_parameter the max(eps2, rms(p)) factor is 1. Use an external schedule with relative_step=False and lr set.
bfloat16 parameters (a full fine-tune's train.full_bf16) are updated in float32 and written back with stochastic
rounding (flame_core.kernels.stochastic_rounding; seed: the step, salt: the parameter's ordinal), as AdamW8bit does.
On the GPU the float32 and bfloat16 parameters of a group take four launches per step (flame_core.kernels.optim_multi:
the sums, the factors, the update's RMS, the update; the sums in another order than the per-operation path, and
rsqrt for 1 / sqrt; a bfloat16 weight rounded with the same bits): matrices, vectors, and parameters of more
dimensions whose last two are at most 16 (convolution kernels); the rest (float16 weights, wider trailing
dimensions) the per-operation path. There the state's "RMS" is a 0-d tensor on the GPU.
"""
import math

import numpy as np

from flame_core import as_tensor, backend
from flame_core.kernels.stochastic_rounding import to_bf16_stochastic

from . import multi_tensor as MT
from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device


class Adafactor(Optimizer):
    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        if lr is not None and relative_step:
            raise ValueError("Adafactor: cannot combine manual `lr` and `relative_step=True` options")
        if warmup_init and not relative_step:
            raise ValueError("Adafactor: `warmup_init=True` requires `relative_step=True`")
        if lr is None and not relative_step:
            raise ValueError("Adafactor: `relative_step=False` needs an `lr`")
        if len(eps) != 2:
            raise ValueError(f"Adafactor: eps must be two numbers (square-gradient, parameter-scale), got {eps}")
        super().__init__(params, dict(lr=lr, eps=tuple(eps), clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init))

    @staticmethod
    def _get_lr(group, state):
        rel = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
            rel = min(min_step, 1.0 / math.sqrt(state["step"]))
        scale = max(group["eps"][1], state["RMS"]) if group["scale_parameter"] else 1.0
        return scale * rel

    @staticmethod
    def _rms(xp, a):
        return float(xp.sqrt(xp.sum(a * a)) / math.sqrt(a.size))

    def step(self, closure=None):
        loss = _closure_loss(closure)
        salts = None   # (the parameters' ordinals, built once a step when a bfloat16 one needs them)
        for group in self.param_groups:
            done = self._fused_step(group)
            for p, g in grads_of(group):
                if id(p) in done:
                    continue
                w = p.array
                xp = backend.xp_of(w)
                # half gradients and parameters are computed in float32, as the reference does
                work = np.float32 if w.dtype.itemsize < 4 else w.dtype
                g = g.astype(work, copy=False)
                factored, first = g.ndim >= 2, group["beta1"] is not None
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"step": 0, "RMS": 0.0}
                    if first:
                        st["exp_avg"] = as_tensor(xp.zeros(g.shape, work))
                    if factored:
                        st["exp_avg_sq_row"] = as_tensor(xp.zeros(g.shape[:-1], work))
                        st["exp_avg_sq_col"] = as_tensor(xp.zeros(g.shape[:-2] + g.shape[-1:], work))
                    else:
                        st["exp_avg_sq"] = as_tensor(xp.zeros(g.shape, work))
                st = state_on_device(st, p)
                w32 = w.astype(work, copy=False)
                st["step"] += 1
                st["RMS"] = self._rms(xp, w32)
                lr = self._get_lr(group, st)
                beta2t = 1.0 - math.pow(st["step"], group["decay_rate"])
                u = g * g + group["eps"][0]
                if factored:
                    row, col = st["exp_avg_sq_row"].array, st["exp_avg_sq_col"].array
                    row *= beta2t
                    row += (1.0 - beta2t) * u.mean(axis=-1)
                    col *= beta2t
                    col += (1.0 - beta2t) * u.mean(axis=-2)
                    r = (1 / xp.sqrt(row / row.mean(axis=-1, keepdims=True)))[..., None]
                    c = (1 / xp.sqrt(col))[..., None, :]
                    u = r * c * g
                else:
                    v = st["exp_avg_sq"].array
                    v *= beta2t
                    v += (1.0 - beta2t) * u
                    u = g / xp.sqrt(v)
                u = u / max(self._rms(xp, u) / group["clip_threshold"], 1.0)
                u = u * lr
                if first:
                    m = st["exp_avg"].array
                    m *= group["beta1"]
                    m += (1 - group["beta1"]) * u
                    u = m
                new = w32 * (1 - group["weight_decay"] * lr) if group["weight_decay"] else w32.copy()
                new -= u
                if w.dtype.name == "bfloat16":   # stochastic rounding: updates below bf16's spacing still land
                    salts = salts or self._salts()
                    w[...] = to_bf16_stochastic(new, st["step"], salts[id(p)])
                else:
                    w[...] = new.astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss

    def _fused_step(self, group):
        """Four launches per step count for the group's float32 / bfloat16 GPU parameters the kernels take
        (optim_multi.adafactor_kind); returns the ids it updated."""
        if not MT.enabled():
            return ()
        first = group["beta1"] is not None
        buckets, salts = {}, None
        for p, g in grads_of(group):
            a = p.array
            kind = MT.kernels.adafactor_kind(a.shape)
            if kind is None or a.size == 0 or not MT.fusable(a, g, param_dtypes=("float32", "bfloat16")):
                continue
            factored = kind != "unfactored"
            xp = backend.xp_of(a)
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = {"step": 0, "RMS": 0.0}
                if factored:
                    st["exp_avg_sq_row"] = as_tensor(xp.zeros(a.shape[:-1], np.float32))
                    st["exp_avg_sq_col"] = as_tensor(xp.zeros(a.shape[:-2] + a.shape[-1:], np.float32))
                else:
                    st["exp_avg_sq"] = as_tensor(xp.zeros(a.shape, np.float32))
                if first:
                    st["exp_avg"] = as_tensor(xp.zeros(a.shape, np.float32))
            st = state_on_device(st, p)
            m = st.get("exp_avg")
            v = st.get("exp_avg_sq_row" if factored else "exp_avg_sq")
            col = st.get("exp_avg_sq_col") if factored else None
            arrays = [x.array if x is not None else None for x in (m, v, col)]
            if (first and not MT.usable(arrays[0], a.size)) \
                    or not MT.usable(arrays[1], a.size // a.shape[-1] if factored else a.size) \
                    or (factored and not MT.usable(arrays[2], a.size // a.shape[-2])):
                continue
            salt = 0
            if a.dtype.name == "bfloat16":   # stochastic rounding with the per-operation path's bits
                salts = salts or self._salts()
                salt = salts[id(p)]
            buckets.setdefault(st["step"] + 1, []).append(
                (p, salt, (a, g, arrays[0] if first else None, arrays[1], arrays[2])))
        done = set()
        for step, items in buckets.items():
            table = MT.table_of(self, [row for _, _, row in items],
                                lambda rows, row_salts=[s for _, s, _ in items]:
                                MT.kernels.adafactor_table(rows, row_salts))
            rel = group["lr"]
            if group["relative_step"]:
                rel = min(1e-6 * step if group["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
            MT.kernels.adafactor_step(table, eps1=group["eps"][0], beta2t=1.0 - math.pow(step, group["decay_rate"]),
                                      eps2=group["eps"][1], rel=rel, scale_parameter=group["scale_parameter"],
                                      clip_threshold=group["clip_threshold"], beta1=group["beta1"],
                                      weight_decay=group["weight_decay"], seed=step)
            for t, (p, _, _) in enumerate(items):
                st = self.state[p]
                st["step"] = step
                st["RMS"] = as_tensor(table.rms(t))
            done |= MT.stepped([p for p, _, _ in items])
        return done
