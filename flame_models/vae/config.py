"""VAEConfig: the hyper-parameters of an LDM AutoencoderKL (SDXL, SD3, Flux), from presets, from a diffusers
config.json, or inferred from a checkpoint's weights (see loading.infer_config)."""
from dataclasses import asdict, dataclass, replace

from ..checkpoint_io import preset


class VAEConfigError(ValueError):
    """A VAE config that is inconsistent or that this architecture cannot express."""


@dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    ch: int = 128                        # channels of the full-resolution level
    ch_mult: tuple = (1, 2, 4, 4)        # channels per level = ch * mult; one 2x down/upsample between levels
    num_res_blocks: int = 2              # ResnetBlocks per encoder level; the decoder has one more per level
    z_channels: int = 16                 # latent channels (the encoder outputs 2x: mean and logvar)
    use_quant_conv: bool = False         # 1x1 conv on (mean, logvar) after the encoder (SD/SDXL VAEs)
    use_post_quant_conv: bool = False    # 1x1 conv on z before the decoder
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    mid_attention: bool = True           # diffusers' mid_block_add_attention
    sample_size: int = 1024              # default tile size (pixels) of tiled encode/decode, as diffusers

    def __post_init__(self):
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        if not self.ch_mult or any(m < 1 for m in self.ch_mult):
            raise VAEConfigError(f"VAEConfig: ch_mult must be a non-empty tuple of positive ints, got {self.ch_mult}")
        for name in ("in_channels", "out_channels", "ch", "num_res_blocks", "z_channels", "norm_num_groups",
                     "sample_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise VAEConfigError(f"VAEConfig: {name} must be a positive int, got {v!r}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise VAEConfigError(f"VAEConfig: channel counts {self.block_out_channels} must be divisible by "
                                 f"norm_num_groups={self.norm_num_groups} ({bad} are not)")

    # ------------------------------------------------------------------ derived sizes
    @property
    def latent_channels(self):
        """diffusers' name for z_channels."""
        return self.z_channels

    @property
    def block_out_channels(self):
        return tuple(self.ch * m for m in self.ch_mult)

    @property
    def layers_per_block(self):
        """diffusers' name for num_res_blocks."""
        return self.num_res_blocks

    @property
    def downsample_factor(self):
        """Image pixels per latent pixel along each side (8 for the released VAEs)."""
        return 2 ** (len(self.ch_mult) - 1)

    def replace(self, **changes):
        return replace(self, **changes)

    # ------------------------------------------------------------------ diffusers config.json
    @classmethod
    def from_diffusers_config(cls, cfg, source="config.json"):
        """A VAEConfig from diffusers' AutoencoderKL config dict; `source` names the file in errors."""
        name = cfg.get("_class_name", "AutoencoderKL")
        if name != "AutoencoderKL":
            raise VAEConfigError(f"{source}: _class_name is {name!r}, not an AutoencoderKL")
        act = cfg.get("act_fn", "silu")
        if act != "silu":
            raise VAEConfigError(f"{source}: act_fn {act!r} is not supported (the LDM VAE uses 'silu')")
        boc = tuple(int(c) for c in cfg.get("block_out_channels", (64,)))
        for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            kinds = tuple(cfg.get(key, (want,)))
            if len(kinds) != len(boc) or any(k != want for k in kinds):
                raise VAEConfigError(f"{source}: {key} {list(kinds)} must be {len(boc)} x {want!r}")
        ch = boc[0]
        if any(c % ch for c in boc):
            raise VAEConfigError(f"{source}: block_out_channels {list(boc)} are not multiples of the first")
        sample = cfg.get("sample_size", 1024)
        sample = sample[0] if isinstance(sample, (list, tuple)) else sample
        return cls(in_channels=int(cfg.get("in_channels", 3)), out_channels=int(cfg.get("out_channels", 3)), ch=ch,
                   ch_mult=tuple(c // ch for c in boc), num_res_blocks=int(cfg.get("layers_per_block", 1)),
                   z_channels=int(cfg.get("latent_channels", 4)),
                   use_quant_conv=bool(cfg.get("use_quant_conv", True)),
                   use_post_quant_conv=bool(cfg.get("use_post_quant_conv", True)),
                   norm_num_groups=int(cfg.get("norm_num_groups", 32)),
                   mid_attention=bool(cfg.get("mid_block_add_attention", True)), sample_size=int(sample))

    def to_diffusers_config(self):
        """diffusers' AutoencoderKL config dict (architecture fields only; the latent scale lives in LatentFormat)."""
        n = len(self.ch_mult)
        return {"_class_name": "AutoencoderKL", "in_channels": self.in_channels, "out_channels": self.out_channels,
                "down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n,
                "block_out_channels": list(self.block_out_channels), "layers_per_block": self.num_res_blocks,
                "act_fn": "silu", "latent_channels": self.z_channels, "norm_num_groups": self.norm_num_groups,
                "sample_size": self.sample_size, "use_quant_conv": self.use_quant_conv,
                "use_post_quant_conv": self.use_post_quant_conv, "mid_block_add_attention": self.mid_attention}

    def to_dict(self):
        d = asdict(self)
        d["ch_mult"] = list(d["ch_mult"])
        return d


AutoencoderKLConfig = VAEConfig

configs = {
    "flux": VAEConfig(),
    "sd3": VAEConfig(),
    "sdxl": VAEConfig(z_channels=4, use_quant_conv=True, use_post_quant_conv=True),
}


def vae_config(name_or_config):
    """A preset by name ('flux', 'sd3', 'sdxl') or a VAEConfig passed through."""
    return preset(name_or_config, VAEConfig, configs, what="VAE", error=VAEConfigError)
