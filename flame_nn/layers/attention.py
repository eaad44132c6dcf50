"""MultiheadAttention (PyTorch's parameters, names and call signature), self- and cross-attention.

need_weights=False runs through F.scaled_dot_product_attention (flash kernels on cuda). need_weights=True (PyTorch's
default) must materialise the attention matrix to return it, so it computes softmax(QK^T / sqrt(d)) explicitly; so
does attention dropout in training (the weights are dropped before the product with V, as PyTorch's module does).
"""
import math

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module
from .linear import Linear


class MultiheadAttention(Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, kdim=None, vdim=None, batch_first=False,
                 device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        E = embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = new_parameter((3 * E, E), dtype, device)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = new_parameter((E, E), dtype, device)
            self.k_proj_weight = new_parameter((E, self.kdim), dtype, device)
            self.v_proj_weight = new_parameter((E, self.vdim), dtype, device)
        if bias:
            self.in_proj_bias = new_parameter((3 * E,), dtype, device)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(E, E, bias=bias, device=device, dtype=dtype)
        self._reset_parameters()

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)

    def _projections(self):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            return (w[:E], bq), (w[E:2 * E], bk), (w[2 * E:], bv)
        return (self.q_proj_weight, bq), (self.k_proj_weight, bk), (self.v_proj_weight, bv)

    def _mask(self, attn_mask, key_padding_mask, N, L, S, dtype, device, is_causal):
        """One additive float mask broadcastable to (N, H, L, S), or None. Bool masks: True = not allowed."""
        m = None
        if attn_mask is None and is_causal:
            attn_mask = flame.ones(L, S, dtype=flame.bool, device=device).triu(1)
        if attn_mask is not None:
            a = attn_mask
            if a.ndim == 3:  # (N*H, L, S)
                if a.shape[0] != N * self.num_heads:
                    raise ShapeError(f"MultiheadAttention: 3-D attn_mask {fmt_shape(a.shape)} must be "
                                     f"(N*num_heads={N * self.num_heads}, {L}, {S})")
                a = a.reshape(N, self.num_heads, L, S)
            elif tuple(a.shape) != (L, S):
                raise ShapeError(f"MultiheadAttention: attn_mask {fmt_shape(a.shape)} must be ({L}, {S}) or "
                                 f"(N*num_heads, {L}, {S})")
            m = _additive(a, dtype)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (N, S):
                raise ShapeError(f"MultiheadAttention: key_padding_mask {fmt_shape(key_padding_mask.shape)} must be "
                                 f"({N}, {S})")
            k = _additive(key_padding_mask, dtype).reshape(N, 1, 1, S)
            m = k if m is None else m + k
        return m

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise ShapeError(f"MultiheadAttention: expected 3-D query/key/value, got {fmt_shape(query.shape)}, "
                             f"{fmt_shape(key.shape)}, {fmt_shape(value.shape)}")
        if not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        N, L, E = query.shape
        S = key.shape[1]
        H, D = self.num_heads, self.head_dim
        if E != self.embed_dim or key.shape[0] != N or value.shape[:2] != key.shape[:2]:
            raise ShapeError(f"MultiheadAttention: query {fmt_shape(query.shape)}, key {fmt_shape(key.shape)}, "
                             f"value {fmt_shape(value.shape)} do not fit embed_dim={self.embed_dim}")
        (wq, bq), (wk, bk), (wv, bv) = self._projections()
        q = F.linear(query, wq, bq).reshape(N, L, H, D).transpose(1, 2)  # (N, H, L, D)
        k = F.linear(key, wk, bk).reshape(N, S, H, D).transpose(1, 2)    # (N, H, S, D)
        v = F.linear(value, wv, bv).reshape(N, S, H, D).transpose(1, 2)  # (N, H, S, D)
        p = self.dropout if self.training else 0.0
        explicit = need_weights or p > 0  # dropout drops the explicit weights (PyTorch's module does the same)
        causal_in_mask = is_causal and (explicit or key_padding_mask is not None)
        mask = self._mask(attn_mask, key_padding_mask, N, L, S, q.dtype, query.device, causal_in_mask)
        weights = None
        if explicit:
            scores = (q @ k.mT) * (1.0 / math.sqrt(D))  # (N, H, L, S)
            if mask is not None:
                scores = scores + mask
            w = F.softmax(scores, -1)
            out = F.dropout(w, p, self.training) @ v
            if need_weights:
                weights = w.mean(1) if average_attn_weights else w
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=bool(is_causal and mask is None))
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))  # (N, L, E)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _additive(mask, dtype):
    """Bool mask (True = masked) -> 0 / -inf; a float mask is added as is."""
    if mask.dtype.name == "bool":
        return flame.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    return mask.to(dtype)
