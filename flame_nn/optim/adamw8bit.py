"""AdamW8bit: AdamW with both moments stored in 8 bits, block-wise quantised (as bitsandbytes' 8-bit optimizers).

Each moment is cut into blocks of `block_size` elements; a block keeps its absolute maximum in float32 and every
element as one byte: the index of the nearest value of a 256-entry non-linear "dynamic" code book (bitsandbytes'
dynamic tree map: a decimal exponent and a fraction whose precision grows with the exponent), so values from ~1e-7
to 1 of the block maximum stay representable. The signed book holds m, the unsigned one v. Per step: dequantise
to float32, run the AdamW update, requantise. State memory: ~2 bytes per parameter instead of 8.
Parameters with fewer than `min_8bit_size` elements keep float32 moments (as bitsandbytes does).

bfloat16 parameters (a full fine-tune without float32 weights: kohya's full_bf16) are updated in float32 and written
back with stochastic rounding (flame_core.kernels.stochastic_rounding: rounded up with probability equal to the
dropped fraction, from a hash of the step, the parameter's ordinal in the optimizer and the element), so updates far
below bfloat16's spacing still move the weights on average; round-to-nearest would drop every one of them.

On the GPU, float32 and bfloat16 parameters with block_size 256 are updated by ONE fused launch per parameter group
and step count (flame_core.kernels.adamw8bit): dequantise, update, reduce each block's absmax and requantise in
registers, with the same roundings (and random bits) as the per-operation path below, which everything else takes
(the CPU, other block sizes and parameter dtypes).
"""
import math

import numpy as np

from flame_core import as_tensor, backend
from flame_core.kernels.stochastic_rounding import to_bf16_stochastic

from . import multi_tensor as MT
from .adam import _check
from .optimizer import Optimizer, _closure_loss, grads_of

_GRAD_DTYPES = ("float32", "float16", "bfloat16")

try:
    from flame_core.kernels import adamw8bit as _fused
    from flame_core.kernels import loader as _loader
except ImportError:  # fused kernels not in this build
    _fused = None


def dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """The 256 sorted code values in [-1, 1] (signed) or [0, 1] (unsigned)."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        b = np.linspace(0.1, 1, n)
        means = (b[:-1] + b[1:]) / 2.0
        scale = 10.0 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return np.sort(np.asarray(data, dtype=np.float32))


_MAPS = {}


def _code_book(xp, signed):
    key = (xp.__name__, signed)
    book = _MAPS.get(key)
    if book is None:
        book = _MAPS[key] = xp.asarray(dynamic_map(signed))
    return book


def quantize_blockwise(x, code, block_size):
    """(codes uint8 of x.size, absmax float32 per block) for flat float32 `x` and code book `code`."""
    xp = backend.xp_of(x)
    n = x.size
    nb = -(-n // block_size)
    xb = xp.zeros(nb * block_size, dtype=np.float32)
    xb[:n] = x
    xb = xb.reshape(nb, block_size)
    absmax = xp.abs(xb).max(axis=1)
    u = xb / xp.where(absmax > 0, absmax, 1)[:, None]
    hi = xp.clip(xp.searchsorted(code, u), 0, code.size - 1)
    lo = xp.clip(hi - 1, 0, code.size - 1)
    nearest = xp.where(xp.abs(u - code[lo]) <= xp.abs(code[hi] - u), lo, hi)
    return nearest.reshape(-1)[:n].astype(np.uint8), absmax.astype(np.float32)


def dequantize_blockwise(codes, absmax, code, block_size):
    """Flat float32 values of `codes` (uint8) scaled by their block's absmax."""
    xp = backend.xp_of(codes)
    n = codes.size
    blocks = xp.arange(n) // block_size
    return code[codes.astype(np.int64)] * absmax[blocks]


class AdamW8bit(Optimizer):
    _state_keep_dtype = ("step", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, block_size=256,
                 min_8bit_size=4096):
        _check(lr, betas, eps, weight_decay)
        if block_size < 1:
            raise ValueError(f"AdamW8bit: block_size must be positive, got {block_size}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      block_size=block_size, min_8bit_size=min_8bit_size))

    def _init_state(self, p, group):
        xp = backend.xp_of(p.array)
        n = p.array.size
        st = {"step": 0}
        if n >= group["min_8bit_size"]:
            nb = -(-n // group["block_size"])
            zero_code_s = int(np.argmin(np.abs(dynamic_map(True))))
            zero_code_u = int(np.argmin(np.abs(dynamic_map(False))))
            st["exp_avg"] = as_tensor(xp.full(n, zero_code_s, dtype=np.uint8))
            st["exp_avg_absmax"] = as_tensor(xp.zeros(nb, dtype=np.float32))
            st["exp_avg_sq"] = as_tensor(xp.full(n, zero_code_u, dtype=np.uint8))
            st["exp_avg_sq_absmax"] = as_tensor(xp.zeros(nb, dtype=np.float32))
        else:
            st["exp_avg"] = as_tensor(xp.zeros(n, dtype=np.float32))
            st["exp_avg_sq"] = as_tensor(xp.zeros(n, dtype=np.float32))
        self.state[p] = st
        return st

    def step(self, closure=None):
        loss = _closure_loss(closure)
        salts = None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd, bs = group["lr"], group["betas"], group["eps"], group["weight_decay"], \
                group["block_size"]
            done = self._fused_step(group)
            for p, g in grads_of(group):
                if id(p) in done:
                    continue
                st, g = self._prepare(p, g, group, l2=False)  # AdamW's decay is decoupled (below)
                w = p.array
                xp = backend.xp_of(w)
                quantized = "exp_avg_absmax" in st
                sbook, ubook = _code_book(xp, True), _code_book(xp, False)
                if quantized:
                    m = dequantize_blockwise(st["exp_avg"].array, st["exp_avg_absmax"].array, sbook, bs)
                    v = dequantize_blockwise(st["exp_avg_sq"].array, st["exp_avg_sq_absmax"].array, ubook, bs)
                else:
                    m, v = st["exp_avg"].array, st["exp_avg_sq"].array
                gf = g.reshape(-1).astype(np.float32)
                t = st["step"]
                m *= b1
                m += (1 - b1) * gf
                v *= b2
                v += (1 - b2) * (gf * gf)
                bf16 = w.dtype.name == "bfloat16"
                w32 = w.astype(np.float32) if bf16 else w
                if wd:
                    w32 *= 1 - lr * wd
                denom = xp.sqrt(v) / math.sqrt(1 - b2 ** t) + eps
                w32 -= ((lr / (1 - b1 ** t)) * m / denom).reshape(w.shape).astype(w32.dtype, copy=False)
                if bf16:   # stochastic rounding, with the fused kernel's bits
                    salts = salts or self._salts()
                    w[...] = to_bf16_stochastic(w32, t, salts[id(p)])
                p._version[0] += 1
                if quantized:
                    for name, arr, book in (("exp_avg", m, sbook), ("exp_avg_sq", v, ubook)):
                        codes, absmax = quantize_blockwise(arr, book, bs)
                        st[name].set_array_(codes)
                        st[name + "_absmax"].set_array_(absmax)
        return loss

    # ------------------------------------------------------------------ fused GPU path
    def _fusable(self, p, g, group):
        """Whether the fused kernel can update `p` with gradient array `g` (its state, if any, in the layout
        _init_state makes, on the GPU)."""
        a = p.array
        if not (backend.is_cuda_array(a) and a.dtype.name in ("float32", "bfloat16") and a.flags.c_contiguous
                and backend.is_cuda_array(g) and g.flags.c_contiguous and g.size == a.size
                and _loader.dtype_name(g.dtype) in _GRAD_DTYPES):
            return False
        st = self.state.get(p)
        if st is None:
            return True
        quantized = a.size >= group["min_8bit_size"]
        if quantized != ("exp_avg_absmax" in st):
            return False  # state loaded from another setting: the per-operation path copes with it
        nb = -(-a.size // _fused.BLOCK)
        want = [("exp_avg", np.uint8 if quantized else np.float32, a.size),
                ("exp_avg_sq", np.uint8 if quantized else np.float32, a.size)]
        if quantized:
            want += [("exp_avg_absmax", np.float32, nb), ("exp_avg_sq_absmax", np.float32, nb)]
        for key, dt, n in want:
            v = st.get(key)
            arr = getattr(v, "array", None)
            if arr is None or not backend.is_cuda_array(arr) or arr.dtype != dt or arr.size != n \
                    or not arr.flags.c_contiguous:
                return False
        return True

    def _fused_step(self, group):
        """One fused launch per step count for the group's fusable parameters; returns the ids it updated. A
        parameter whose array, state and state arrays are the very objects seen at its last fused step skips the
        checks (`_rows`: id(param) -> what that step saw; the per-operation path replaces the state arrays, so a
        parameter it updated is checked afresh)."""
        if _fused is None or group["block_size"] != _fused.BLOCK or not _loader.enabled():
            return ()
        seen = self.__dict__.setdefault("_rows", {})
        buckets = {}
        for p, g in grads_of(group):
            a, st = p.array, self.state.get(p)
            hit = seen.get(id(p))
            if hit is not None and hit[0] is a and hit[1] is st \
                    and all(st.get(k) is t and t.array is arr for k, t, arr in hit[2]) \
                    and g.size == a.size and g.flags.c_contiguous and g.dtype.name in _GRAD_DTYPES \
                    and backend.is_cuda_array(g):
                st["step"] += 1
            else:
                seen.pop(id(p), None)
                if not self._fusable(p, g, group):
                    continue
                st, _ = self._prepare(p, g, group, l2=False)
                keys = ("exp_avg", "exp_avg_sq") + (("exp_avg_absmax", "exp_avg_sq_absmax")
                                                    if "exp_avg_absmax" in st else ())
                hit = seen[id(p)] = (a, st, tuple((k, st[k], st[k].array) for k in keys))
            buckets.setdefault(st["step"], []).append((p, g, hit))
        done = set()
        if not buckets:
            return done
        xp = backend.cupy
        sbook, ubook = _code_book(xp, True), _code_book(xp, False)
        for t, items in buckets.items():
            _fused.adamw8bit_step(self._plan(items), sbook, ubook, lr=group["lr"], beta1=group["betas"][0],
                                  beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                                  step=t)
            for p, _, _ in items:
                p._version[0] += 1
                done.add(id(p))
        return done

    def _plan(self, items):
        """The kernel's tables for these (param, grad, seen) items: cached by the parameters' and states' arrays
        (the same objects every step); the gradients' addresses are re-pointed each step (a lazy pool buffer's
        move, a graph's stay)."""
        key = tuple(id(hit) for _, _, hit in items)  # a cached plan keeps its hits alive: their ids stay unique
        plans = self.__dict__.setdefault("_plans", {})
        got = plans.get(key)
        if got is None:
            if len(plans) >= MT.tables_kept(self):  # parameter sets that keep changing: keep the newest few
                plans.pop(next(iter(plans)))
            rows = [(hit[0], g) + tuple(arr for _, _, arr in hit[2]) + ((None, None) if len(hit[2]) == 2 else ())
                    for _, g, hit in items]
            salts = self._salts()
            got = plans[key] = ([hit for _, _, hit in items],
                                _fused.adamw8bit_table(rows, salts=[salts[id(p)] for p, _, _ in items]))
        else:
            got[1].set_grads([g for _, g, _ in items])
        return got[1]
