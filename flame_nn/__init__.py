"""flame_nn: modules, layers, functional ops, initialisation, optimizers (`import flame_nn as nn`)."""
from . import functional, init, optim, utils
from .containers import Sequential, ModuleList, ModuleDict, ParameterList, ParameterDict
from .empty_init import empty_init, init_empty_weights, is_empty_init, load_weights_
from .gradient_checkpointing import GradientCheckpointingMixin
from .layers import (ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LeakyReLU, ELU, Softplus, Mish, Hardswish,
                     MultiheadAttention, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, ConvTranspose2d, Dropout,
                     Embedding, Identity, Linear, Bilinear, Flatten, Unflatten, L1Loss, MSELoss, SmoothL1Loss,
                     HuberLoss, NLLLoss, CrossEntropyLoss, BCELoss, BCEWithLogitsLoss, KLDivLoss, LayerNorm,
                     GroupNorm, RMSNorm, PixelShuffle, PixelUnshuffle, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d,
                     Upsample, LSTM, GRU, TransformerEncoderLayer, TransformerEncoder)
from .module import Module, StateDictError, IncompatibleKeys, RemovableHandle
from .parameter import Parameter, MetaTensorError
from . import offload, parallel

__all__ = ["functional", "init", "optim", "utils", "offload", "Module", "Parameter", "Sequential", "ModuleList",
           "ModuleDict", "ParameterList", "ParameterDict", "empty_init", "init_empty_weights", "is_empty_init",
           "load_weights_", "StateDictError", "MetaTensorError", "IncompatibleKeys", "RemovableHandle", "ReLU",
           "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LeakyReLU", "ELU", "Softplus", "Mish", "Hardswish",
           "MultiheadAttention", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d", "ConvTranspose2d", "Dropout",
           "Embedding", "Identity", "Linear", "Bilinear", "Flatten", "Unflatten", "L1Loss", "MSELoss",
           "SmoothL1Loss", "HuberLoss", "NLLLoss", "CrossEntropyLoss", "BCELoss", "BCEWithLogitsLoss", "KLDivLoss",
           "LayerNorm", "GroupNorm", "RMSNorm", "PixelShuffle", "PixelUnshuffle", "MaxPool2d", "AvgPool2d",
           "AdaptiveAvgPool2d", "Upsample", "LSTM", "GRU", "TransformerEncoderLayer", "TransformerEncoder", "GradientCheckpointingMixin",
           "parallel"]
