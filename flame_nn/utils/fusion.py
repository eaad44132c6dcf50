"""Folding an eval-mode batch norm into the convolution or linear layer before it, PyTorch's torch.nn.utils.fusion:
W' = W * gamma / sqrt(var + eps) (per output channel), b' = (b - mean) * gamma / sqrt(var + eps) + beta. A missing
layer bias or batch-norm affine part counts as zeros (bias, beta) and ones (gamma)."""
import copy

from ..parameter import Parameter


def _check_eval(layer, bn):
    if layer.training or bn.training:
        raise AssertionError("Fusion only for eval!")
    if getattr(bn, "running_mean", None) is None or getattr(bn, "running_var", None) is None:
        raise AssertionError("bn.running_mean and bn.running_var must not be None")


def _scale_and_shift(bias, bn_rm, bn_rv, bn_eps, bn_w, bn_b):
    """(gamma / sqrt(var + eps), (bias - mean) * that + beta), the per-channel factor and the fused bias."""
    zeros = bn_rm.new_zeros(tuple(bn_rm.shape))
    scale = (bn_rv + bn_eps).rsqrt() * (1 if bn_w is None else bn_w)
    return scale, ((zeros if bias is None else bias) - bn_rm) * scale + (zeros if bn_b is None else bn_b)


def fuse_conv_bn_weights(conv_w, conv_b, bn_rm, bn_rv, bn_eps, bn_w, bn_b, transpose=False):
    """(weight, bias) Parameters of the convolution followed by the batch norm, in the convolution's dtypes;
    transpose: a transposed convolution (output channels in dim 1)."""
    scale, fused_b = _scale_and_shift(conv_b, bn_rm, bn_rv, bn_eps, bn_w, bn_b)
    shape = (1, -1) if transpose else (-1, 1)
    fused_w = conv_w * scale.reshape(*shape, *[1] * (conv_w.ndim - 2))
    b_dtype = conv_w.dtype if conv_b is None else conv_b.dtype
    return (Parameter(fused_w.to(conv_w.dtype), conv_w.requires_grad),
            Parameter(fused_b.to(b_dtype), conv_b is not None and conv_b.requires_grad))


def fuse_conv_bn_eval(conv, bn, transpose=False):
    """A copy of `conv` computing bn(conv(x)), both in eval mode (bn with running statistics)."""
    _check_eval(conv, bn)
    fused = copy.deepcopy(conv)
    fused.weight, fused.bias = fuse_conv_bn_weights(fused.weight, fused.bias, bn.running_mean, bn.running_var, bn.eps,
                                                    bn.weight, bn.bias, transpose)
    return fused


def fuse_linear_bn_weights(linear_w, linear_b, bn_rm, bn_rv, bn_eps, bn_w, bn_b):
    """(weight, bias) Parameters of the linear layer followed by the batch norm (its features the linear outputs, or
    one feature broadcast over them)."""
    scale, fused_b = _scale_and_shift(linear_b, bn_rm, bn_rv, bn_eps, bn_w, bn_b)
    return (Parameter(linear_w * scale.unsqueeze(-1), linear_w.requires_grad),
            Parameter(fused_b, linear_b is not None and linear_b.requires_grad))


def fuse_linear_bn_eval(linear, bn):
    """A copy of `linear` computing bn(linear(x)), both in eval mode (bn with running statistics and
    bn.num_features == linear.out_features or 1)."""
    _check_eval(linear, bn)
    if linear.out_features != bn.num_features and bn.num_features != 1:
        raise AssertionError(f"To fuse, linear.out_features == bn.num_features or bn.num_features == 1, got "
                             f"linear.out_features={linear.out_features} and bn.num_features={bn.num_features}")
    fused = copy.deepcopy(linear)
    fused.weight, fused.bias = fuse_linear_bn_weights(fused.weight, fused.bias, bn.running_mean, bn.running_var,
                                                      bn.eps, bn.weight, bn.bias)
    return fused
