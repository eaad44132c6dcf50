"""scaled_dot_product_attention is flame_core's (flash kernels on cuda); re-exported here under PyTorch's name."""
try:
    from flame_core.ops.attention import scaled_dot_product_attention
    SDPA_IMPORT_ERROR = None
except ImportError as _e:  # flame_core.ops.attention not present in this build
    SDPA_IMPORT_ERROR = _e

    def scaled_dot_product_attention(*args, **kwargs):
        raise ImportError(f"scaled_dot_product_attention needs flame_core.ops.attention, which failed to import: "
                          f"{SDPA_IMPORT_ERROR}")
