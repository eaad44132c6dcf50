"""SD3Params: the hyper-parameters of an SD3 / SD3.5 MMDiT, with the released presets and a tiny test config."""
from dataclasses import dataclass, replace

from ..checkpoint_io import preset

QK_NORMS = (None, "rms")


@dataclass(frozen=True)
class SD3Params:
    in_channels: int = 16               # VAE latent channels
    out_channels: int = 16
    patch_size: int = 2
    hidden_size: int = 2432             # 64 x depth in every released model (SAI's "magic": head dim 64)
    num_heads: int = 38
    depth: int = 38                     # joint blocks; the last one's context block is pre-only
    context_in_dim: int = 4096          # CLIP-L | CLIP-G | zero pad, then T5-XXL tokens
    pooled_in_dim: int = 2048           # CLIP-L pooled | CLIP-G projected pooled
    pos_embed_max_size: int = 192       # side of the stored square position table, cropped to the latent grid
    dual_attention_layers: tuple = ()   # MMDiT-X: joint blocks whose x stream also self-attends (x_block.attn2)
    qk_norm: str = "rms"                # RMSNorm on q and k per head (ln_q / ln_k), or None (SD3.0)
    sample_size: int = 128              # only for a freshly built model's position table (diffusers' base size)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.depth < 1:
            raise ValueError(f"depth must be at least 1, got {self.depth}")
        dual = tuple(sorted({int(i) for i in self.dual_attention_layers}))
        if any(i < 0 or i >= self.depth - 1 for i in dual):
            raise ValueError(f"dual_attention_layers {dual} must lie in [0, depth - 1) = [0, {self.depth - 1}) "
                             f"(the last block's context stream is pre-only)")
        if self.hidden_size % 2 or (self.hidden_size // 2) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of 4 (2-D sin-cos position table)")
        object.__setattr__(self, "dual_attention_layers", dual)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self):
        return 4 * self.hidden_size

    def replace(self, **changes):
        return replace(self, **changes)


_MEDIUM_DUAL = tuple(range(13))

configs = {
    "sd3.5-large": SD3Params(),
    "sd3.5-large-turbo": SD3Params(),   # the same network, distilled for 4 steps without CFG
    "sd3.5-medium": SD3Params(hidden_size=1536, num_heads=24, depth=24, pos_embed_max_size=384,
                              dual_attention_layers=_MEDIUM_DUAL),
    # every path at toy size: a dual-attention block, a plain joint block, the pre-only last block, QK-norm
    "sd3.5-tiny": SD3Params(hidden_size=64, num_heads=2, depth=3, context_in_dim=32, pooled_in_dim=16,
                            pos_embed_max_size=16, dual_attention_layers=(0,), sample_size=16),
}


def sd3_params(name_or_params):
    """A preset by name ('sd3.5-large', 'sd3.5-large-turbo', 'sd3.5-medium', 'sd3.5-tiny'), or SD3Params passed
    through."""
    return preset(name_or_params, SD3Params, configs, what="SD3")
