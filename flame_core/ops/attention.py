"""scaled_dot_product_attention: differentiable, memory-efficient (flame_core.kernels.attention) on every device.

PyTorch's semantics on (..., L, E) tensors: query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), leading dims
broadcast; attn_mask broadcasts to (..., Lq, Lk), bool (True = attend) or float (added to the scaled scores);
is_causal keeps key j for query i when j <= i (top-left aligned). A row that attends nothing outputs 0 (as torch's math
backend). The backward runs the fused array backward (recomputing the softmax from the saved logsumexp), so it is
not differentiable a second time.

qkv_attention is the same attention over a packed q | k | v projection (B, L, 3 * heads * D) -> (B, L, heads * D):
the heads are split and merged by strides inside the one op (the kernels take strided operands), not by the five
to seven view ops a model would issue around scaled_dot_product_attention -- at 77 tokens each op costs more host
time than the GPU spends on the layer's attention.
"""
import math

import numpy as np

from .. import backend
from .. import checkpoint as _ckpt
from ..amp import autocast_mode as _amp  # autocast hook (flame_core.amp)
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..kernels import attention as K
from ..tensor import Tensor, _wrap, check_same_device
from .creation import rand
from .elementwise import where
from .reduction import softmax


def _to4(a, lead):
    """(lead..., L, E) array -> (B, H, L, E): 1s prepended, or the leading dims but the last folded into B."""
    a = backend.xp_of(a).broadcast_to(a, lead + a.shape[-2:]) if a.shape[:-2] != lead else a
    if len(lead) <= 2:
        return a.reshape((1,) * (2 - len(lead)) + a.shape)
    return a.reshape((math.prod(lead[:-1]), lead[-1]) + a.shape[-2:])


def _mask_to4(m, lead, lq, lk):
    if m.ndim <= 4 and len(lead) <= 2:  # broadcasting left to the kernels (no copy)
        return m.reshape((1,) * (4 - m.ndim) + m.shape)
    return _to4(backend.xp_of(m).broadcast_to(m, lead + (lq, lk)), lead)


def _sum_to(a, shape, dtype):
    """Sum a gradient over the dims its input was broadcast along (float32 sums for half inputs)."""
    extra = a.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, s in enumerate(shape) if s == 1 and a.shape[i + extra] != 1)
    if axes:
        acc = np.float64 if a.dtype == np.float64 else np.float32
        a = a.sum(axis=axes, dtype=acc, keepdims=True).astype(dtype)
    return a.reshape(shape)


def _attend(q4, k4, v4, m4, is_causal, scale, op):
    """(stash, o4, lse) of the attention kernels on (B, H, L, E) arrays; under selective checkpointing the first
    run's kept output serves the recompute (`stash` is what `_keep` hands the output to)."""
    kept = _ckpt.stash("attention")
    if kept is not None and (kept.replaying or (kept.source is not None and "attention" in kept.source.kinds)):
        o4, lse = (kept if kept.replaying else kept.source).take("attention")
        want = q4.shape[:3] + v4.shape[3:]
        if o4.shape != want or o4.dtype != q4.dtype:
            raise ShapeError(f"{op}: the recompute's output {fmt_shape(want)} {q4.dtype} differs from the kept "
                             f"{fmt_shape(o4.shape)} {o4.dtype}")
        return kept, o4, lse
    return (kept,) + K.flash_attention_forward(q4, k4, v4, m4, is_causal, scale)


def _keep(kept, o4, lse, out):
    if kept is not None and not kept.replaying and "attention" in kept.kinds:
        kept.put("attention", (o4, lse), out._version)


class ScaledDotProductAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, lead):
        lq, lk = q.shape[-2], k.shape[-2]
        q4, k4, v4 = _to4(q._data, lead), _to4(k._data, lead), _to4(v._data, lead)
        m4 = None if attn_mask is None else _mask_to4(attn_mask._data, lead, lq, lk)
        kept, o4, lse = _attend(q4, k4, v4, m4, is_causal, scale, "scaled_dot_product_attention")
        out = _wrap(o4.reshape(lead + o4.shape[-2:]))
        _keep(kept, o4, lse, out)
        ctx.save_for_backward(q, k, v, out)
        ctx.lse, ctx.mask4, ctx.is_causal, ctx.scale, ctx.lead = lse, m4, is_causal, scale, lead
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out = ctx.saved_tensors
        lead = ctx.lead
        q4, k4, v4 = _to4(q._data, lead), _to4(k._data, lead), _to4(v._data, lead)
        o4, g4 = _to4(out._data, lead), _to4(g._data.astype(q._data.dtype, copy=False), lead)
        dq4, dk4, dv4 = K.flash_attention_backward(g4, q4, k4, v4, o4, ctx.lse, ctx.mask4, ctx.is_causal, ctx.scale)
        grads = []
        for t, d4, need in ((q, dq4, ctx.needs_input_grad[0]), (k, dk4, ctx.needs_input_grad[1]),
                            (v, dv4, ctx.needs_input_grad[2])):
            grads.append(_wrap(_sum_to(d4.reshape(lead + d4.shape[-2:]), tuple(t.shape), t._data.dtype))
                         if need else None)
        return grads[0], grads[1], grads[2], None, None, None, None


def _check_mask(op, attn_mask, full, what):
    """attn_mask a bool or floating point Tensor that broadcasts to the shape `full` (named `what` in the error)."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{op}: attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype.name != "bool" and not attn_mask.dtype.is_floating_point:
        raise DTypeError(f"{op}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    try:
        ok = tuple(np.broadcast_shapes(tuple(attn_mask.shape), full)) == full
    except ValueError:
        ok = False
    if not ok:
        raise ShapeError(f"{op}: attn_mask of shape {fmt_shape(attn_mask.shape)} does not broadcast to {what} = "
                         f"{fmt_shape(full)}")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(query @ key^T * scale + mask) @ value, as torch.nn.functional.scaled_dot_product_attention.

    query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev) -> (..., Lq, Ev). scale defaults to 1 / sqrt(E).
    attn_mask: bool (True = attend) or additive, broadcast to (..., Lq, Lk); is_causal: the top-left-aligned lower
    triangle (as torch). dropout_p > 0 drops attention weights (each kept one scaled by 1 / (1 - p)) on a dense path
    that materialises the (..., Lq, Lk) weights -- call it with dropout_p=0.0 outside training, as with torch.
    enable_gqa: key / value with fewer heads (dimension -3) than the query, each shared by Hq / Hkv query heads.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ShapeError(f"scaled_dot_product_attention: {name} needs at least 2 dims (L, E), got shape "
                             f"{fmt_shape(t.shape)}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1], got {dropout_p}")
    if enable_gqa:
        key, value = _shared_kv_heads(query, key, value)
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both "
                         "(as torch)")
    check_same_device("scaled_dot_product_attention", query, key, value,
                      *(() if attn_mask is None else (attn_mask,)))
    if _amp.active:  # autocast hook
        query, key, value = _amp.cast_inputs("lower", query, key, value)
    if not (query.dtype == key.dtype == value.dtype):
        raise DTypeError(f"scaled_dot_product_attention: query, key and value must share a dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not query.dtype.is_floating_point:
        raise DTypeError(f"scaled_dot_product_attention: expected floating point inputs, got {query.dtype}")
    qs, ks, vs = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {fmt_shape(qs)}, key {fmt_shape(ks)} and value "
                         f"{fmt_shape(vs)} do not fit (query and key share E, key and value share L)")
    try:
        lead = tuple(np.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2]))
    except ValueError:
        raise ShapeError(f"scaled_dot_product_attention: the batch dims of query {fmt_shape(qs)}, key "
                         f"{fmt_shape(ks)} and value {fmt_shape(vs)} do not broadcast") from None
    if attn_mask is not None:
        _check_mask("scaled_dot_product_attention", attn_mask, lead + (qs[-2], ks[-2]), "(..., Lq, Lk)")
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else float(scale)
    if dropout_p:
        return _attention_with_dropout(query, key, value, attn_mask, bool(is_causal), scale, float(dropout_p))
    return ScaledDotProductAttention.apply(query, key, value, attn_mask, bool(is_causal), scale, lead)


def _shared_kv_heads(query, key, value):
    """enable_gqa: key and value repeated along their head dimension (-3) to the query's head count."""
    if query.ndim < 3 or key.ndim < 3 or value.ndim < 3:
        raise ShapeError(f"scaled_dot_product_attention: enable_gqa needs a head dimension (-3) in query, key and "
                         f"value, got {fmt_shape(query.shape)}, {fmt_shape(key.shape)}, {fmt_shape(value.shape)}")
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk != hv or hq % hk:
        raise ShapeError(f"scaled_dot_product_attention: enable_gqa needs key and value with one head count that "
                         f"divides the query's, got {hq} query, {hk} key and {hv} value heads")
    if hq == hk:
        return key, value
    n = hq // hk
    return key.repeat_interleave(n, dim=-3), value.repeat_interleave(n, dim=-3)


def _attention_with_dropout(q, k, v, mask, is_causal, scale, p):
    """The dense path for attention dropout: weights = dropout(softmax(q k^T scale + mask)) in float32 (half inputs),
    then weights @ v -- a composition of differentiable ops."""
    work = q.dtype if q.dtype.itemsize >= 4 else None
    qf, kf = (q, k) if work is not None else (q.float(), k.float())
    s = (qf @ kf.transpose(-2, -1)) * scale
    Lq, Lk = s.shape[-2], s.shape[-1]
    neg = float("-inf")
    if is_causal:
        causal = Tensor._from_array_copy(s._xp().asarray(np.tril(np.ones((Lq, Lk), dtype=bool))))
        s = where(causal, s, neg)
    if mask is not None:
        s = where(mask, s, neg) if mask.dtype.name == "bool" else s + mask.to(s.dtype)
    w = softmax(s, -1)
    keep = rand(tuple(w.shape), dtype=w.dtype, device=w.device) >= p
    w = w * (keep.to(w.dtype) * (0.0 if p >= 1.0 else 1.0 / (1.0 - p)))
    return w.to(v.dtype) @ v



def _split_heads(a, heads):
    """(B, H, L, D) strided views of q, k, v in a packed (B, L, 3 * H * D) array (no copy)."""
    B, L, W = a.shape
    a5 = a.reshape(B, L, 3, heads, W // (3 * heads))
    return tuple(a5[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _merge_heads(o4):
    """(B, H, L, D) -> (B, L, H * D): a view where o4 lies in (B, L, H, D) memory (the kernels' output for q in a
    packed projection), else a copy (the reference's contiguous output)."""
    B, H, L, D = o4.shape
    return o4.transpose(0, 2, 1, 3).reshape(B, L, H * D)


class QKVAttention(Function):
    @staticmethod
    def forward(ctx, qkv, attn_mask, heads, is_causal, scale):
        if attn_mask is None and _ckpt.stash("attention") is None:   # cuda's per-op path: one packed launch
            r = K.qkv_attention_forward(qkv._data, heads, is_causal, scale)
            if r is not None:
                out = _wrap(r[0])
                ctx.save_for_backward(qkv, out)
                ctx.lse, ctx.mask4, ctx.is_causal, ctx.scale, ctx.heads = r[1], None, is_causal, scale, heads
                return out
        q4, k4, v4 = _split_heads(qkv._data, heads)
        B, H, L, _ = q4.shape
        m4 = None if attn_mask is None else _mask_to4(attn_mask._data, (B, H), L, L)
        kept, o4, lse = _attend(q4, k4, v4, m4, is_causal, scale, "qkv_attention")
        out = _wrap(_merge_heads(o4))
        _keep(kept, o4, lse, out)
        ctx.save_for_backward(qkv, out)
        ctx.lse, ctx.mask4, ctx.is_causal, ctx.scale, ctx.heads = lse, m4, is_causal, scale, heads
        return out

    @staticmethod
    def backward(ctx, g):
        qkv, out = ctx.saved_tensors
        a = qkv._data
        heads = ctx.heads
        q4, k4, v4 = _split_heads(a, heads)
        B, H, L, D = q4.shape
        o4 = out._data.reshape(B, L, H, D).transpose(0, 2, 1, 3)
        g4 = g._data.astype(a.dtype, copy=False).reshape(B, L, H, D).transpose(0, 2, 1, 3)
        grads = K.flash_attention_backward(g4, q4, k4, v4, o4, ctx.lse, ctx.mask4, ctx.is_causal, ctx.scale)
        xp = backend.xp_of(a)
        d = xp.stack([d4.transpose(0, 2, 1, 3) for d4 in grads], axis=2)                     # (B, L, 3, H, D)
        return _wrap(d.reshape(a.shape).astype(a.dtype, copy=False)), None, None, None, None


def qkv_attention(qkv, num_heads, attn_mask=None, is_causal=False, scale=None):
    """Multi-head attention over a packed projection: qkv (B, L, 3 * num_heads * D) holds q | k | v on the last dim,
    each laid out (num_heads, D) as a linear over stacked q, k, v weights writes them -> (B, L, num_heads * D).

    The same as splitting the heads, scaled_dot_product_attention((B, heads, L, D) q, k, v, attn_mask, is_causal,
    scale) and merging them back, as one op. attn_mask broadcasts to (B, num_heads, L, L), bool (True = attend) or
    float (added to the scaled scores); scale defaults to 1 / sqrt(D).
    """
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv_attention: qkv must be a Tensor, got {type(qkv).__name__}")
    heads = int(num_heads)
    if qkv.ndim != 3 or heads < 1 or qkv.shape[-1] % (3 * heads) or qkv.shape[1] == 0:
        raise ShapeError(f"qkv_attention: qkv must be (B, L, 3 * num_heads * D) with L > 0, got shape "
                         f"{fmt_shape(qkv.shape)} for num_heads={num_heads}")
    if attn_mask is not None and is_causal:
        raise ValueError("qkv_attention: pass either attn_mask or is_causal=True, not both")
    check_same_device("qkv_attention", qkv, *(() if attn_mask is None else (attn_mask,)))
    if _amp.active:  # autocast hook
        (qkv,) = _amp.cast_inputs("lower", qkv)
    if not qkv.dtype.is_floating_point:
        raise DTypeError(f"qkv_attention: expected a floating point qkv, got {qkv.dtype}")
    B, L, W = qkv.shape
    D = W // (3 * heads)
    if attn_mask is not None:
        _check_mask("qkv_attention", attn_mask, (B, heads, L, L), "(B, heads, L, L)")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return QKVAttention.apply(qkv, attn_mask, heads, bool(is_causal), scale)
