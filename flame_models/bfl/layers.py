"""The building blocks of Flux (BFL's modules/layers.py names, so parameter names equal checkpoint keys)."""
from collections import namedtuple

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_nn.empty_init import new_parameter

from ..blocks.layers import LastLayer, modulation_chunks, timestep_embedding  # noqa: F401
from . import ops

ModulationOut = namedtuple("ModulationOut", ["shift", "scale", "gate"])  # each (B, H), or (H,) for one sample


class EmbedND(flame_nn.Module):
    """Position ids (B, L, n_axes) -> RoPE rotations (B, 1, L, dim/2, 2, 2) float32."""

    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        if sum(axes_dim) != dim:
            raise ValueError(f"EmbedND: axes_dim {tuple(axes_dim)} must sum to dim {dim}")
        self.dim, self.theta, self.axes_dim = dim, theta, tuple(axes_dim)

    def forward(self, ids):
        return ops.rope_freqs(ids, self.axes_dim, self.theta)

    def joint(self, txt_ids, img_ids, batch_size):
        """The rotations of the joint sequence, text first, as one table per token row (ops.rope_rows): ids (B, L, 3)
        or (L, 3), the one with batch 1 broadcast to the other's."""
        img_ids, txt_ids = _batched(img_ids), _batched(txt_ids)
        if img_ids.shape[0] != txt_ids.shape[0]:
            img_ids, txt_ids = (i.expand(max(img_ids.shape[0], txt_ids.shape[0]), *i.shape[1:])
                                for i in (img_ids, txt_ids))
        return ops.rope_rows(self(flame.cat((txt_ids, img_ids), dim=1)), batch_size)


def _batched(ids):
    return ids[None] if ids.ndim == 2 else ids


class MLPEmbedder(flame_nn.Module):
    def __init__(self, in_dim, hidden_dim, dtype=None, device=None):
        super().__init__()
        self.in_layer = flame_nn.Linear(in_dim, hidden_dim, bias=True, dtype=dtype, device=device)
        self.out_layer = flame_nn.Linear(hidden_dim, hidden_dim, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm(flame_nn.Module):
    """BFL's RMSNorm: the learnable gain is called `scale`; normalises in float32, eps 1e-6."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.scale = new_parameter((dim,), dtype, device)
        flame_nn.init.ones_(self.scale)

    def forward(self, x):
        return ops.qk_norm(x, self.scale)


class QKNorm(flame_nn.Module):
    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.query_norm = RMSNorm(dim, dtype=dtype, device=device)
        self.key_norm = RMSNorm(dim, dtype=dtype, device=device)

    def forward(self, q, k, v):
        q, k = self.query_norm(q), self.key_norm(k)
        return q.to(v.dtype), k.to(v.dtype)

    def joined(self, other, qs, ks, rope=None):
        """The joint attention's q and k: (this stream's, `other` QKNorm's) q and k normalised by their own gains and
        joined along the tokens, this stream first, one kernel each (ops.joint_qk_norm); `other` None: this stream's
        alone, still one kernel reading the projection's views in place. rope: per-row RoPE tables of the joint
        tokens (ops.qk_rope) applied in the same kernels."""
        norms = (self,) if other is None else (self, other)
        return (ops.joint_qk_norm(qs, [n.query_norm.scale for n in norms], rope=rope),
                ops.joint_qk_norm(ks, [n.key_norm.scale for n in norms], rope=rope))


class SelfAttention(flame_nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, dtype=None, device=None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = flame_nn.Linear(dim, dim * 3, bias=qkv_bias, dtype=dtype, device=device)
        self.norm = QKNorm(dim // num_heads, dtype=dtype, device=device)
        self.proj = flame_nn.Linear(dim, dim, dtype=dtype, device=device)

    def qkv_views(self, x):
        """q, k and v (B, L, heads, D) of tokens x (B, L, H) before the QK-norm: views of one GEMM's q | k | v whose
        backward takes dq, dk and dv as they come (Linear.forward_split), not stacked into one (B, L, 3H) gradient
        first."""
        H = self.qkv.weight.shape[0] // 3
        B, L = x.shape[0], x.shape[1]
        return tuple(t.reshape(B, L, self.num_heads, H // self.num_heads)
                     for t in self.qkv.forward_split(x, (H, H, H)))

    def forward(self, x, pe):
        q, k, v = self.qkv_views(x)
        rq, pe = ops.qk_rope(pe, x.shape[0], x.shape[1])
        q, k = self.norm.joined(None, (q,), (k,), rope=rq)
        return self.proj(ops.attention(q, k, v, pe))


class Modulation(flame_nn.Module):
    """SiLU(vec) -> Linear -> chunks of (shift, scale, gate): two sets for double blocks, one for single."""

    def __init__(self, dim, double, dtype=None, device=None):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = flame_nn.Linear(dim, self.multiplier * dim, bias=True, dtype=dtype, device=device)

    def forward(self, vec):
        out = modulation_chunks(self.lin(F.silu(vec)), self.multiplier)
        return ModulationOut(*out[:3]), (ModulationOut(*out[3:]) if self.is_double else None)


def given_modulation(mods, n):
    """Precomputed modulation vectors (B, n, H) (Chroma's approximator rows) as n vectors (B, H), or (H,) for one
    sample, as Modulation gives them."""
    if mods.ndim != 3 or mods.shape[1] != n:
        raise ValueError(f"expected {n} modulation vectors (B, {n}, H), got shape {tuple(mods.shape)}")
    if mods.shape[0] == 1:
        return mods[0].unbind(0)
    return mods.unbind(1)


def _mlp(hidden_size, mlp_hidden_dim, dtype, device):
    """BFL's Sequential(Linear, GELU(tanh), Linear) (keys .0 and .2), run by `_run_mlp`."""
    return flame_nn.Sequential(
        flame_nn.Linear(hidden_size, mlp_hidden_dim, bias=True, dtype=dtype, device=device),
        flame_nn.GELU(approximate="tanh"),
        flame_nn.Linear(mlp_hidden_dim, hidden_size, bias=True, dtype=dtype, device=device),
    )


def _run_mlp(mlp, x):
    """mlp[2](gelu(mlp[0](x))): one fused node for fp8-compute layers (Linear.forward_gelu_mlp) unless the GELU
    module is hooked."""
    if mlp[1].has_hooks():
        return mlp[2](mlp[1](mlp[0](x)))
    return mlp[0].forward_gelu_mlp(x, mlp[2], approximate="tanh")


class DoubleStreamBlock(flame_nn.Module):
    """Separate weights for image and text tokens, one joint attention over both (text first)."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False, dtype=None, device=None, *,
                 modulation=True):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads, self.hidden_size = num_heads, hidden_size
        self.has_modulation = modulation      # False: Chroma's, the 12 vectors given (B, 12, H) as `vec`
        kw = dict(dtype=dtype, device=device)
        if modulation:
            self.img_mod = Modulation(hidden_size, double=True, **kw)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias, **kw)
        self.img_mlp = _mlp(hidden_size, mlp_hidden_dim, **kw)
        if modulation:
            self.txt_mod = Modulation(hidden_size, double=True, **kw)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias, **kw)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden_dim, **kw)

    def forward(self, img, txt, vec, pe, mask=None):
        if self.has_modulation:
            img_mod1, img_mod2 = self.img_mod(vec)
            txt_mod1, txt_mod2 = self.txt_mod(vec)
        else:
            m = given_modulation(vec, 12)                     # image rows 0..5, text rows 6..11
            img_mod1, img_mod2, txt_mod1, txt_mod2 = (ModulationOut(*m[i:i + 3]) for i in (0, 3, 6, 9))

        # prepare image and text for attention
        img_q, img_k, img_v = self.img_attn.qkv_views(ops.norm_modulate(img, img_mod1.shift, img_mod1.scale))
        txt_q, txt_k, txt_v = self.txt_attn.qkv_views(ops.norm_modulate(txt, txt_mod1.shift, txt_mod1.scale))

        # joint attention, text tokens first; each stream's QK-norm written into the joined q and k
        rq, pe = ops.qk_rope(pe, img.shape[0], txt.shape[1] + img.shape[1])   # RoPE in the QK-norm's kernels
        q, k = self.txt_attn.norm.joined(self.img_attn.norm, (txt_q, img_q), (txt_k, img_k),
                                         rope=rq)                                # (B, L, heads, D)
        v = flame.cat((txt_v, img_v), dim=1)
        del img_q, img_k, img_v, txt_q, txt_k, txt_v
        attn = ops.attention(q, k, v, pe, mask)                                 # (B, L, H)
        del q, k, v
        txt_attn, img_attn = attn.split([txt.shape[1], img.shape[1]], dim=1)

        # the image stream: attention, then MLP, each as a gated residual
        img = ops.gated_residual(img, img_mod1.gate, self.img_attn.proj(img_attn))
        img = ops.gated_residual(img, img_mod2.gate, _run_mlp(
            self.img_mlp, ops.norm_modulate(img, img_mod2.shift, img_mod2.scale)))

        # the text stream
        txt = ops.gated_residual(txt, txt_mod1.gate, self.txt_attn.proj(txt_attn))
        txt = ops.gated_residual(txt, txt_mod2.gate, _run_mlp(
            self.txt_mlp, ops.norm_modulate(txt, txt_mod2.shift, txt_mod2.scale)))
        return img, txt


class SingleStreamBlock(flame_nn.Module):
    """One stream over concat(txt, img): attention and MLP in parallel, sharing linear1 (qkv | mlp) and linear2."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, dtype=None, device=None, *, modulation=True):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.has_modulation = modulation      # False: Chroma's, the 3 vectors given (B, 3, H) as `vec`
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        kw = dict(dtype=dtype, device=device)
        self.linear1 = flame_nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim, **kw)  # qkv | mlp in
        self.linear2 = flame_nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size, **kw)      # attn | mlp out
        self.norm = QKNorm(hidden_size // num_heads, **kw)
        if modulation:
            self.modulation = Modulation(hidden_size, double=False, **kw)

    def forward(self, x, vec, pe, mask=None):
        mod = self.modulation(vec)[0] if self.has_modulation else ModulationOut(*given_modulation(vec, 3))
        H, heads = self.hidden_size, self.num_heads
        # q | k | v | mlp as views of linear1's one GEMM; its backward takes the four gradients without joining them
        q, k, v, mlp = self.linear1.forward_split(ops.norm_modulate(x, mod.shift, mod.scale),
                                                  (H, H, H, self.mlp_hidden_dim))     # (B, L, H) x 3 | (B, L, M)
        B, L = x.shape[0], x.shape[1]
        q, k, v = (t.reshape(B, L, heads, H // heads) for t in (q, k, v))
        rq, pe = ops.qk_rope(pe, B, L)                        # RoPE in the QK-norm's kernels
        q, k = self.norm.joined(None, (q,), (k,), rope=rq)    # one kernel each, reading the views in place
        attn = ops.attention(q, k, v, pe, mask)                                       # (B, L, H)
        del q, k, v
        # linear2 over attn | gelu(mlp), mlp read in place from linear1's output: without the concatenation where
        # linear2 has a fused form, and with the GELU inside its fp8 cast where it has that one
        out = self.linear2.forward_cat2_gelu(attn, mlp, approximate="tanh")
        return ops.gated_residual(x, mod.gate, out)




def stream_blocks(p, *, qkv_bias=True, modulation=True, dtype=None, device=None):
    """(double_blocks, single_blocks): the ModuleLists of a Flux-derived transformer with params `p`; Chroma's
    (`modulation=False`) take their modulation vectors from the approximator."""
    kw = dict(modulation=modulation, dtype=dtype, device=device)
    double = flame_nn.ModuleList(DoubleStreamBlock(p.hidden_size, p.num_heads, p.mlp_ratio, qkv_bias=qkv_bias, **kw)
                                 for _ in range(p.depth))
    single = flame_nn.ModuleList(SingleStreamBlock(p.hidden_size, p.num_heads, p.mlp_ratio, **kw)
                                 for _ in range(p.depth_single_blocks))
    return double, single
