"""The tensor ops of a Flux block on flame_core's fused kernels: adaLN modulation (LayerNorm + modulate), gated
residual, GELU(tanh) / SiLU, QK RMS-norm, RoPE and flash attention.

Heads stay in the (B, L, heads, D) layout that the qkv projection produces: RoPE rotates that memory directly and
attention reads (B, heads, L, D) strided views of it and writes its output in the same layout, so neither the
split into heads nor the merge back costs a copy.
"""
import math

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import Function
from flame_core.autograd.grad_mode import state as _grad_state
from flame_core import backend
from flame_core.amp import autocast_mode as _amp
from flame_core.kernels import activations as _act
from flame_core.kernels import gelu_rows as _gelu_rows
from flame_core.kernels import gemm as _cublas
from flame_core.ops.attention import scaled_dot_product_attention
from flame_core.ops.modulation import gated_residual, modulate
from flame_core.ops.rope import apply_rope
from flame_core.errors import ShapeError
from flame_core.tensor import _view_of, _wrap

__all__ = ["split", "unbind", "modulate", "gated_residual", "norm_modulate", "gelu_tanh", "gelu_tanh_strided",
           "linear_cat2", "silu", "qk_norm", "rope_freqs", "rope_rows", "rope", "attention"]


class Split(Function):
    """Views of x cut along `dim` into pieces of `sizes`, recorded as ONE node whose backward is one concatenation
    (flame_core's chunk/split record a node per piece, each scattering into a full-size zero gradient)."""

    @staticmethod
    def forward(ctx, x, dim, sizes):
        ctx.dim = dim
        a, lead, out, start = x._data, (slice(None),) * dim, [], 0
        for n in sizes:
            out.append(_view_of(a[lead + (slice(start, start + n),)], x))
            start += n
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return flame.cat(grads, dim=ctx.dim), None, None


class Unbind(Function):
    """The slices x[..., i, ...] along `dim` as views, in one node (backward: one stack)."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        a, lead = x._data, (slice(None),) * dim
        return tuple(_view_of(a[lead + (i,)], x) for i in range(a.shape[dim]))

    @staticmethod
    def backward(ctx, *grads):
        return flame.stack(grads, dim=ctx.dim), None


def split(x, sizes, dim=-1):
    """Views of x along `dim` with these sizes (as torch.split with a list of sizes)."""
    dim = dim % x.ndim
    if sum(sizes) != x.shape[dim]:
        raise ShapeError(f"split: sizes {list(sizes)} do not add up to dim {dim} of shape {tuple(x.shape)}")
    return Split.apply(x, dim, tuple(sizes))


def unbind(x, dim=0):
    return Unbind.apply(x, dim % x.ndim)

_K = math.sqrt(2.0 / math.pi)


class GeluTanh(Function):
    """GELU with the tanh approximation through the fused activation kernel (one pass each way)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _wrap(_act.gelu_forward(x._data, "tanh"))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if _grad_state.enabled:  # create_graph: the same derivative with Tensor ops (differentiable again)
            t = ((x + 0.044715 * x * x * x) * _K).tanh()
            return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * ((1 + 3 * 0.044715 * x * x) * _K))
        return _wrap(_act.gelu_backward(g._data, x._data, "tanh"))


class Silu(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _wrap(_act.silu_forward(x._data))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if _grad_state.enabled:
            s = x.sigmoid()
            return g * (s * (1 + x * (1 - s)))
        return _wrap(_act.silu_backward(g._data, x._data))


def gelu_tanh(x):
    return GeluTanh.apply(x)


class GeluTanhStrided(Function):
    """GELU(tanh) of a (B, L, M) view whose rows are strided (the MLP half of the single block's linear1 output):
    read in place, written contiguous (flame_core.kernels.gelu_rows) -- no copy of the half first."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        B, L, M = x.shape
        return _wrap(_gelu_rows.gelu_tanh_rows_forward(x._data.reshape(B * L, M)).reshape(B, L, M))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if _grad_state.enabled:
            return GeluTanh.backward(ctx, g)
        B, L, M = x.shape
        return _wrap(_gelu_rows.gelu_tanh_rows_backward(g._data.reshape(B * L, M),
                                                        x._data.reshape(B * L, M)).reshape(B, L, M))


def gelu_tanh_strided(x):
    """gelu_tanh of a 3-D view whose (B, L) rows may be strided; falls back to gelu_tanh when the view cannot be
    read as rows (x[b, l, :] must be contiguous and the (B, L) dims must collapse)."""
    B, L, M = x.shape
    a = x._data
    item = a.itemsize
    if a.strides[2] == item and (B == 1 or a.strides[0] == L * a.strides[1]):
        return GeluTanhStrided.apply(x)
    return GeluTanh.apply(x)


class LinearCat2(Function):
    """linear(cat((a, b), -1), w, bias) without building the concatenation: a @ w[:, :Ha]^T, then b @ w[:, Ha:]^T
    accumulated into the same output by the second GEMM (cuBLAS beta = 1), then the bias. Backward: the two input
    gradients come out separately (no split of a concatenated gradient)."""

    @staticmethod
    def forward(ctx, a, b, w, bias):
        ha = a.shape[-1]
        lead = a.shape[:-1]
        a2 = a._data.reshape(-1, ha)
        b2 = b._data.reshape(-1, b.shape[-1])
        wd = w._data
        if backend.is_cuda_array(wd) and _cublas.supported(wd.dtype) and a2.dtype == b2.dtype == wd.dtype:
            y = _cublas.matmul(a2, wd[:, :ha].T)
            _cublas.matmul(b2, wd[:, ha:].T, out=y, beta=1.0)
        else:
            from flame_core.ops.linalg import _mm_arrays
            y = _mm_arrays(a2, wd[:, :ha].T)
            y += _mm_arrays(b2, wd[:, ha:].T)
        if bias is not None:
            y += bias._data
        na, nb, nw, _ = ctx.needs_input_grad
        # the inputs only for the weight's gradient (a frozen linear2 keeps neither), the weight for theirs
        ctx.save_for_backward(a if nw else None, b if nw else None, w if (na or nb) else None)
        ctx.shapes = (a.shape, b.shape)
        return _wrap(y.reshape(lead + (wd.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        a, b, w = ctx.saved_tensors
        na, nb, nw, nbias = ctx.needs_input_grad
        sa, sb = ctx.shapes
        ha = sa[-1]
        g2 = g.reshape(-1, g.shape[-1])
        da = (g2 @ w[:, :ha]).reshape(sa) if na else None
        db = (g2 @ w[:, ha:]).reshape(sb) if nb else None
        dw = None
        if nw:
            dw = flame.cat((g2.mT @ a.reshape(-1, ha), g2.mT @ b.reshape(-1, b.shape[-1])), dim=1)
        dbias = g2.sum(0) if nbias else None
        return da, db, dw, dbias


def linear_cat2(a, b, weight, bias=None):
    """F.linear(cat((a, b), -1), weight, bias) as one fused op (see LinearCat2); autocast-aware like F.linear."""
    if _amp.active:
        a, b, weight, bias = _amp.cast_inputs("lower", a, b, weight, bias)
    if a.shape[:-1] != b.shape[:-1] or a.shape[-1] + b.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear_cat2: inputs {tuple(a.shape)} and {tuple(b.shape)} do not fit a weight of shape "
                         f"{tuple(weight.shape)}")
    return LinearCat2.apply(a, b, weight, bias)


def silu(x):
    return Silu.apply(x)


def norm_modulate(x, shift, scale, eps=1e-6):
    """modulate(LayerNorm(x) without affine, shift, scale), the input of every Flux sub-block; x (B, L, H),
    shift and scale (B, H), or (H,) for all samples alike (what Modulation gives for one sample): a per-feature
    affine, which then runs inside the fused LayerNorm (weight 1 + scale, bias shift), one pass instead of two."""
    H = x.shape[-1]
    if shift.ndim == 1 and scale.ndim == 1:
        return F.layer_norm(x, (H,), weight=1 + scale, bias=shift, eps=eps)
    return modulate(F.layer_norm(x, (H,), eps=eps), shift, scale)


def qk_norm(x, scale, eps=1e-6):
    """RMSNorm over the head dim (float32 statistics) times the learnable scale: BFL's QKNorm halves."""
    return F.rms_norm(x, (x.shape[-1],), scale, eps=eps)


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


def rope(x, freqs):
    """Rotate q or k in the (B, L, heads, D) layout by freqs: per-row tables (B*L, 1, 1, D/2, 2, 2) from
    `rope_rows`, or BFL's (B or 1, 1, L, D/2, 2, 2). In float32, cast back to x's dtype.

    The rotation depends on the position only, so the kernel sees x as B*L rows of (heads, 1, D) with one table
    per row: no transpose to (B, heads, L, D) is needed."""
    B, L, Hh, D = x.shape
    if freqs.shape[0] != B * L or freqs.shape[2] != 1:
        freqs = rope_rows(freqs, B)
    return apply_rope(x.reshape(B * L, Hh, 1, D), freqs).reshape(B, L, Hh, D)


def attention(q, k, v, freqs):
    """RoPE on q and k, then softmax(q k^T / sqrt(D)) v over the joint sequence: q, k, v (B, L, heads, D) ->
    (B, L, heads*D)."""
    B, L, Hh, D = q.shape
    q, k = rope(q, freqs), rope(k, freqs)  # rebinding frees the unrotated copies (when the caller holds none)
    o = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, heads, L, D)
    return o.transpose(1, 2).reshape(B, L, Hh * D)
