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
                         LogSoftmax,
                         Mish,
                         PReLU,
                         ReLU,
                         ReLU6,
                         RReLU,
                         Sigmoid,
                         SiLU,
                         Softmax,
                         Softmax2d,
                         Softmin,
                         Softplus,
                         Softshrink,
                         Softsign,
                         Tanh,
                         Tanhshrink,
                         Threshold,
)
from .attention import MultiheadAttention
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .conv import Conv1d, Conv2d, Conv3d
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .distance import CosineSimilarity, PairwiseDistance
from .dropout import AlphaDropout, Dropout, Dropout1d, Dropout2d, Dropout3d, FeatureAlphaDropout
from .embedding import Embedding, EmbeddingBag
from .fold import Fold, Unfold
from .instancenorm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .lazy import LazyBatchNorm1d, LazyBatchNorm2d, LazyBatchNorm3d, LazyLinear
from .linear import Bilinear, Flatten, Identity, Linear, Unflatten
from .loss import (
                         BCELoss,
                         BCEWithLogitsLoss,
                         CosineEmbeddingLoss,
                         CrossEntropyLoss,
                         CTCLoss,
                         GaussianNLLLoss,
                         HingeEmbeddingLoss,
                         HuberLoss,
                         KLDivLoss,
                         L1Loss,
                         MarginRankingLoss,
                         MSELoss,
                         MultiLabelMarginLoss,
                         MultiLabelSoftMarginLoss,
                         MultiMarginLoss,
                         NLLLoss,
                         PoissonNLLLoss,
                         SmoothL1Loss,
                         SoftMarginLoss,
                         TripletMarginLoss,
                         TripletMarginWithDistanceLoss,
)
from .misc import ChannelShuffle, LocalResponseNorm, LPPool1d, LPPool2d, LPPool3d
from .norm import GroupNorm, LayerNorm, RMSNorm
from .padding import (
                         CircularPad1d,
                         CircularPad2d,
                         CircularPad3d,
                         ConstantPad1d,
                         ConstantPad2d,
                         ConstantPad3d,
                         ReflectionPad1d,
                         ReflectionPad2d,
                         ReflectionPad3d,
                         ReplicationPad1d,
                         ReplicationPad2d,
                         ReplicationPad3d,
                         ZeroPad1d,
                         ZeroPad2d,
                         ZeroPad3d,
)
from .pixel_shuffle import PixelShuffle, PixelUnshuffle
from .pooling import (
                         AdaptiveAvgPool1d,
                         AdaptiveAvgPool2d,
                         AdaptiveAvgPool3d,
                         AdaptiveMaxPool1d,
                         AdaptiveMaxPool2d,
                         AdaptiveMaxPool3d,
                         AvgPool1d,
                         AvgPool2d,
                         AvgPool3d,
                         MaxPool1d,
                         MaxPool2d,
                         MaxPool3d,
                         MaxUnpool1d,
                         MaxUnpool2d,
                         MaxUnpool3d,
                         Upsample,
                         UpsamplingBilinear2d,
                         UpsamplingNearest2d,
)
from .rnn import GRU, LSTM, RNN
from .rnn_cell import GRUCell, LSTMCell, RNNCell, RNNCellBase
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .transformer_decoder import Transformer, TransformerDecoder, TransformerDecoderLayer
