"""Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay), PyTorch's update rule:

    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2          (v_max = max(v_max, v) with amsgrad)
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
AdamW first scales p by (1 - lr * weight_decay).

On the GPU, AdamW updates float32 parameters whose gradients live in a gradient-pool flat buffer with ONE fused
launch per buffer (flame_core.kernels.adamw): the moments are flat float32 buffers parallel to the gradient buffer
and each parameter's `exp_avg` / `exp_avg_sq` state tensor is a view into them. Everything else (cpu, half
parameters, amsgrad, maximize, Adam's L2 decay) takes the per-parameter path, which computes the same formulas.
"""
import math

import numpy as np

from flame_core import as_tensor, backend
from flame_core.io import convert

from .optimizer import Optimizer, _closure_loss, grads_of, pool

try:
    from flame_core.kernels import adamw as _fused
    from flame_core.kernels import loader as _loader
except ImportError:  # fused kernels not in this build
    _fused = None


def _check(lr, betas, eps, weight_decay):
    if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                         f"weight_decay={weight_decay}")


class Adam(Optimizer):
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False):
        _check(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        st = {"step": 0, "exp_avg": as_tensor(xp.zeros_like(p.array)), "exp_avg_sq": as_tensor(xp.zeros_like(p.array))}
        if group["amsgrad"]:
            st["max_exp_avg_sq"] = as_tensor(xp.zeros_like(p.array))
        self.state[p] = st
        return st

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._flat = {}  # the loaded state tensors are not views of the old flat moments

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            wd, amsgrad = group["weight_decay"], group["amsgrad"]
            done = self._fused_step(group)
            for p, g in grads_of(group):
                if id(p) in done:
                    continue
                st, g = self._prepare(p, g, group, l2=not self._decoupled)
                w = p.array
                xp = backend.xp_of(w)
                t = st["step"]
                if wd and self._decoupled:
                    w *= 1 - lr * wd
                m, v = st["exp_avg"].array, st["exp_avg_sq"].array
                m *= b1
                m += (1 - b1) * g
                v *= b2
                v += (1 - b2) * (g * g)
                bc1, bc2_sqrt = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
                if amsgrad:
                    vmax = st["max_exp_avg_sq"].array
                    xp.maximum(vmax, v, out=vmax)
                    v = vmax
                denom = xp.sqrt(v) / bc2_sqrt + eps
                w -= ((lr / bc1) * m / denom).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss


    # ------------------------------------------------------------------ fused GPU path (AdamW)
    def _fused_step(self, group):
        """One fused launch per gradient-pool buffer; returns the ids of the parameters it updated."""
        if not (self._decoupled and _fused is not None and pool is not None) or group["amsgrad"] or \
                group["maximize"]:
            return ()
        buckets = {}
        for p in group["params"]:
            g = p._grad
            a = p.array
            if g is None or not backend.is_cuda_array(a) or a.dtype != np.float32 or not a.flags.c_contiguous \
                    or not pool.is_registered(p):
                continue
            buf = pool.buffer_of(p)
            if not buf.resident:
                continue  # a lazy buffer without storage: .grad was set by the user, not the pooled view
            flat = buf.tensor
            off, _ = pool.slice_of(p)
            if g.array.data.ptr != flat.array.data.ptr + off * flat.array.itemsize:
                continue  # .grad was replaced by the user: not the pooled view
            st = self.state.get(p)
            step = st["step"] if st is not None else 0
            buckets.setdefault((id(buf), step), (buf, step, []))[2].append((p, off))
        done = set()
        for buf, step, items in buckets.values():
            flat = buf.tensor
            if not _loader.use_kernel(flat.array):
                return done
            m, v = self._flat_moments(buf, items)
            plan = self._plan(buf, items)
            t = step + 1
            _fused.adamw_step(plan, flat.array, m, v, lr=group["lr"], beta1=group["betas"][0],
                              beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"], step=t)
            for p, _ in items:
                self.state[p]["step"] = t
                p._version[0] += 1
                done.add(id(p))
        return done

    def _flat_moments(self, buf, items):
        """Flat fp32 moments parallel to gradient buffer `buf` (a grad_pool FlatBuffer: keyed by it, not by its
        storage, which a lazy buffer allocates afresh each step); each parameter's state becomes views into them."""
        cache = self.__dict__.setdefault("_flat", {})
        entry = cache.get(id(buf))
        if entry is None or entry[0] is not buf:
            xp = backend.xp_of(buf.tensor.array)
            with buf.device.context():
                entry = cache[id(buf)] = (buf, xp.zeros(buf.numel, np.float32), xp.zeros(buf.numel, np.float32), {})
        _, m, v, plans = entry
        for p, off in items:
            n = p.array.size
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = {"step": 0, "exp_avg": as_tensor(m[off:off + n].reshape(p.array.shape)),
                                      "exp_avg_sq": as_tensor(v[off:off + n].reshape(p.array.shape))}
                m[off:off + n] = 0
                v[off:off + n] = 0
                continue
            for key, moment in (("exp_avg", m), ("exp_avg_sq", v)):
                cur = st[key].array
                if backend.is_cuda_array(cur) and cur.data.ptr == moment.data.ptr + off * 4:
                    continue
                view = moment[off:off + n]
                view[...] = convert(cur, np.float32, p.device)[0].reshape(-1)
                st[key] = as_tensor(view.reshape(p.array.shape))
        return m, v

    def _plan(self, buf, items):
        """The kernel's chunk table for these parameters (rebuilt when a parameter's storage moved)."""
        plans = self._flat[id(buf)][3]
        key = tuple(id(p) for p, _ in items)
        ptrs = tuple(p.array.data.ptr for p, _ in items)
        hit = plans.get(key)
        if hit is None or hit[0] != ptrs:
            hit = plans[key] = (ptrs, _fused.adamw_plan([p.array for p, _ in items], [o for _, o in items]))
        return hit[1]


class AdamW(Adam):
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
