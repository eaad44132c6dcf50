"""FluxParams: the hyper-parameters of a Flux transformer, with the released presets and a tiny test config."""
from dataclasses import dataclass, replace

from ..checkpoint_io import preset


class BlockShape:
    """What the params of every Flux-derived transformer (FluxParams, ChromaParams) share: the head and MLP widths
    derived from hidden_size / num_heads / mlp_ratio, and replace()."""

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self):
        return int(self.hidden_size * self.mlp_ratio)

    def replace(self, **changes):
        return replace(self, **changes)


def check_shape(p):
    """ValueError unless `p` (a frozen BlockShape dataclass) splits into whole heads whose RoPE axes (even dims) sum
    to the head dim; its axes_dim becomes a tuple (a JSON list when read from a file's metadata)."""
    if p.hidden_size % p.num_heads:
        raise ValueError(f"hidden_size {p.hidden_size} is not divisible by num_heads {p.num_heads}")
    if sum(p.axes_dim) != p.head_dim:
        raise ValueError(f"axes_dim {tuple(p.axes_dim)} sums to {sum(p.axes_dim)}, but the head dim is "
                         f"{p.head_dim} (hidden_size {p.hidden_size} / num_heads {p.num_heads})")
    if any(d % 2 for d in p.axes_dim):
        raise ValueError(f"every RoPE axis dim must be even, got axes_dim {tuple(p.axes_dim)}")
    object.__setattr__(p, "axes_dim", tuple(p.axes_dim))


@dataclass(frozen=True)
class FluxParams(BlockShape):
    in_channels: int = 64               # packed latent channels (16 VAE channels x 2 x 2)
    out_channels: int = 64
    vec_in_dim: int = 768               # CLIP-L pooled embedding
    context_in_dim: int = 4096          # T5-XXL hidden size
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19                     # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple = (16, 56, 56)      # RoPE dims per position axis; sums to the head dim
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True         # flux-dev embeds the guidance value; schnell does not

    def __post_init__(self):
        check_shape(self)


configs = {
    "flux-dev": FluxParams(),
    "flux-schnell": FluxParams(guidance_embed=False),
    # every path of the real model at toy size: guidance embedding, 3 RoPE axes, double and single blocks
    "flux-tiny": FluxParams(in_channels=64, out_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64,
                            mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=(8, 12, 12)),
}


def flux_params(name_or_params):
    """A preset by name ('flux-dev', 'flux-schnell', 'flux-tiny'), or FluxParams passed through."""
    return preset(name_or_params, FluxParams, configs, what="Flux")
