"""The layers of Qwen-Image's transformer, named as diffusers' QwenImageTransformer2DModel (= the Qwen release's
checkpoint keys): `time_text_embed.timestep_embedder.linear_{1,2}`, RMS norms with a `weight`, `attn.to_q / to_k /
to_v / to_out.0` (image) and `add_{q,k,v}_proj / to_add_out` (text), `img_mlp.net.0.proj / net.2`, `img_mod.1`,
`norm_out.linear`. The tensor work runs on flame_core's fused ops (LayerNorm + modulation, gated residual, RMS norm,
RoPE, flash attention)."""
import math

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_core.ops.modulation import gated_residual
from flame_nn.empty_init import new_parameter

from ..bfl.ops import attention
from ..blocks.layers import modulation_chunks
from ..blocks.ops import joint_qk_norm, norm_modulate, qk_norm

TIMESTEP_CHANNELS = 256


def timestep_features(timestep, dtype, dim=TIMESTEP_CHANNELS):
    """diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000) of sigma (B,): sigma is
    rounded to the model dtype first (the model casts `timestep` to it), then [cos(1000 s f), sin(1000 s f)] with
    f_i = exp(-ln(10000) i / 128) in float32 (float64 for a float64 model), cast to the model dtype. The x1000 runs
    in float32 after the product with f, as diffusers: in bfloat16 1000 s would round to steps of 4."""
    half = dim // 2
    cd = flame.float64 if dtype == flame.float64 else flame.float32
    freqs = (-math.log(10_000) * flame.arange(half, dtype=cd, device=timestep.device) / half).exp()
    args = (timestep.to(dtype).to(cd)[:, None] * freqs[None]) * 1000.0                  # (B, half)
    return flame.cat([args.cos(), args.sin()], dim=-1).to(dtype)


class RMSNorm(flame_nn.Module):
    """diffusers' RMSNorm with a learnable `weight`: statistics in float32, eps 1e-6 (txt_norm and the QK norms)."""

    def __init__(self, dim, eps=1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((dim,), dtype, device)
        flame_nn.init.ones_(self.weight)

    def forward(self, x):
        return qk_norm(x, self.weight, eps=self.eps)


class TimestepEmbedding(flame_nn.Module):
    """linear_2(SiLU(linear_1(x))), 256 -> hidden -> hidden."""

    def __init__(self, in_channels, dim, dtype=None, device=None):
        super().__init__()
        self.linear_1 = flame_nn.Linear(in_channels, dim, bias=True, dtype=dtype, device=device)
        self.linear_2 = flame_nn.Linear(dim, dim, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepProjEmbeddings(flame_nn.Module):
    """`time_text_embed`: the conditioning vector temb (B, hidden) of sigma (B,); Qwen-Image has no pooled text and
    no guidance embedding."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim, dtype=dtype, device=device)

    def forward(self, timestep):
        dtype = self.timestep_embedder.linear_1.weight.dtype
        return self.timestep_embedder(timestep_features(timestep, dtype))


class GELUProj(flame_nn.Module):
    """diffusers' GELU(approximate='tanh') module: `proj` then the activation (FeedForward's net.0)."""

    def __init__(self, dim_in, dim_out, dtype=None, device=None):
        super().__init__()
        self.proj = flame_nn.Linear(dim_in, dim_out, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(flame_nn.Module):
    """net.0 (Linear + GELU tanh), net.1 (diffusers' dropout, p = 0: no parameters), net.2 (Linear)."""

    def __init__(self, dim, hidden, dtype=None, device=None):
        super().__init__()
        self.net = flame_nn.ModuleList([GELUProj(dim, hidden, dtype=dtype, device=device), flame_nn.Identity(),
                                        flame_nn.Linear(hidden, dim, bias=True, dtype=dtype, device=device)])

    def forward(self, x):
        if self.net[0].has_hooks():
            return self.net[2](self.net[0](x))
        return self.net[0].proj.forward_gelu_mlp(x, self.net[2], approximate="tanh")   # one node for fp8 compute


class JointAttention(flame_nn.Module):
    """Separate q/k/v projections and QK RMS norms for the image and the text stream, one attention over
    [text, image] with RoPE, then each stream's output projection."""

    def __init__(self, dim, heads, head_dim, dtype=None, device=None):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        kw = dict(dtype=dtype, device=device)
        inner = heads * head_dim
        self.to_q = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.to_k = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.to_v = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.add_q_proj = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.add_k_proj = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.add_v_proj = flame_nn.Linear(dim, inner, bias=True, **kw)
        self.norm_q = RMSNorm(head_dim, **kw)
        self.norm_k = RMSNorm(head_dim, **kw)
        self.norm_added_q = RMSNorm(head_dim, **kw)
        self.norm_added_k = RMSNorm(head_dim, **kw)
        self.to_out = flame_nn.ModuleList([flame_nn.Linear(inner, dim, bias=True, **kw)])
        self.to_add_out = flame_nn.Linear(inner, dim, bias=True, **kw)

    def _heads(self, x):
        B, L, _ = x.shape
        return x.reshape(B, L, self.heads, self.head_dim)

    def forward(self, img, txt, pe, mask=None):
        """img (B, L_img, H), txt (B, L_txt, H) (modulated), pe the per-row RoPE tables of [text, image], mask None
        or the keys (B, 1, 1, L_txt + L_img) bool -> (image output, text output)."""
        dtype = img.dtype
        # each stream's QK-norm written into the joined q and k (one kernel each, text first)
        q = joint_qk_norm([self._heads(self.add_q_proj(txt)), self._heads(self.to_q(img))],
                          [self.norm_added_q.weight, self.norm_q.weight], eps=self.norm_q.eps).to(dtype)
        k = joint_qk_norm([self._heads(self.add_k_proj(txt)), self._heads(self.to_k(img))],
                          [self.norm_added_k.weight, self.norm_k.weight], eps=self.norm_k.eps).to(dtype)
        v = flame.cat([self._heads(self.add_v_proj(txt)), self._heads(self.to_v(img))], dim=1)
        out = attention(q, k, v, pe, mask)                                          # (B, L, inner)
        del q, k, v
        txt_out, img_out = out.split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


class QwenImageTransformerBlock(flame_nn.Module):
    """One dual-stream block: per stream SiLU(temb) -> Linear -> (shift, scale, gate) x 2; attention and MLP each
    as a gated residual on mod(LN0(x); shift, scale) = LN0(x)(1 + scale) + shift."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, dim, heads, head_dim, mlp_hidden, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.img_mod = flame_nn.Sequential(flame_nn.SiLU(), flame_nn.Linear(dim, 6 * dim, bias=True, **kw))
        self.attn = JointAttention(dim, heads, head_dim, **kw)
        self.img_mlp = FeedForward(dim, mlp_hidden, **kw)
        self.txt_mod = flame_nn.Sequential(flame_nn.SiLU(), flame_nn.Linear(dim, 6 * dim, bias=True, **kw))
        self.txt_mlp = FeedForward(dim, mlp_hidden, **kw)

    def forward(self, img, txt, temb, pe, mask=None):
        act = F.silu(temb)
        i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation_chunks(self.img_mod[1](act), 6)
        t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation_chunks(self.txt_mod[1](act), 6)
        img_attn, txt_attn = self.attn(norm_modulate(img, i_sh1, i_sc1), norm_modulate(txt, t_sh1, t_sc1), pe, mask)
        img = gated_residual(img, i_g1, img_attn)
        txt = gated_residual(txt, t_g1, txt_attn)
        del img_attn, txt_attn
        img = gated_residual(img, i_g2, self.img_mlp(norm_modulate(img, i_sh2, i_sc2)))
        txt = gated_residual(txt, t_g2, self.txt_mlp(norm_modulate(txt, t_sh2, t_sc2)))
        if img.dtype == flame.float16:        # as diffusers: keep fp16 activations finite
            img, txt = img.clamp(-65504, 65504), txt.clamp(-65504, 65504)
        return img, txt


class AdaLayerNormOut(flame_nn.Module):
    """`norm_out`: Linear(SiLU(temb)) chunked into (SCALE, shift) -- scale first, as diffusers'
    AdaLayerNormContinuous -- then LN0(x)(1 + scale) + shift."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.linear = flame_nn.Linear(dim, 2 * dim, bias=True, dtype=dtype, device=device)

    def forward(self, x, temb):
        scale, shift = modulation_chunks(self.linear(F.silu(temb)), 2)
        return norm_modulate(x, shift, scale)
