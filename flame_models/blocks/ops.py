"""Fused ops of DiT blocks shared by Flux, SD3 and Qwen-Image: adaLN modulation (LayerNorm + modulate in one pass),
the QK RMS-norm, and the joint attention's QK RMS-norm written straight into the joined q / k."""
import flame_core as flame
import flame_nn.functional as F
from flame_core.ops.modulation import modulate


def norm_modulate(x, shift, scale, eps=1e-6):
    """modulate(LayerNorm(x) without affine, shift, scale), the input of every Flux sub-block; x (B, L, H),
    shift and scale (B, H), or (H,) for all samples alike (what Modulation gives for one sample): a per-feature
    affine, which runs inside the fused LayerNorm (weight 1 + scale, bias shift), one pass instead of two.

    Per-sample vectors (B, H) take the same fused LayerNorm one sample at a time: LayerNorm-then-modulate rounds
    differently in bf16 (the normalised x rounded, 1 + scale not), so an image's numbers would depend on the batch
    it was generated in."""
    H = x.shape[-1]
    if shift.ndim == 1 and scale.ndim == 1:
        return F.layer_norm(x, (H,), weight=1 + scale, bias=shift, eps=eps)
    if shift.ndim != 2 or scale.ndim != 2 or x.ndim < 2 or not shift.shape[0] == scale.shape[0] == x.shape[0]:
        return modulate(F.layer_norm(x, (H,), eps=eps), shift, scale)  # other broadcasts: the kernel checks them
    return flame.stack([F.layer_norm(xb, (H,), weight=1 + sc, bias=sh, eps=eps)
                        for xb, sh, sc in zip(x.unbind(0), shift.unbind(0), scale.unbind(0))], dim=0)


def qk_norm(x, scale, eps=1e-6):
    """RMSNorm over the head dim (float32 statistics) times the learnable scale: BFL's QKNorm halves."""
    return F.rms_norm(x, (x.shape[-1],), scale, eps=eps)


def joint_qk_norm(parts, gains, eps=1e-6, rope=None):
    """A joint attention's q (or k): cat([qk_norm(x, w, eps) for x, w in zip(parts, gains)], dim=1) of each stream's
    heads (B, L_p, heads, D) -- views of its projection, strided or not -- normalised with the stream's own gain
    and written into the joined tensor in one kernel each way (F.joint_rms_norm: no copies of the views, no
    concatenation); rope: per-row RoPE tables (B * L, 1, 1, D / 2, 2, 2) applied in the same kernels (Flux's q and
    k, rotated before the attention). gains None: no QK-norm, the plain concatenation (then no rope)."""
    if gains is None:
        if rope is not None:
            raise ValueError("joint_qk_norm: rope is applied inside the QK-norm's kernels; without gains there is none")
        return parts[0] if len(parts) == 1 else flame.cat(parts, dim=1)
    return F.joint_rms_norm(parts, gains, eps=eps, rope=rope)
