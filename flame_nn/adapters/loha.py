"""LoHa (LyCORIS): ΔW = s·(W1a·W1b) ⊙ (W2a·W2b), Hadamard product of two rank-r products (effective rank up to r²).
s = α/r. Init as LyCORIS: W1a ~ N(0, 0.1²), W1b, W2b ~ N(0, 1), W2a = 0 (ΔW = 0 at the start)."""
import flame_core as flame

from .. import functional as F
from .. import init
from ..parameter import Parameter
from .formats import AdapterPart
from .layer import Adapter, AdapterError, adapter_input


class LoHa(Adapter):
    kind = "loha"

    def __init__(self, in_features, out_features, rank=16, alpha=None, *, device=None, dtype=flame.float32,
                 generator=None):
        super().__init__(in_features, out_features)
        if rank < 1:
            raise AdapterError(f"LoHa rank must be >= 1, got {rank}")
        self.rank = int(rank)
        self.alpha = float(self.rank if alpha is None else alpha)
        o, i, r = self.out_features, self.in_features, self.rank
        self.hada_w1_a = Parameter(flame.empty(o, r, device=device, dtype=dtype))
        self.hada_w1_b = Parameter(flame.empty(r, i, device=device, dtype=dtype))
        self.hada_w2_a = Parameter(flame.zeros(o, r, device=device, dtype=dtype))
        self.hada_w2_b = Parameter(flame.empty(r, i, device=device, dtype=dtype))
        init.normal_(self.hada_w1_a, std=0.1, generator=generator)
        init.normal_(self.hada_w1_b, std=1.0, generator=generator)
        init.normal_(self.hada_w2_b, std=1.0, generator=generator)

    @property
    def scale(self):
        return self.alpha / self.rank

    def delta_weight(self):
        return (self.hada_w1_a @ self.hada_w1_b) * (self.hada_w2_a @ self.hada_w2_b) * self.scale

    def delta(self, x, base_rows=None, weight_rows=None):
        return F.linear(adapter_input(x, self.hada_w1_a), self.delta_weight())

    _NAMES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")

    def to_part(self, rows=None):
        return AdapterPart(self.kind, {k: self._host(getattr(self, k)) for k in self._NAMES}, self.alpha, rows)

    def load_part(self, part):
        o, i, r = self.out_features, self.in_features, self.rank
        shapes = dict(zip(self._NAMES, ((o, r), (r, i), (o, r), (r, i))))
        self._check_load(part, shapes)
        for k in self._NAMES:
            self._assign(getattr(self, k), part.tensors[k])
        self.alpha = part.scale * self.rank

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"
