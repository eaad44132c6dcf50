"""Layers with PyTorch's names, arguments and parameter names (so state_dicts and checkpoints line up)."""
from .activation import ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax
from .attention import MultiheadAttention
from .conv import Conv2d
from .dropout import Dropout
from .embedding import Embedding
from .linear import Identity, Linear, Flatten, Unflatten
from .norm import LayerNorm, GroupNorm, RMSNorm
from .pooling import MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Upsample
