"""layer_norm, group_norm, rms_norm: flame_core's fused norms (flame_core.ops.norms) behind autocast's fp32 policy."""
from flame_core.amp import autocast_mode as _amp
from flame_core.ops import norms as _N


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("fp32", input, weight, bias)
    return _N.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """eps=None: the machine epsilon of the input dtype (PyTorch)."""
    if _amp.active:
        input, weight = _amp.cast_inputs("fp32", input, weight)
    return _N.rms_norm(input, normalized_shape, weight, eps)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("fp32", input, weight, bias)
    return _N.group_norm(input, num_groups, weight, bias, eps)
