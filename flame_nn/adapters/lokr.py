"""LoKr (LyCORIS): ΔW = s·kron(w1, w2), w1 (a, c) full, w2 (b, d) full or low-rank w2_a (b, r) @ w2_b (r, d),
with out = a·b and in = c·d from `factorization` (factor −1: the most balanced split).

w2 is low-rank while r < max(b, d)/2, else full (or always full with `full_rank`); with both factors full, alpha is
ignored and s = 1 (LyCORIS and ComfyUI agree). Init as LyCORIS: w1 and w2_a Kaiming-uniform, w2 (or w2_b) zero.
Forward without forming ΔW: with X = x viewed as (c, d) per row, kron(w1, w2)·vec(X) = vec(w1 · X · w2ᵀ).
"""
import math

import flame_core as flame

from .. import functional as F
from .. import init
from ..parameter import Parameter
from .formats import AdapterPart
from .layer import Adapter, AdapterError, adapter_input


def factorization(dimension, factor=-1):
    """(m, n) with m·n = dimension and m <= n: LyCORIS's rule. factor > 0 dividing `dimension` gives
    (factor, dimension/factor) ordered; otherwise the most balanced split whose smaller part is <= factor
    (any, for −1). 3072 -> (48, 64), 9216 -> (96, 96), 12288 -> (96, 128), 21504 -> (128, 168)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (m, n) if m <= n else (n, m)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (m, n) if m <= n else (n, m)


class LoKr(Adapter):
    kind = "lokr"

    def __init__(self, in_features, out_features, rank=16, alpha=None, factor=-1, full_rank=False, *,
                 factors=None, device=None, dtype=flame.float32, generator=None):
        super().__init__(in_features, out_features)
        if rank < 1:
            raise AdapterError(f"LoKr rank must be >= 1, got {rank}")
        if factors is None:
            a, b = factorization(self.out_features, factor)
            c, d = factorization(self.in_features, factor)
        else:  # an explicit split (a file's): out = a·b, in = c·d
            a, b, c, d = (int(f) for f in factors)
            if a * b != self.out_features or c * d != self.in_features:
                raise AdapterError(f"LoKr factors ({a}·{b}, {c}·{d}) do not give ({self.out_features}, "
                                   f"{self.in_features})")
        self.factors = (a, b, c, d)
        self.rank = int(rank)
        self.full_w2 = bool(full_rank) or self.rank >= max(b, d) / 2
        self.alpha = float(self.rank if alpha is None else alpha)
        self.lokr_w1 = Parameter(flame.empty(a, c, device=device, dtype=dtype))
        init.kaiming_uniform_(self.lokr_w1, a=math.sqrt(5), generator=generator)
        if self.full_w2:
            self.lokr_w2 = Parameter(flame.zeros(b, d, device=device, dtype=dtype))
        else:
            self.lokr_w2_a = Parameter(flame.empty(b, self.rank, device=device, dtype=dtype))
            self.lokr_w2_b = Parameter(flame.zeros(self.rank, d, device=device, dtype=dtype))
            init.kaiming_uniform_(self.lokr_w2_a, a=math.sqrt(5), generator=generator)

    @property
    def scale(self):
        return 1.0 if self.full_w2 else self.alpha / self.rank

    def _w2(self):
        return self.lokr_w2 if self.full_w2 else self.lokr_w2_a @ self.lokr_w2_b

    def delta(self, x, base_rows=None, weight_rows=None):
        a, b, c, d = self.factors
        x = adapter_input(x, self.lokr_w1)
        lead = tuple(x.shape[:-1])
        xm = x.reshape(lead + (c, d))                       # (..., c, d)
        t = F.linear(xm, self._w2())                        # (..., c, b) = X · w2ᵀ
        y = flame.matmul(self.lokr_w1 * self.scale, t)      # (..., a, b) = w1 · X · w2ᵀ
        return y.reshape(lead + (a * b,))

    def delta_weight(self):
        a, b, c, d = self.factors
        w1, w2 = self.lokr_w1, self._w2()
        # kron(w1, w2)[i·b + j, k·d + l] = w1[i, k]·w2[j, l]
        k = w1.reshape(a, 1, c, 1) * w2.reshape(1, b, 1, d)
        return k.reshape(a * b, c * d) * self.scale

    def to_part(self, rows=None):
        t = {"lokr_w1": self._host(self.lokr_w1)}
        if self.full_w2:
            t["lokr_w2"] = self._host(self.lokr_w2)
            alpha = float(self.rank)  # stored as LyCORIS does; readers ignore it (both factors full)
        else:
            t["lokr_w2_a"] = self._host(self.lokr_w2_a)
            t["lokr_w2_b"] = self._host(self.lokr_w2_b)
            alpha = self.alpha
        return AdapterPart(self.kind, t, alpha, rows)

    def load_part(self, part):
        a, b, c, d = self.factors
        shapes = {"lokr_w1": (a, c)}
        shapes.update({"lokr_w2": (b, d)} if self.full_w2 else {"lokr_w2_a": (b, self.rank),
                                                                 "lokr_w2_b": (self.rank, d)})
        self._check_load(part, shapes)
        for k in shapes:
            self._assign(getattr(self, k), part.tensors[k])
        if not self.full_w2:
            self.alpha = part.scale * self.rank

    def extra_repr(self):
        a, b, c, d = self.factors
        return (f"in={self.in_features}, out={self.out_features}, w1=({a}, {c}), w2=({b}, {d})"
                + (" full" if self.full_w2 else f" rank {self.rank}, alpha={self.alpha:g}"))
