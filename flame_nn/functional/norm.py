"""layer_norm, group_norm, rms_norm: flame_core's fused norms (flame_core.ops.norms).

Autocast category "native" (flame_core.amp): no casts. The kernels read float16/bfloat16 activations directly,
compute statistics and the normalisation in float32 and return the input's dtype; float32 weights are read as they
are. (PyTorch casts half inputs of its norms to float32 and returns float32: the same arithmetic, two more passes.)
"""
from flame_core.ops import norms as _N


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _N.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """eps=None: the machine epsilon of the input dtype (PyTorch)."""
    return _N.rms_norm(input, normalized_shape, weight, eps)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    return _N.group_norm(input, num_groups, weight, bias, eps)
