"""scaled_dot_product_attention is flame_core's (flash kernels on cuda); re-exported here under PyTorch's name, with
qkv_attention (the same over a packed q | k | v projection, heads split and merged inside the op)."""
from flame_core.ops.attention import qkv_attention, scaled_dot_product_attention

__all__ = ["qkv_attention", "scaled_dot_product_attention"]
