"""QwenImageParams: the hyper-parameters of a Qwen-Image transformer (diffusers' QwenImageTransformer2DModel config),
with the released preset and a tiny test config."""
from dataclasses import dataclass, replace

from ..checkpoint_io import preset


@dataclass(frozen=True)
class QwenImageParams:
    patch_size: int = 2                 # latent 2x2 patches (the pipeline packs them; the model sees tokens)
    in_channels: int = 64               # packed latent channels (16 VAE channels x 2 x 2)
    out_channels: int = 16              # VAE channels; proj_out writes patch_size^2 * out_channels
    num_layers: int = 60                # dual-stream blocks (there are no single-stream blocks)
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    joint_attention_dim: int = 3584     # Qwen2.5-VL-7B hidden size
    mlp_ratio: float = 4.0              # diffusers FeedForward's default mult
    axes_dims_rope: tuple = (16, 56, 56)  # RoPE dims of the frame / height / width axes; sums to the head dim
    theta: int = 10_000

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if len(self.axes_dims_rope) != 3:
            raise ValueError(f"axes_dims_rope must name 3 axes (frame, height, width), got {self.axes_dims_rope}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} sums to {sum(self.axes_dims_rope)}, but "
                             f"attention_head_dim is {self.attention_head_dim}")
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"every RoPE axis dim must be even, got axes_dims_rope {self.axes_dims_rope}")
        for name in ("patch_size", "in_channels", "out_channels", "num_layers", "num_attention_heads",
                     "attention_head_dim", "joint_attention_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"QwenImageParams.{name} must be a positive int, got {getattr(self, name)!r}")

    @property
    def hidden_size(self):
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self):
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def proj_out_dim(self):
        return self.patch_size * self.patch_size * self.out_channels

    def replace(self, **changes):
        return replace(self, **changes)


configs = {
    "qwen-image": QwenImageParams(),
    # every path of the real model at toy size: 3 RoPE axes, 2 heads, text width differing from the hidden size
    "qwen-image-tiny": QwenImageParams(num_layers=2, num_attention_heads=2, attention_head_dim=32,
                                       joint_attention_dim=48, axes_dims_rope=(8, 12, 12)),
}


def qwen_image_params(name_or_params):
    """A preset by name ('qwen-image', 'qwen-image-tiny'), or QwenImageParams passed through."""
    return preset(name_or_params, QwenImageParams, configs, what="Qwen-Image")
