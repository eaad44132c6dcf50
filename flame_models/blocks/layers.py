"""DiT layers shared by Flux and SD3 (BFL's / SAI's names, so parameter names equal checkpoint keys)."""
import math

import flame_core as flame
import flame_nn
import flame_nn.functional as F

from .ops import norm_modulate


def timestep_embedding(t, dim, max_period=10_000, time_factor=1000.0):
    """Sinusoidal embedding (B, dim) of times t (B,) in [0, 1]: [cos(1000 t f), sin(1000 t f)], f_i =
    max_period^(-i/half); frequencies in float32 (float64 for float64 t), the result in t's dtype (the x1000
    happens in t's dtype, as BFL)."""
    t = time_factor * t
    half = dim // 2
    cd = flame.float64 if t.dtype == flame.float64 else flame.float32
    freqs = (-math.log(max_period) * flame.arange(half, dtype=cd, device=t.device) / half).exp()
    args = t[:, None].to(cd) * freqs[None]                                  # (B, half)
    emb = flame.cat([args.cos(), args.sin()], dim=-1)
    if dim % 2:
        emb = flame.cat([emb, flame.zeros_like(emb[:, :1])], dim=-1)
    return emb.to(t.dtype) if t.dtype.is_floating_point else emb


def modulation_chunks(mods, n):
    """(B, n*H) -> n vectors (B, H); for one sample n vectors (H,), which broadcast over the tokens and let the
    adaLN modulation run inside the fused LayerNorm."""
    if mods.shape[0] == 1:
        mods = mods.reshape(-1)
    H = mods.shape[-1] // n
    return mods.split([H] * n, dim=-1)


class LastLayer(flame_nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.linear = flame_nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True, **kw)
        self.adaLN_modulation = flame_nn.Sequential(
            flame_nn.SiLU(), flame_nn.Linear(hidden_size, 2 * hidden_size, bias=True, **kw))

    def forward(self, x, vec):
        shift, scale = modulation_chunks(self.adaLN_modulation[1](F.silu(vec)), 2)  # BFL order: (shift, scale)
        return self.linear(norm_modulate(x, shift, scale))
