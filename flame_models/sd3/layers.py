"""The building blocks of an MMDiT (SAI's mmditx.py names, so parameter names equal checkpoint keys)."""
import flame_core as flame
import flame_nn
import flame_nn.functional as F

from ..blocks.layers import modulation_chunks, timestep_embedding
from . import ops


class PatchEmbed(flame_nn.Module):
    """Conv2d(in -> H, kernel p, stride p) over the latents, flattened row-major to tokens (B, h*w, H). The patches do
    not overlap, so the convolution runs as one GEMM over the patchified latents (same weight, same result)."""

    def __init__(self, patch_size, in_channels, embed_dim, dtype=None, device=None):
        super().__init__()
        self.patch_size = patch_size
        self.proj = flame_nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, bias=True,
                                    dtype=dtype, device=device)

    def forward(self, x):
        w = self.proj.weight
        return F.linear(ops.patchify(x, self.patch_size), w.reshape(w.shape[0], -1), self.proj.bias)


class Embedder(flame_nn.Module):
    """SAI's TimestepEmbedder / VectorEmbedder: mlp = [Linear, SiLU, Linear] (keys mlp.0, mlp.2)."""

    def __init__(self, in_dim, hidden_size, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=True, dtype=dtype, device=device)
        self.mlp = flame_nn.Sequential(flame_nn.Linear(in_dim, hidden_size, **kw), flame_nn.SiLU(),
                                       flame_nn.Linear(hidden_size, hidden_size, **kw))

    def forward(self, x):
        return self.mlp[2](ops.silu(self.mlp[0](x)))


def timestep_features(t, dim=256):
    """The 256 sinusoidal features of timesteps t (B,) = 1000 sigma: [cos(t f), sin(t f)], f_i = 10000^(-i/128), in
    float32 (float64 for float64 t) whatever the model dtype -- 1000 sigma does not survive a cast to bfloat16."""
    cd = flame.float64 if t.dtype == flame.float64 else flame.float32
    return timestep_embedding(t.to(cd), dim, time_factor=1.0)


class RMSNorm(flame_nn.RMSNorm):
    """RMSNorm over the head dim with a learnable gain `weight` (SAI's ln_q / ln_k), eps 1e-6, float32 statistics:
    flame_nn.RMSNorm's parameter, computed by the fused qk_norm."""

    def __init__(self, dim, eps=1e-6, dtype=None, device=None):
        super().__init__(dim, eps=eps, dtype=dtype, device=device)

    def forward(self, x):
        return ops.qk_norm(x, self.weight, eps=self.eps)


class SelfAttention(flame_nn.Module):
    """qkv (H -> 3H) into heads of 64 with optional RMS QK-norm; proj (H -> H) unless pre_only (the last context block
    only supplies keys and values to the joint attention)."""

    def __init__(self, dim, num_heads, qk_norm="rms", pre_only=False, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.num_heads, self.head_dim, self.pre_only = num_heads, dim // num_heads, pre_only
        self.qkv = flame_nn.Linear(dim, 3 * dim, bias=True, **kw)
        if qk_norm == "rms":
            self.ln_q = RMSNorm(self.head_dim, **kw)
            self.ln_k = RMSNorm(self.head_dim, **kw)
        else:
            self.ln_q = self.ln_k = None
        if not pre_only:
            self.proj = flame_nn.Linear(dim, dim, bias=True, **kw)

    def qkv_views(self, x):
        """q, k, v (B, L, heads, D) of tokens x (B, L, H) before the QK-norm: the q/k/v index is outermost, then
        heads; views of the projection, one GEMM whose backward takes dq, dk and dv as they come
        (Linear.forward_split), not stacked into one (B, L, 3H) gradient first."""
        H = self.num_heads * self.head_dim
        B, L = x.shape[0], x.shape[1]
        return tuple(t.reshape(B, L, self.num_heads, self.head_dim) for t in self.qkv.forward_split(x, (H, H, H)))

    def qkv_heads(self, x):
        """q, k, v of qkv_views with q and k normalised (this stream's own attention)."""
        q, k, v = self.qkv_views(x)
        if self.ln_q is not None:
            q, k = self.ln_q(q).to(v.dtype), self.ln_k(k).to(v.dtype)
        return q, k, v


class Mlp(flame_nn.Module):
    """timm's Mlp as SAI uses it: fc1 (H -> 4H), GELU(tanh), fc2 (4H -> H)."""

    def __init__(self, hidden_size, mlp_hidden_dim, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=True, dtype=dtype, device=device)
        self.fc1 = flame_nn.Linear(hidden_size, mlp_hidden_dim, **kw)
        self.fc2 = flame_nn.Linear(mlp_hidden_dim, hidden_size, **kw)

    def forward(self, x):
        return self.fc1.forward_gelu_mlp(x, self.fc2, approximate="tanh")   # one node for fp8-compute layers


class DismantledBlock(flame_nn.Module):
    """One stream of a joint block (SAI's DismantledBlock): adaLN modulation, attention pieces, MLP.

    adaLN_modulation = [SiLU, Linear(H -> nH)] chunked into n vectors: 6 (shift, scale, gate for attention, then for
    the MLP), 9 with dual attention (+ shift, scale, gate of attn2), 2 (shift, scale) when pre-only."""

    def __init__(self, hidden_size, num_heads, qk_norm="rms", pre_only=False, dual_attention=False, dtype=None,
                 device=None):
        super().__init__()
        if dual_attention and pre_only:
            raise ValueError("a pre-only block cannot have dual attention")
        kw = dict(dtype=dtype, device=device)
        self.pre_only, self.dual_attention = pre_only, dual_attention
        self.n_mods = 2 if pre_only else (9 if dual_attention else 6)
        self.attn = SelfAttention(hidden_size, num_heads, qk_norm, pre_only=pre_only, **kw)
        if dual_attention:
            self.attn2 = SelfAttention(hidden_size, num_heads, qk_norm, **kw)
        if not pre_only:
            self.mlp = Mlp(hidden_size, 4 * hidden_size, **kw)
        self.adaLN_modulation = flame_nn.Sequential(
            flame_nn.SiLU(), flame_nn.Linear(hidden_size, self.n_mods * hidden_size, bias=True, **kw))

    def modulation(self, c):
        """The n modulation vectors, each (B, H) -- (H,) for one sample: then the fused LayerNorm applies them."""
        return modulation_chunks(self.adaLN_modulation[1](ops.silu(c)), self.n_mods)

    def pre_attention(self, x, mods):
        """(q, k, v) of the joint attention before the QK-norm (JointBlock normalises both streams' q and k as it joins
        them) and, with dual attention, the normalised (q2, k2, v2) of the x-only attention."""
        qkv = self.attn.qkv_views(ops.norm_modulate(x, mods[0], mods[1]))
        if not self.dual_attention:
            return qkv, None
        return qkv, self.attn2.qkv_heads(ops.norm_modulate(x, mods[6], mods[7]))

    def post_attention(self, x, attn, mods, attn2=None):
        """The residual updates after attention: x += g_msa proj(attn) [+ g_msa2 proj2(attn2)]; x += g_mlp MLP(...)."""
        x = ops.gated_residual(x, mods[2], self.attn.proj(attn))
        if attn2 is not None:
            x = ops.gated_residual(x, mods[8], self.attn2.proj(attn2))
        return ops.gated_residual(x, mods[5], self.mlp(ops.norm_modulate(x, mods[3], mods[4])))


class JointBlock(flame_nn.Module):
    """Context and image streams with separate weights and one attention over both, context tokens first."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, hidden_size, num_heads, qk_norm="rms", pre_only=False, dual_attention=False, dtype=None,
                 device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.context_block = DismantledBlock(hidden_size, num_heads, qk_norm, pre_only=pre_only, **kw)
        self.x_block = DismantledBlock(hidden_size, num_heads, qk_norm, dual_attention=dual_attention, **kw)

    def forward(self, context, x, c):
        """context (B, Lc, H), x (B, Lx, H), c (B, H) -> (context or None after a pre-only block, x)."""
        cb, xb = self.context_block, self.x_block
        c_mods, x_mods = cb.modulation(c), xb.modulation(c)

        # prepare both streams for attention
        (cq, ck, cv), _ = cb.pre_attention(context, c_mods)
        (xq, xk, xv), qkv2 = xb.pre_attention(x, x_mods)

        # joint attention, context tokens first; each stream's QK-norm written into the joined q and k
        q, k = _joint_qk(cb.attn, xb.attn, (cq, xq), (ck, xk))                 # (B, Lc + Lx, heads, D)
        v = flame.cat((cv, xv), dim=1)
        del cq, ck, cv, xq, xk, xv
        attn = ops.attention(q, k, v)                                          # (B, Lc + Lx, H)
        del q, k, v
        c_attn, x_attn = ops.split(attn, [context.shape[1], x.shape[1]], dim=1)

        # the image stream (its x-only attention for dual blocks), then the context stream
        attn2 = ops.attention(*qkv2) if qkv2 is not None else None
        x = xb.post_attention(x, x_attn, x_mods, attn2)
        if cb.pre_only:
            return None, x
        return cb.post_attention(context, c_attn, c_mods), x


def _joint_qk(ca, xa, qs, ks):
    """The joined q and k of two streams' SelfAttentions `ca`, `xa` (context first; both built with the same
    qk_norm): each stream's QK-norm written into them (ops.joint_qk_norm), or the plain concatenations without one."""
    if ca.ln_q is None:
        return ops.joint_qk_norm(qs, None), ops.joint_qk_norm(ks, None)
    return (ops.joint_qk_norm(qs, (ca.ln_q.weight, xa.ln_q.weight), ca.ln_q.eps),
            ops.joint_qk_norm(ks, (ca.ln_k.weight, xa.ln_k.weight), ca.ln_k.eps))
