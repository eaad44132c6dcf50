"""torch.nn.utils' surface: gradient clipping (clip_grad), parameters as one vector (convert_parameters), the
hook-based weight_norm / spectral_norm (flame_nn.norm_reparam) and the parametrizations (parametrize,
parametrizations), variable-length sequences (rnn), conv / linear + batch-norm folding (fusion), skip_init (init),
functional_call (stateless) and convert_conv2d_weight_memory_format (memory_format); zero_grads and grad_arrays
(grads) read and reset gradients where the gradient pool holds them."""
from ..norm_reparam import remove_spectral_norm, remove_weight_norm, spectral_norm, weight_norm
from . import parametrizations, parametrize, rnn, stateless
from .clip_grad import clip_grad_norm, clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm
from .convert_parameters import parameters_to_vector, vector_to_parameters
from .fusion import fuse_conv_bn_eval, fuse_conv_bn_weights, fuse_linear_bn_eval, fuse_linear_bn_weights
from .grads import _pool, grad_arrays, zero_grads  # noqa: F401  (_pool: Module.to unregisters moved parameters)
from .init import skip_init
from .memory_format import convert_conv2d_weight_memory_format

__all__ = ["clip_grad_norm", "clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm",
           "parameters_to_vector", "vector_to_parameters", "weight_norm", "remove_weight_norm", "spectral_norm",
           "remove_spectral_norm", "parametrize", "parametrizations", "rnn", "stateless", "fuse_conv_bn_eval",
           "fuse_conv_bn_weights", "fuse_linear_bn_eval", "fuse_linear_bn_weights", "skip_init",
           "convert_conv2d_weight_memory_format", "zero_grads", "grad_arrays"]
