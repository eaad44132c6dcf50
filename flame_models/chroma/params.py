"""ChromaParams: the hyper-parameters of a Chroma transformer (lodestones' Chroma1, FLUX.1-schnell-derived), with the
released preset and a tiny test config."""
from dataclasses import dataclass

from ..bfl.params import BlockShape, check_shape
from ..checkpoint_io import preset


@dataclass(frozen=True)
class ChromaParams(BlockShape):
    in_channels: int = 64               # packed latent channels (16 VAE channels x 2 x 2)
    out_channels: int = 64
    context_in_dim: int = 4096          # T5-XXL hidden size
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19                     # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple = (16, 56, 56)      # RoPE dims per position axis; sums to the head dim
    theta: int = 10_000
    approximator_in_dim: int = 64       # ts(t, 16) | ts(guidance, 16) | ts(row, 32)
    approximator_hidden_dim: int = 5120
    approximator_layers: int = 5

    def __post_init__(self):
        check_shape(self)
        if self.approximator_in_dim % 4:
            raise ValueError(f"approximator_in_dim {self.approximator_in_dim} must be a multiple of 4")

    @property
    def mod_index_length(self):
        """Modulation vectors the approximator makes: 3 per single block, 6 + 6 per double block, 2 for the end."""
        return 3 * self.depth_single_blocks + 2 * 6 * self.depth + 2


configs = {
    "chroma": ChromaParams(),
    # every path of the real model at toy size: 3 RoPE axes, double and single blocks, a 2-layer approximator
    "chroma-tiny": ChromaParams(context_in_dim=32, hidden_size=64, num_heads=2, depth=2, depth_single_blocks=2,
                                axes_dim=(8, 12, 12), approximator_hidden_dim=32, approximator_layers=2),
}


def chroma_params(name_or_params):
    """A preset by name ('chroma', 'chroma-tiny'), or ChromaParams passed through."""
    return preset(name_or_params, ChromaParams, configs, what="Chroma")
