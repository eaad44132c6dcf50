"""TransformerEncoderLayer and TransformerEncoder: PyTorch's modules, submodule names (self_attn, linear1, linear2,
norm1, norm2, dropout, dropout1, dropout2; layers.N) and call signatures.

Attention runs through MultiheadAttention with need_weights=False, i.e. F.scaled_dot_product_attention (flash
kernels on cuda) unless attention dropout is active in training. FLAME has no nested tensors, but it gives the
numbers of PyTorch's nested-tensor "fast path" where PyTorch takes it (TransformerEncoder with
`enable_nested_tensor`, in eval without autograd, with a key padding mask and no attention mask): each sequence is
its first n positions (n = its unpadded count; with `mask_check`, a mask that is not left-aligned takes the dense
path instead), the padded positions leave the layer stack as zeros (then the final norm). Elsewhere the padded
positions are computed like the others (PyTorch's dense path).
"""
import copy
import warnings

import numpy as np

import flame_core as flame

from .. import functional as F
from ..containers import ModuleList
from ..module import Module
from .activation import GELU, ReLU
from .attention import MultiheadAttention
from .dropout import Dropout
from .linear import Linear
from .norm import LayerNorm


def _activation(activation):
    if callable(activation):
        return activation
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


class TransformerEncoderLayer(Module):
    """Self-attention and a feed-forward block, each with a residual connection and a LayerNorm (after the residual
    by default, before the block with norm_first=True)."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu, layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, bias=True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)
        act = self.activation   # PyTorch's flag for its fused path (1 relu, 2 gelu, 0 other)
        self.activation_relu_or_gelu = (1 if act is F.relu or isinstance(act, ReLU) else
                                        2 if act is F.gelu or isinstance(act, GELU) else 0)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=bool(is_causal))[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoder(Module):
    """`num_layers` deep copies of `encoder_layer` (as `layers.0`, `layers.1`, ...), then the optional `norm`.

    enable_nested_tensor / mask_check: PyTorch's nested-tensor path, as the numbers it gives (module docstring).
    `use_nested_tensor` says whether the layers allow it (PyTorch's conditions; a warning names the one that fails)."""

    def __init__(self, encoder_layer, num_layers, norm=None, enable_nested_tensor=True, mask_check=True):
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check
        why_not = _why_not_nested(encoder_layer)
        if enable_nested_tensor and why_not:
            warnings.warn(f"enable_nested_tensor is True, but self.use_nested_tensor is False because {why_not}")
        self.use_nested_tensor = bool(enable_nested_tensor) and not why_not

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        padded = self._nested_padding(src, mask, src_key_padding_mask)
        kpm = src_key_padding_mask if padded is None else flame.tensor(padded, device=src.device)
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=kpm, is_causal=bool(is_causal))
        if padded is not None:   # PyTorch's to_padded_tensor(0.0)
            x = x.masked_fill(kpm.unsqueeze(-1), 0.0)
        if self.norm is not None:
            x = self.norm(x)
        return x

    def _nested_padding(self, src, mask, key_padding_mask):
        """The (B, S) bool array of positions PyTorch's nested path leaves out (each row: past its unpadded count),
        or None where PyTorch computes densely."""
        first = self.layers[0]
        if (not self.use_nested_tensor or first.training or src.dim() != 3 or key_padding_mask is None
                or mask is not None or flame.amp.is_autocast_enabled(src.device.type)):
            return None
        if flame.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in first.parameters())):
            return None
        m = key_padding_mask.detach().cpu().numpy()
        keep = ~m if m.dtype == np.bool_ else m == 0   # a float mask keeps its zeros, as logical_not does
        first_n = np.arange(keep.shape[1])[None, :] < keep.sum(axis=1, keepdims=True)
        if self.mask_check and not np.array_equal(keep, first_n):   # not left-aligned: the dense path
            return None
        return ~first_n


def _why_not_nested(layer):
    """PyTorch's reason an encoder layer cannot take the nested-tensor path ('' when it can)."""
    name = "encoder_layer"
    if not isinstance(layer, TransformerEncoderLayer):
        return f"{name} was not TransformerEncoderLayer"
    if layer.norm_first:
        return f"{name}.norm_first was True"
    if not layer.self_attn.batch_first:
        return f"{name}.self_attn.batch_first was not True(use batch_first for better inference performance)"
    if not layer.self_attn._qkv_same_embed_dim:
        return f"{name}.self_attn._qkv_same_embed_dim was not True"
    if getattr(layer.self_attn, "in_proj_bias", None) is None:
        return f"{name}.self_attn was passed bias=False"
    if not layer.activation_relu_or_gelu:
        return f"{name}.activation_relu_or_gelu was not True"
    if layer.norm1.eps != layer.norm2.eps:
        return f"{name}.norm1.eps was not equal to {name}.norm2.eps"
    if layer.self_attn.num_heads % 2 == 1:
        return f"{name}.self_attn.num_heads is odd"
    return ""
