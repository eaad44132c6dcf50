"""scaled_dot_product_attention is flame_core's (flash kernels on cuda); re-exported here under PyTorch's name."""
from flame_core.ops.attention import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention"]
