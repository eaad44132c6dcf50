"""layer_norm, group_norm, group_norm_silu, rms_norm, add_layer_norm, add_rms_norm, joint_rms_norm: flame_core's fused
norms (flame_core.ops.norms); batch_norm from Tensor ops.

Autocast category "native" (flame_core.amp): no casts. The kernels read float16/bfloat16 activations directly,
compute statistics and the normalisation in float32 and return the input's dtype; float32 weights are read as they
are. (PyTorch casts half inputs of its norms to float32 and returns float32: the same arithmetic, two more passes.)
"""
from flame_core import dtypes as D
from flame_core.autograd import no_grad
from flame_core.errors import ShapeError, fmt_shape
from flame_core.memory_formats import preserve_format
from flame_core.ops import elementwise as E
from flame_core.ops import norms as _N


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _N.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """eps=None: the machine epsilon of the input dtype (PyTorch)."""
    return _N.rms_norm(input, normalized_shape, weight, eps)


def add_layer_norm(input, residual, weight=None, bias=None, eps=1e-5):
    """A FLAME op: (s, y) = (input + residual, layer_norm(s, (D,), weight, bias, eps)) over the last dim in one kernel
    each way (a pre-norm block's residual add and the next norm); see flame_core.ops.norms.add_layer_norm."""
    return _N.add_layer_norm(input, residual, weight, bias, eps)


def add_rms_norm(input, residual, weight=None, eps=1e-6):
    """A FLAME op: (s, y) = (input + residual, rms_norm(s, (D,), weight, eps)) in one kernel each way."""
    return _N.add_rms_norm(input, residual, weight, eps)


def joint_rms_norm(inputs, weights=None, eps=1e-6, rope=None):
    """A FLAME op: cat([rms_norm(x, (D,), w, eps) for x, w in zip(inputs, weights)], dim=1) of one or two (B, L, H, D)
    parts (a joint attention's q or k per stream, read in place from strided views) in one kernel each way, rotated
    by per-row RoPE tables `rope` in the same kernels when given; see flame_core.ops.norms.joint_rms_norm."""
    return _N.joint_rms_norm(inputs, weights, eps, rope)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *, memory_format=preserve_format):
    """memory_format (a FLAME extension): the output's layout, written by the same pass - flame.preserve_format (the
    input's), flame.contiguous_format or flame.channels_last (what the implicit-GEMM conv reads in place)."""
    return _N.group_norm(input, num_groups, weight, bias, eps, memory_format=memory_format)


def group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-5, *, memory_format=preserve_format):
    """silu(group_norm(input, num_groups, weight, bias, eps)) as one fused op (one pass over memory forward, one
    backward); the pre-activation stays in fp32 (the two ops in sequence round it to the input dtype between them).
    memory_format as group_norm's."""
    return _N.group_norm_silu(input, num_groups, weight, bias, eps, memory_format=memory_format)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Normalise over every dim but the channel dim 1. In training: batch statistics (biased variance), and the
    running statistics, when given, move by `momentum` towards the batch mean and the unbiased batch variance (in
    place, without gradient). Otherwise: the running statistics. Half inputs are normalised in float32."""
    if input.ndim < 2:
        raise ShapeError(f"batch_norm: expected an input with a channel dim (N, C, ...), got {fmt_shape(input.shape)}")
    C = input.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ShapeError(f"batch_norm: {name} has shape {fmt_shape(t.shape)}, the input {fmt_shape(input.shape)} "
                             f"has {C} channels")
    dims = (0,) + tuple(range(2, input.ndim))
    shape = (1, C) + (1,) * (input.ndim - 2)
    x = input.float() if input.dtype in (D.float16, D.bfloat16) else input
    if training:
        count = input.numel() // max(C, 1)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{fmt_shape(input.shape)}")
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, unbiased=False, keepdim=True)
        if running_mean is not None or running_var is not None:
            with no_grad():
                if running_mean is not None:
                    running_mean.mul_(1.0 - momentum).add_(mean.reshape(C).to(running_mean.dtype) * momentum)
                if running_var is not None:
                    unbiased = var.reshape(C) * (count / (count - 1))
                    running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype) * momentum)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: running_mean and running_var are required when training=False")
        mean = running_mean.to(x.dtype).reshape(shape)
        var = running_var.to(x.dtype).reshape(shape)
    y = (x - mean) * E.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(x.dtype).reshape(shape)
    if bias is not None:
        y = y + bias.to(x.dtype).reshape(shape)
    return y.to(input.dtype)


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    """Each (sample, channel) normalised over its spatial dims: batch_norm over the input viewed as (1, N * C, ...)
    with the per-channel tensors repeated per sample (PyTorch's formulation); the running statistics, when given and
    use_input_stats, move by `momentum` towards the samples' mean statistics (in place, without gradient)."""
    if input.ndim < 3:
        raise ShapeError(f"instance_norm: expected (N, C, ...) with at least one spatial dim, got "
                         f"{fmt_shape(input.shape)}")
    N, C = input.shape[:2]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ShapeError(f"instance_norm: {name} has shape {fmt_shape(t.shape)}, the input "
                             f"{fmt_shape(input.shape)} has {C} channels")
    if not use_input_stats and (running_mean is None or running_var is None):
        raise ValueError("instance_norm: running_mean and running_var are required when use_input_stats=False")
    rm = running_mean.repeat(N) if running_mean is not None else None
    rv = running_var.repeat(N) if running_var is not None else None
    w = weight.repeat(N) if weight is not None else None
    b = bias.repeat(N) if bias is not None else None
    y = batch_norm(input.reshape(1, N * C, *input.shape[2:]), rm, rv, w, b, use_input_stats, momentum, eps)
    if use_input_stats:
        with no_grad():
            if running_mean is not None:
                running_mean.copy_(rm.reshape(N, C).mean(0))
            if running_var is not None:
                running_var.copy_(rv.reshape(N, C).mean(0))
    return y.reshape(*input.shape)
