"""A tiny model with the shapes that matter: a fused qkv Linear (split by a NameMap), a plain Linear, a bias-free
one."""

import flame_core as flame
from flame_nn.adapters.formats import NameMap
from flame_nn.layers.linear import Linear
from flame_nn.module import Module

D_IN, D_QKV = 12, 24


class Tiny(Module):
    def __init__(self, dtype=flame.float64, device=None):
        super().__init__()
        self.qkv = Linear(D_IN, D_QKV, dtype=dtype, device=device)          # rows q | k | v, 8 each
        self.proj = Linear(D_QKV, D_IN, dtype=dtype, device=device)
        self.out = Linear(D_IN, 16, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out(self.proj(self.qkv(x)).tanh())


TINY_MAP = NameMap({"qkv": [("attn.to_q", [(0, 8)]), ("attn.to_k", [(8, 16)]), ("attn.to_v", [(16, 24)])],
                    "proj": [("attn.to_out.0", [(0, D_IN)])]})


def randomize(params, rng, scale=0.3):
    """Give adapter parameters non-zero values (B starts at zero, which would hide every bug)."""
    for p in params:
        with flame.no_grad():
            p.copy_(flame.tensor(rng.standard_normal(tuple(p.shape)) * scale + (1.0 if p.ndim == 1 else 0.0),
                                 dtype=p.dtype, device=p.device))
