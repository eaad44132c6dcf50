"""The tensor ops of a Flux block on flame_core's fused kernels: adaLN modulation (LayerNorm + modulate), gated
residual, QK RMS-norm, RoPE and flash attention. (GELU(tanh), SiLU, split / unbind as views in one autograd node,
and linear_cat2 -- linear2 over cat(attn, mlp) without the concatenation -- are flame_core's own ops.)

Heads stay in the (B, L, heads, D) layout that the qkv projection produces: the QK-norm writes q and k joined and
already rotated by RoPE (one kernel each way, `qk_rope` / QK_ROPE; RoPE as a pass of its own over that memory when
switched off) and attention reads (B, heads, L, D) strided views of it and writes its output in the same layout, so
neither the split into heads nor the merge back costs a copy.
"""
import os

import flame_core as flame
from flame_core.ops.attention import scaled_dot_product_attention
from flame_core.ops.modulation import gated_residual, modulate
from flame_core.ops.rope import apply_rope

from ..blocks.ops import joint_qk_norm, norm_modulate, qk_norm

__all__ = ["modulate", "gated_residual", "norm_modulate", "qk_norm", "joint_qk_norm", "rope_freqs", "rope_rows", "rope",
           "row_tables", "qk_rope", "attention"]

# RoPE inside the QK-norm's kernels (joint_qk_norm's rope: q and k written rotated, no pass of their own); False
# (FLAME_QK_ROPE=0): the rope_apply pass on q and k in `attention` (A/B; the outputs differ by the one rounding the
# fused kernel saves)
QK_ROPE = os.environ.get("FLAME_QK_ROPE", "1") != "0"


def rope_freqs(ids, axes_dim, theta):
    """Per-position 2x2 rotations (B, 1, L, D/2, 2, 2) (BFL's layout; the 1 broadcasts over heads) from position
    ids (B, L, n_axes) (or (L, n_axes)): axis a with dim d_a rotates pairs j < d_a/2 by pos_a * theta^(-2j/d_a),
    axes concatenated in order, [[cos, -sin], [sin, cos]]. Computed in float64 (as BFL) and rounded once to
    float32 (kept in float64 for float64 ids, for exact checks)."""
    if ids.ndim == 2:
        ids = ids[None]
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"position ids {tuple(ids.shape)} have {ids.shape[-1]} axes, the model {len(axes_dim)} "
                         f"(axes_dim {tuple(axes_dim)})")
    pos = ids.detach().to(flame.float64)
    angles = []
    for a, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (flame.arange(0, d, 2, dtype=flame.float64, device=ids.device) / d))  # (d/2,)
        angles.append(pos[..., a, None] * omega)                                                   # (B, L, d/2)
    ang = flame.cat(angles, dim=-1)
    cos, sin = ang.cos(), ang.sin()
    rot = flame.stack([cos, -sin, sin, cos], dim=-1)                                               # (B, L, D/2, 4)
    out_dtype = flame.float64 if ids.dtype == flame.float64 else flame.float32
    return rot.reshape(ang.shape[0], 1, *ang.shape[1:], 2, 2).to(out_dtype)


def rope_rows(freqs, batch_size):
    """BFL-layout rotations (B or 1, 1, L, D/2, 2, 2) as one table per token row, (B*L, 1, 1, D/2, 2, 2): the layout
    `rope` applies directly (Flux.forward converts once per forward, not once per block)."""
    Bf, _, L, half = freqs.shape[:4]
    if Bf != batch_size:
        freqs = freqs.expand(batch_size, *freqs.shape[1:])
    return freqs.reshape(batch_size * L, 1, 1, half, 2, 2)


def row_tables(freqs, batch_size, length):
    """freqs as one table per token row, (B*L, 1, 1, D/2, 2, 2): as they are when they already are, else
    `rope_rows` of BFL's layout."""
    if freqs.shape[0] == batch_size * length and freqs.shape[2] == 1:
        return freqs
    return rope_rows(freqs, batch_size)


def qk_rope(pe, batch_size, length):
    """(tables for the QK-norm's rope, freqs for `attention`) of a block's joint sequence of `length` tokens: RoPE
    inside the QK-norm's kernels (QK_ROPE: the tables, and None for attention) or in attention ((None, pe))."""
    return (row_tables(pe, batch_size, length), None) if QK_ROPE else (None, pe)


def rope(x, freqs):
    """Rotate q or k in the (B, L, heads, D) layout by freqs: per-row tables (B*L, 1, 1, D/2, 2, 2) from
    `rope_rows`, or BFL's (B or 1, 1, L, D/2, 2, 2). In float32, cast back to x's dtype.

    The rotation depends on the position only, so the kernel sees x as B*L rows of (heads, 1, D) with one table
    per row: no transpose to (B, heads, L, D) is needed."""
    B, L, Hh, D = x.shape
    freqs = row_tables(freqs, B, L)
    return apply_rope(x.reshape(B * L, Hh, 1, D), freqs).reshape(B, L, Hh, D)


def attention(q, k, v, freqs, mask=None):
    """RoPE on q and k, then softmax(q k^T / sqrt(D)) v over the joint sequence: q, k, v (B, L, heads, D) ->
    (B, L, heads*D). freqs None: q and k come rotated (the QK-norm applied RoPE: `qk_rope`). mask: None, or a bool
    (B, 1, 1, L) of the keys each query may attend to (Chroma's padded text tokens)."""
    B, L, Hh, D = q.shape
    if freqs is not None:
        q, k = rope(q, freqs), rope(k, freqs)  # rebinding frees the unrotated copies (when the caller holds none)
    o = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     attn_mask=mask)                                          # (B, heads, L, D)
    return o.transpose(1, 2).reshape(B, L, Hh * D)
