"""The tensor ops of an MMDiT beyond Flux's (which it shares: flame_models.flux.ops -- fused adaLN LayerNorm, gated
residual, QK RMS-norm; and flame_core's fused SiLU, GELU(tanh) and one-node split / unbind): attention without RoPE,
patchify / unpatchify in SAI's (ph, pw, c) feature order, and the 2-D sin-cos position table with its centre crop."""
import numpy as np

import flame_core as flame
import flame_nn.functional as F
from flame_core.ops.activation import silu  # noqa: F401
from flame_core.ops.modulation import gated_residual  # noqa: F401
from flame_core.ops.shape import split, unbind  # noqa: F401

from ..blocks.ops import joint_qk_norm, norm_modulate, qk_norm  # noqa: F401


def attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v: q, k, v (B, L, heads, D) -> (B, L, heads*D). The heads stay in the layout the
    qkv projection produced: attention reads (B, heads, L, D) strided views and its output is viewed back."""
    B, L, Hh, D = q.shape
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, heads, L, D)
    return o.transpose(1, 2).reshape(B, L, Hh * D)


def patchify(x, p):
    """Latents (B, C, H, W) -> patches (B, H/p * W/p, C*p*p), row-major patches, features in (c, ph, pw) order:
    the order of a Conv2d(kernel p, stride p) weight flattened to (out, C*p*p), so the patch embedding is one GEMM."""
    B, C, Hl, Wl = x.shape
    h, w = Hl // p, Wl // p
    x = x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5)                 # (B, h, w, C, ph, pw)
    return x.reshape(B, h * w, C * p * p)


def unpatchify(x, height, width, p, channels):
    """Tokens (B, h*w, p*p*C) with features in SAI's (ph, pw, c) order (einsum "nhwpqc->nchpwq") -> (B, C, H, W)."""
    B = x.shape[0]
    h, w = height // p, width // p
    x = x.reshape(B, h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)          # (B, C, h, ph, w, pw)
    return x.reshape(B, channels, h * p, w * p)


def sincos_pos_embed(dim, grid_size, base_size):
    """diffusers' get_2d_sincos_pos_embed (SD3): (grid_size^2, dim) float64 NumPy. Positions i / (grid_size /
    base_size) on both axes (rounded to float32, as diffusers computes them); the first half of the features encodes
    the column, the second the row; each half is [sin(pos * w), cos(pos * w)] with w_j = 10000^(-j / (dim/4))."""
    pos = (np.arange(grid_size, dtype=np.float32) / np.float32(grid_size / base_size)).astype(np.float64)
    cols, rows = np.meshgrid(pos, pos)                                         # (S, S): x varies along a row

    def one_axis(p):
        omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
        out = p.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one_axis(cols), one_axis(rows)], axis=1)


def crop_pos_embed(pos_embed, side, h, w):
    """The centre h x w window of a stored (1, side*side, H) table -> (1, h*w, H); top = (side - h) // 2,
    left = (side - w) // 2 (SAI's cropped_pos_embed)."""
    if h > side or w > side:
        raise ValueError(f"a latent grid of {h}x{w} patches exceeds the position table's {side}x{side} "
                         f"(pos_embed_max_size); use a smaller image")
    top, left = (side - h) // 2, (side - w) // 2
    grid = pos_embed.reshape(side, side, pos_embed.shape[-1])[top:top + h, left:left + w]
    return grid.reshape(1, h * w, pos_embed.shape[-1])


def pos_embed_tensor(params, dtype, device):
    """The freshly built model's table (diffusers' init, base size sample_size / patch) as a (1, S*S, H) Tensor."""
    table = sincos_pos_embed(params.hidden_size, params.pos_embed_max_size, params.sample_size // params.patch_size)
    return flame.tensor(table[None].astype(np.float32), dtype=dtype, device=device)
