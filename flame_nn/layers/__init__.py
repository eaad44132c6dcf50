"""Layers with PyTorch's names, arguments and parameter names (so state_dicts and checkpoints line up)."""
from .activation import ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LeakyReLU, ELU, Softplus, Mish, Hardswish
from .attention import MultiheadAttention
from .batchnorm import BatchNorm1d, BatchNorm2d
from .conv import Conv1d, Conv2d
from .conv_transpose import ConvTranspose2d
from .dropout import Dropout
from .embedding import Embedding
from .linear import Identity, Linear, Bilinear, Flatten, Unflatten
from .loss import (L1Loss, MSELoss, SmoothL1Loss, HuberLoss, NLLLoss, CrossEntropyLoss, BCELoss, BCEWithLogitsLoss,
                   KLDivLoss)
from .norm import LayerNorm, GroupNorm, RMSNorm
from .pixel_shuffle import PixelShuffle, PixelUnshuffle
from .pooling import MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Upsample
from .rnn import LSTM, GRU
from .transformer import TransformerEncoderLayer, TransformerEncoder
