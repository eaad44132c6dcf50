"""flame_nn.functional: stateless ops with PyTorch's names and signatures (`import flame_nn.functional as F`)."""
from flame_core.ops.conv import conv2d
from flame_core.ops.embedding import embedding
from flame_core.ops.indexing import pad, one_hot
from flame_core.ops.linear import linear
from flame_core.ops.pooling import max_pool2d, avg_pool2d, adaptive_avg_pool2d

from .activation import relu, gelu, silu, tanh, sigmoid, softmax, log_softmax
from .attention import scaled_dot_product_attention
from .dropout import dropout
from .loss import mse_loss, l1_loss, nll_loss, cross_entropy
from .norm import layer_norm, group_norm, rms_norm
from .upsample import interpolate

__all__ = ["conv2d", "pad", "one_hot", "relu", "gelu", "silu", "tanh", "sigmoid", "softmax", "log_softmax",
           "scaled_dot_product_attention", "dropout", "embedding", "linear", "mse_loss", "l1_loss", "nll_loss",
           "cross_entropy", "layer_norm", "group_norm", "rms_norm", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
           "interpolate"]
