"""What Chroma adds to Flux's blocks (flame_models.bfl.layers, which it uses without their modulation Linears): the
approximator (`distilled_guidance_layer`) that makes every modulation vector from the timestep, its input table, and
the last layer modulated by two of those vectors. Names follow the Chroma checkpoints (lodestone's flow)."""
import math

import flame_core as flame
import flame_nn
import flame_nn.functional as F

from ..bfl.layers import RMSNorm, given_modulation
from ..bfl.ops import norm_modulate


def sinusoid(x, dim):
    """[cos(x f), sin(x f)] (B, dim) with f_i = exp(-ln(10000) i / (dim/2)), in float32 (float64 for float64 x)."""
    half = dim // 2
    cd = flame.float64 if x.dtype == flame.float64 else flame.float32
    freqs = (-math.log(10_000) * flame.arange(half, dtype=cd, device=x.device) / half).exp()
    args = x.to(cd)[:, None] * freqs[None]
    return flame.cat([args.cos(), args.sin()], dim=-1)


def approximator_input(timesteps, n_rows, in_dim=64, guidance=None):
    """The approximator's input (B, n_rows, in_dim): for row r, [ts(1000 t, in_dim/4) | ts(1000 g, in_dim/4) |
    ts(1000 r, in_dim/2)], t in [0, 1] (cast to its dtype before the x1000, as diffusers), g the distilled guidance
    (0 by default: Chroma1 is trained with none; diffusers always passes 0). In t's dtype."""
    B, q = timesteps.shape[0], in_dim // 4
    dtype = timesteps.dtype
    g = flame.zeros(B, dtype=dtype, device=timesteps.device) if guidance is None else guidance.to(dtype)
    tg = flame.cat([sinusoid(timesteps * 1000, q), sinusoid(g * 1000, q)], dim=-1).to(dtype)       # (B, in/2)
    rows = sinusoid(flame.arange(n_rows, dtype=flame.float32, device=timesteps.device) * 1000, 2 * q)
    rows = rows.to(dtype)                                                                           # (n, in/2)
    return flame.cat([tg[:, None].expand(B, n_rows, 2 * q), rows[None].expand(B, n_rows, 2 * q)], dim=-1)


class ApproximatorLayer(flame_nn.Module):
    """Linear -> SiLU -> Linear (lodestone's MLPEmbedder: in_layer, out_layer)."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.in_layer = flame_nn.Linear(dim, dim, bias=True, dtype=dtype, device=device)
        self.out_layer = flame_nn.Linear(dim, dim, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class Approximator(flame_nn.Module):
    """in_proj, then `layers` residual MLPs each after an RMS norm (learnable `scale`, eps 1e-6), then out_proj:
    (B, rows, in_dim) -> (B, rows, hidden). Rows do not mix."""

    def __init__(self, in_dim, hidden_dim, out_dim, n_layers, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.in_proj = flame_nn.Linear(in_dim, hidden_dim, bias=True, **kw)
        self.layers = flame_nn.ModuleList(ApproximatorLayer(hidden_dim, **kw) for _ in range(n_layers))
        self.norms = flame_nn.ModuleList(RMSNorm(hidden_dim, **kw) for _ in range(n_layers))
        self.out_proj = flame_nn.Linear(hidden_dim, out_dim, bias=True, **kw)

    def forward(self, x):
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x).to(x.dtype))
        return self.out_proj(x)


class ChromaLastLayer(flame_nn.Module):
    """x = linear(mod(LN0(x); shift, scale)) with (shift, scale) = the approximator's last two rows (B, 2, H)."""

    def __init__(self, hidden_size, out_channels, dtype=None, device=None):
        super().__init__()
        self.linear = flame_nn.Linear(hidden_size, out_channels, bias=True, dtype=dtype, device=device)

    def forward(self, x, mods):
        shift, scale = given_modulation(mods, 2)
        return self.linear(norm_modulate(x, shift, scale))
