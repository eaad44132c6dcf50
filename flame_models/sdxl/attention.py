"""The UNet's SpatialTransformer (SAI's attention.py names: norm, proj_in, transformer_blocks.k.{norm1, attn1, norm2,
attn2, norm3, ff}, proj_out; `use_linear_in_transformer`, so proj_in / proj_out are Linears).

Residual sums go into the fresh branch output (never into a block's input: a checkpoint keeps that for the
recompute), in place when nothing records gradients.
"""
import flame_nn
import flame_nn.functional as F
from flame_core.checkpoint import maybe_checkpoint
from flame_core.ops.activation import geglu_of_temporary

from ..vae.layers import add_residual

TRANSFORMER_NORM_EPS = 1e-6   # the GroupNorm in front of proj_in
LAYER_NORM_EPS = 1e-5


class CrossAttention(flame_nn.Module):
    """Multi-head attention of x (B, L, C) over context (B, L_ctx, C_ctx), or over x itself when context is None.
    to_q / to_k / to_v have no bias, to_out.0 has one. Heads of `head_dim` channels (64 in SDXL: flash kernels)."""

    def __init__(self, query_dim, heads, head_dim, context_dim=None, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        inner = heads * head_dim
        context_dim = query_dim if context_dim is None else context_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = flame_nn.Linear(query_dim, inner, bias=False, **kw)
        self.to_k = flame_nn.Linear(context_dim, inner, bias=False, **kw)
        self.to_v = flame_nn.Linear(context_dim, inner, bias=False, **kw)
        self.to_out = flame_nn.Sequential(flame_nn.Linear(inner, query_dim, **kw))

    def forward(self, x, context=None):
        B, L, _ = x.shape
        ctx = x if context is None else context
        Lk = ctx.shape[1]
        h, d = self.heads, self.head_dim
        q = self.to_q(x).reshape(B, L, h, d).transpose(1, 2)        # (B, heads, L, D)
        k = self.to_k(ctx).reshape(B, Lk, h, d).transpose(1, 2)     # (B, heads, L_ctx, D)
        v = self.to_v(ctx).reshape(B, Lk, h, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)                  # (B, heads, L, D)
        del q, k, v
        o = o.transpose(1, 2).reshape(B, L, h * d)
        return self.to_out[0](o)


class GEGLU(flame_nn.Module):
    """proj (C -> 2 * inner), split into [a | gate], a * GELU(gate) with the exact (erf) GELU."""

    def __init__(self, dim_in, dim_out, dtype=None, device=None):
        super().__init__()
        self.proj = flame_nn.Linear(dim_in, 2 * dim_out, dtype=dtype, device=device)

    def forward(self, x):
        # [a | gate] -> a * gelu(gate) in one kernel; only proj's output is saved, and backward writes its
        # gradient over it (the projection's output is this call's own temporary)
        return geglu_of_temporary(self.proj(x))


class FeedForward(flame_nn.Module):
    """net.0 = GEGLU (C -> 8C -> 4C), net.2 = Linear (4C -> C); net.1 is the (inactive) dropout slot."""

    def __init__(self, dim, mult=4, dtype=None, device=None):
        super().__init__()
        inner = dim * mult
        self.net = flame_nn.Sequential(GEGLU(dim, inner, dtype=dtype, device=device), flame_nn.Identity(),
                                       flame_nn.Linear(inner, dim, dtype=dtype, device=device))

    def forward(self, x):
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(flame_nn.Module):
    """x += attn1(norm1 x) (self); x += attn2(norm2 x, context) (cross); x += ff(norm3 x). LayerNorms eps 1e-5."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, dim, heads, head_dim, context_dim, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.attn1 = CrossAttention(dim, heads, head_dim, **kw)
        self.ff = FeedForward(dim, **kw)
        self.attn2 = CrossAttention(dim, heads, head_dim, context_dim, **kw)
        self.norm1 = flame_nn.LayerNorm(dim, eps=LAYER_NORM_EPS, **kw)
        self.norm2 = flame_nn.LayerNorm(dim, eps=LAYER_NORM_EPS, **kw)
        self.norm3 = flame_nn.LayerNorm(dim, eps=LAYER_NORM_EPS, **kw)

    def forward(self, x, context):                                   # x (B, L, C), context (B, L_ctx, C_ctx)
        x = add_residual(self.attn1(self.norm1(x)), x)               # a new tensor: the input stays intact
        x = add_residual(self.attn2(self.norm2(x), context), x)
        return add_residual(self.ff(self.norm3(x)), x)


class SpatialTransformer(flame_nn.Module):
    """GroupNorm (eps 1e-6) -> tokens (B, H*W, C) -> proj_in -> transformer_blocks -> proj_out -> image + input.
    Each transformer block is checkpointed on its own when its `gradient_checkpointing` flag is set."""

    def __init__(self, channels, heads, head_dim, depth, context_dim, groups=32, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.channels = channels
        self.norm = flame_nn.GroupNorm(groups, channels, eps=TRANSFORMER_NORM_EPS, **kw)
        self.proj_in = flame_nn.Linear(channels, heads * head_dim, **kw)
        self.transformer_blocks = flame_nn.ModuleList(
            BasicTransformerBlock(heads * head_dim, heads, head_dim, context_dim, **kw) for _ in range(depth))
        self.proj_out = flame_nn.Linear(heads * head_dim, channels, **kw)

    def forward(self, x, emb=None, context=None):                    # x (B, C, H, W)
        B, C, H, W = x.shape
        h = self.norm(x)
        h = h.reshape(B, C, H * W).transpose(1, 2)                   # (B, L, C)
        h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = maybe_checkpoint(block, h, context, offload=block.checkpoint_offload)
        h = self.proj_out(h)
        h = h.transpose(1, 2).reshape(B, C, H, W)
        return add_residual(h, x)
