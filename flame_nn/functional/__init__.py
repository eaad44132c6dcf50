"""flame_nn.functional: stateless ops with PyTorch's names and signatures (`import flame_nn.functional as F`)."""
from flame_core.ops.conv import conv2d, conv2d_add, conv2d_memory_format, pad_conv2d
from flame_core.ops.im2col import fold, unfold
from flame_core.ops.indexing import one_hot, pad
from flame_core.ops.linear import linear
from flame_core.ops.pooling import (
                                    adaptive_avg_pool1d,
                                    adaptive_avg_pool2d,
                                    adaptive_max_pool1d,
                                    adaptive_max_pool2d,
                                    avg_pool1d,
                                    avg_pool2d,
                                    max_pool1d,
                                    max_pool2d,
                                    max_unpool2d,
)
from flame_core.ops.pooling3d import adaptive_avg_pool3d, adaptive_max_pool3d, avg_pool3d, max_pool3d

from .activation import (
                                    celu,
                                    celu_,
                                    elu,
                                    elu_,
                                    geglu,
                                    gelu,
                                    glu,
                                    hardshrink,
                                    hardsigmoid,
                                    hardswish,
                                    hardtanh,
                                    hardtanh_,
                                    leaky_relu,
                                    leaky_relu_,
                                    log_softmax,
                                    logsigmoid,
                                    mish,
                                    prelu,
                                    quick_gelu,
                                    relu,
                                    relu6,
                                    relu_,
                                    rrelu,
                                    rrelu_,
                                    selu,
                                    selu_,
                                    sigmoid,
                                    silu,
                                    softmax,
                                    softmin,
                                    softplus,
                                    softshrink,
                                    softsign,
                                    tanh,
                                    tanhshrink,
                                    threshold,
                                    threshold_,
)
from .attention import qkv_attention, scaled_dot_product_attention
from .bilinear import bilinear
from .conv import conv1d, conv_transpose1d, conv_transpose2d
from .conv3d import conv3d, conv_transpose3d
from .ctc_loss import ctc_loss
from .distance import cosine_similarity, normalize, pairwise_distance
from .dropout import alpha_dropout, dropout, dropout1d, dropout2d, dropout3d, feature_alpha_dropout
from .embedding import embedding
from .embedding_bag import embedding_bag
from .grid_sample import affine_grid, grid_sample
from .loss import (
                                    binary_cross_entropy,
                                    binary_cross_entropy_with_logits,
                                    cross_entropy,
                                    huber_loss,
                                    kl_div,
                                    l1_loss,
                                    mse_loss,
                                    nll_loss,
                                    smooth_l1_loss,
)
from .loss_margin import (
                                    cosine_embedding_loss,
                                    gaussian_nll_loss,
                                    hinge_embedding_loss,
                                    margin_ranking_loss,
                                    multi_margin_loss,
                                    multilabel_margin_loss,
                                    multilabel_soft_margin_loss,
                                    poisson_nll_loss,
                                    soft_margin_loss,
                                    triplet_margin_loss,
                                    triplet_margin_with_distance_loss,
)
from .misc_ops import channel_shuffle, gumbel_softmax, local_response_norm, lp_pool1d, lp_pool2d, lp_pool3d, pdist
from .norm import (
                                    add_layer_norm,
                                    add_rms_norm,
                                    batch_norm,
                                    group_norm,
                                    group_norm_silu,
                                    instance_norm,
                                    joint_rms_norm,
                                    layer_norm,
                                    rms_norm,
)
from .pixel_shuffle import pixel_shuffle, pixel_unshuffle
from .pooling import (
                                    adaptive_max_pool1d_with_indices,
                                    adaptive_max_pool2d_with_indices,
                                    adaptive_max_pool3d_with_indices,
                                    max_pool1d_with_indices,
                                    max_pool2d_with_indices,
                                    max_pool3d_with_indices,
                                    max_unpool1d,
                                    max_unpool3d,
)
from .upsample import interpolate

__all__ = ["conv2d", "conv2d_add", "conv2d_memory_format", "pad_conv2d", "conv1d", "conv_transpose1d",
           "conv_transpose2d", "conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d",
           "adaptive_max_pool3d", "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss",
           "cosine_embedding_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "triplet_margin_loss",
           "triplet_margin_with_distance_loss", "poisson_nll_loss", "gaussian_nll_loss", "pdist", "channel_shuffle",
           "lp_pool1d", "lp_pool2d", "local_response_norm", "gumbel_softmax", "pad",
           "one_hot", "relu", "gelu", "geglu", "silu", "quick_gelu", "tanh", "sigmoid",
           "softmax", "log_softmax", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardtanh", "relu6",
           "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "selu", "celu", "threshold", "hardshrink",
           "softshrink", "softmin", "glu", "prelu",
           "scaled_dot_product_attention", "qkv_attention", "bilinear", "normalize", "cosine_similarity", "dropout",
           "dropout1d", "dropout2d", "dropout3d", "pairwise_distance", "unfold", "fold",
           "affine_grid", "grid_sample",
           "embedding",
           "linear", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "nll_loss", "cross_entropy", "layer_norm", "group_norm",
           "instance_norm", "group_norm_silu", "rms_norm", "add_layer_norm", "add_rms_norm", "joint_rms_norm",
           "batch_norm",
           "pixel_shuffle", "pixel_unshuffle",
           "max_pool2d", "max_unpool2d", "avg_pool2d", "adaptive_avg_pool2d", "interpolate", "max_pool1d", "avg_pool1d",
           "adaptive_avg_pool1d", "adaptive_max_pool1d", "adaptive_max_pool2d",
           "embedding_bag", "ctc_loss", "rrelu", "rrelu_", "alpha_dropout", "feature_alpha_dropout", "relu_", "elu_",
           "celu_", "selu_", "leaky_relu_", "hardtanh_", "threshold_", "max_pool1d_with_indices",
           "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d_with_indices",
           "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices", "max_unpool1d", "max_unpool3d",
           "lp_pool3d", "multilabel_margin_loss"]
