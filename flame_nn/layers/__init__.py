"""Layers with PyTorch's names, arguments and parameter names (so state_dicts and checkpoints line up)."""
from .activation import (
                         CELU,
                         ELU,
                         GELU,
                         GLU,
                         SELU,
                         Hardshrink,
                         Hardsigmoid,
                         Hardswish,
                         Hardtanh,
                         LeakyReLU,
                         LogSigmoid,
                         Mish,
                         PReLU,
                         ReLU,
                         ReLU6,
                         Sigmoid,
                         SiLU,
                         Softmax,
                         Softmin,
                         Softplus,
                         Softshrink,
                         Softsign,
                         Tanh,
                         Tanhshrink,
                         Threshold,
)
from .attention import MultiheadAttention
from .batchnorm import BatchNorm1d, BatchNorm2d
from .conv import Conv1d, Conv2d
from .conv_transpose import ConvTranspose2d
from .dropout import Dropout
from .embedding import Embedding
from .linear import Bilinear, Flatten, Identity, Linear, Unflatten
from .loss import (
                   BCELoss,
                   BCEWithLogitsLoss,
                   CrossEntropyLoss,
                   HuberLoss,
                   KLDivLoss,
                   L1Loss,
                   MSELoss,
                   NLLLoss,
                   SmoothL1Loss,
)
from .norm import GroupNorm, LayerNorm, RMSNorm
from .pixel_shuffle import PixelShuffle, PixelUnshuffle
from .pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d, MaxUnpool2d, Upsample
from .rnn import GRU, LSTM
from .transformer import TransformerEncoder, TransformerEncoderLayer
