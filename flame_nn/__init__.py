"""flame_nn: modules, layers, functional ops, initialisation, optimizers (`import flame_nn as nn`)."""
from . import functional, init, optim, utils
from .containers import Sequential, ModuleList, ModuleDict
from .empty_init import empty_init, init_empty_weights, is_empty_init, load_weights_
from .layers import (ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, MultiheadAttention, Conv2d, Dropout, Embedding,
                     Identity, Linear, Flatten, Unflatten, LayerNorm, GroupNorm, RMSNorm, MaxPool2d, AvgPool2d,
                     AdaptiveAvgPool2d, Upsample)
from .module import Module, StateDictError, IncompatibleKeys, RemovableHandle
from .parameter import Parameter, MetaTensorError
from . import offload, parallel

__all__ = ["functional", "init", "optim", "utils", "offload", "Module", "Parameter", "Sequential", "ModuleList",
           "ModuleDict", "empty_init", "init_empty_weights", "is_empty_init", "load_weights_", "StateDictError",
           "MetaTensorError", "IncompatibleKeys", "RemovableHandle", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid",
           "Softmax", "MultiheadAttention", "Conv2d", "Dropout", "Embedding", "Identity", "Linear", "Flatten",
           "Unflatten", "LayerNorm", "GroupNorm", "RMSNorm", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
           "Upsample", "parallel"]
