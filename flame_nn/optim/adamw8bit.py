"""AdamW8bit: AdamW with both moments stored in 8 bits, block-wise quantised (as bitsandbytes' 8-bit optimizers).

Each moment is cut into blocks of `block_size` elements; a block keeps its absolute maximum in float32 and every
element as one byte: the index of the nearest value of a 256-entry non-linear "dynamic" code book (bitsandbytes'
dynamic tree map: a decimal exponent and a fraction whose precision grows with the exponent), so values from ~1e-7
to 1 of the block maximum stay representable. The signed book holds m, the unsigned one v. Per step: dequantise
to float32, run the AdamW update, requantise. State memory: ~2 bytes per parameter instead of 8.
Parameters with fewer than `min_8bit_size` elements keep float32 moments (as bitsandbytes does).
"""
import math

import numpy as np

from flame_core import as_tensor, backend

from .adam import _check
from .optimizer import Optimizer, _closure_loss, grads_of


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
        for group in self.param_groups:
            lr, (b1, b2), eps, wd, bs = group["lr"], group["betas"], group["eps"], group["weight_decay"], \
                group["block_size"]
            for p, g in grads_of(group):
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
                if wd:
                    w *= 1 - lr * wd
                denom = xp.sqrt(v) / math.sqrt(1 - b2 ** t) + eps
                w -= ((lr / (1 - b1 ** t)) * m / denom).reshape(w.shape).astype(w.dtype, copy=False)
                p._version[0] += 1
                if quantized:
                    for name, arr, book in (("exp_avg", m, sbook), ("exp_avg_sq", v, ubook)):
                        codes, absmax = quantize_blockwise(arr, book, bs)
                        st[name].set_array_(codes)
                        st[name + "_absmax"].set_array_(absmax)
        return loss
