"""UNetConfig: the hyper-parameters of an SDXL-family UNet (SAI's `UNetModel` with text_time conditioning), its
presets, and the translation to and from diffusers' `UNet2DConditionModel` config.json."""
from dataclasses import asdict, dataclass, replace

from ..checkpoint_io import preset


class UNetConfigError(ValueError):
    """A UNet config that is inconsistent, or that this architecture cannot express."""


# diffusers UNet2DConditionModel options SDXL leaves at these values
_DIFFUSERS_DEFAULTS = {"conv_in_kernel": 3, "conv_out_kernel": 3, "downsample_padding": 1, "dropout": 0.0,
                       "center_input_sample": False, "only_cross_attention": False, "dual_cross_attention": False,
                       "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1.0,
                       "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False, "time_cond_proj_dim": None,
                       "time_embedding_dim": None, "time_embedding_act_fn": None, "timestep_post_act": None,
                       "class_embeddings_concat": False, "cross_attention_norm": None, "attention_type": "default",
                       "encoder_hid_dim_type": None, "num_class_embeds": None}


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 4
    out_channels: int = 4
    model_channels: int = 320            # channels of the full-resolution level
    channel_mult: tuple = (1, 2, 4)       # channels per level = model_channels * mult; 2x down/upsampling between
    num_res_blocks: int = 2               # ResBlocks per encoder level (the decoder has one more per level)
    transformer_depth: tuple = (0, 2, 10)  # SpatialTransformer blocks per level; 0 = no attention at that level
    transformer_depth_middle: int = None  # the middle block's; None = the last level's
    num_head_channels: int = 64           # attention head dim (heads = channels / 64); not in the weights
    context_dim: int = 2048               # cross-attention context: CLIP-L (768) | CLIP-G (1280) penultimate states
    adm_in_channels: int = 2816           # y: CLIP-G pooled (1280) + 6 size/crop embeddings of size_embed_dim
    size_embed_dim: int = 256             # sinusoidal embedding of each size / crop number inside y
    norm_num_groups: int = 32             # GroupNorm groups everywhere (SAI: 32); not in the weights

    def __post_init__(self):
        object.__setattr__(self, "channel_mult", tuple(int(m) for m in self.channel_mult))
        object.__setattr__(self, "transformer_depth", tuple(int(d) for d in self.transformer_depth))
        if self.transformer_depth_middle is None:
            object.__setattr__(self, "transformer_depth_middle", self.transformer_depth[-1] if self.transformer_depth
                               else 0)
        for name in ("in_channels", "out_channels", "model_channels", "num_res_blocks", "num_head_channels",
                     "context_dim", "adm_in_channels", "size_embed_dim", "norm_num_groups",
                     "transformer_depth_middle"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UNetConfigError(f"UNetConfig: {name} must be a positive int, got {v!r}")
        if not self.channel_mult or any(m < 1 for m in self.channel_mult):
            raise UNetConfigError(f"UNetConfig: channel_mult must be positive ints, got {self.channel_mult}")
        if len(self.transformer_depth) != len(self.channel_mult) or any(d < 0 for d in self.transformer_depth):
            raise UNetConfigError(f"UNetConfig: transformer_depth {self.transformer_depth} needs one depth >= 0 per "
                                  f"level of channel_mult {self.channel_mult}")
        bad = [c for c in self.level_channels if c % self.norm_num_groups]
        if bad:
            raise UNetConfigError(f"UNetConfig: channels {self.level_channels} must be divisible by norm_num_groups="
                                  f"{self.norm_num_groups} ({bad} are not)")
        attn = [c for c, d in zip(self.level_channels, self.transformer_depth) if d] + [self.level_channels[-1]]
        bad = [c for c in attn if c % self.num_head_channels]
        if bad:
            raise UNetConfigError(f"UNetConfig: attention channels {attn} must be multiples of num_head_channels="
                                  f"{self.num_head_channels} ({bad} are not)")
        if self.adm_in_channels <= 6 * self.size_embed_dim:
            raise UNetConfigError(f"UNetConfig: adm_in_channels={self.adm_in_channels} leaves no room for a pooled "
                                  f"embedding next to 6 size embeddings of size_embed_dim={self.size_embed_dim}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def level_channels(self):
        return tuple(self.model_channels * m for m in self.channel_mult)

    @property
    def num_levels(self):
        return len(self.channel_mult)

    @property
    def time_embed_dim(self):
        return 4 * self.model_channels

    @property
    def pooled_dim(self):
        """Width of the pooled text embedding at the front of y (1280 for SDXL: CLIP-G's projected EOS state)."""
        return self.adm_in_channels - 6 * self.size_embed_dim

    @property
    def downsample_factor(self):
        """Latent pixels per lowest-resolution pixel along each side: latent sizes must be multiples of it."""
        return 2 ** (self.num_levels - 1)

    def heads(self, channels):
        return channels // self.num_head_channels

    def replace(self, **changes):
        return replace(self, **changes)

    def to_dict(self):
        d = asdict(self)
        d["channel_mult"] = list(d["channel_mult"])
        d["transformer_depth"] = list(d["transformer_depth"])
        return d

    # ------------------------------------------------------------------ diffusers config.json
    @classmethod
    def from_diffusers_config(cls, cfg, source="config.json"):
        """A UNetConfig from diffusers' UNet2DConditionModel config dict (text_time conditioning, linear
        projections); `source` names the file in errors."""
        def need(key, want, default=None):
            got = cfg.get(key, default)
            if got != want:
                raise UNetConfigError(f"{source}: {key} is {got!r}; only {want!r} is supported (SDXL's UNet)")

        name = cfg.get("_class_name", "UNet2DConditionModel")
        if name != "UNet2DConditionModel":
            raise UNetConfigError(f"{source}: _class_name is {name!r}, not a UNet2DConditionModel")
        need("addition_embed_type", "text_time")
        need("use_linear_projection", True, False)
        need("mid_block_type", "UNetMidBlock2DCrossAttn", "UNetMidBlock2DCrossAttn")
        need("act_fn", "silu", "silu")
        need("resnet_time_scale_shift", "default", "default")
        need("class_embed_type", None)
        need("encoder_hid_dim", None)
        need("flip_sin_to_cos", True, True)
        need("freq_shift", 0, 0)
        need("time_embedding_type", "positional", "positional")
        for key, default in _DIFFUSERS_DEFAULTS.items():  # options that change the computation: only the defaults
            got = cfg.get(key, default)
            if got != default and not (isinstance(default, float) and got == default):
                raise UNetConfigError(f"{source}: {key}={got!r} is not supported (SDXL's UNet has {default!r})")
        if cfg.get("num_attention_heads") is not None:
            raise UNetConfigError(f"{source}: num_attention_heads is set; diffusers' UNet2DConditionModel keeps the "
                                  f"head count in attention_head_dim")
        if float(cfg.get("norm_eps", 1e-5)) != 1e-5:
            raise UNetConfigError(f"{source}: norm_eps {cfg.get('norm_eps')} (SDXL's ResBlocks use 1e-5)")
        boc = tuple(int(c) for c in cfg["block_out_channels"])
        down = tuple(cfg["down_block_types"])
        up = tuple(cfg.get("up_block_types", ()))
        kinds = {"CrossAttnDownBlock2D": True, "DownBlock2D": False}
        if len(down) != len(boc) or any(k not in kinds for k in down):
            raise UNetConfigError(f"{source}: down_block_types {list(down)} must be {len(boc)} of "
                                  f"CrossAttnDownBlock2D / DownBlock2D")
        want_up = tuple(k.replace("Down", "Up") for k in reversed(down))
        if up != want_up:
            raise UNetConfigError(f"{source}: up_block_types {list(up)} must mirror the down blocks: {list(want_up)}")
        mc = boc[0]
        if any(c % mc for c in boc):
            raise UNetConfigError(f"{source}: block_out_channels {list(boc)} are not multiples of the first")
        if cfg.get("reverse_transformer_layers_per_block") is not None:
            raise UNetConfigError(f"{source}: reverse_transformer_layers_per_block is not supported")
        lpb = cfg.get("layers_per_block", 2)
        if not isinstance(lpb, int):
            raise UNetConfigError(f"{source}: layers_per_block {lpb!r} must be one int")
        tlpb = cfg.get("transformer_layers_per_block", 1)
        tlpb = [int(tlpb)] * len(boc) if isinstance(tlpb, int) else [int(d) for d in tlpb]
        heads = cfg.get("attention_head_dim", 8)
        heads = [int(heads)] * len(boc) if isinstance(heads, int) else [int(h) for h in heads]
        if len(tlpb) != len(boc) or len(heads) != len(boc):
            raise UNetConfigError(f"{source}: transformer_layers_per_block / attention_head_dim need one entry per "
                                  f"level ({len(boc)})")
        attn_levels = [i for i, k in enumerate(down) if kinds[k]] + [len(boc) - 1]  # the middle block has attention
        head_channels = {boc[i] // heads[i] for i in attn_levels}
        if len(head_channels) != 1 or any(boc[i] % heads[i] for i in attn_levels):
            raise UNetConfigError(f"{source}: attention_head_dim {heads} (heads per level) gives head sizes "
                                  f"{sorted(head_channels)} for channels {list(boc)}; SDXL's UNet has one head size")
        adm = cfg.get("projection_class_embeddings_input_dim")
        if adm is None:
            raise UNetConfigError(f"{source}: projection_class_embeddings_input_dim (y's width) is missing")
        ctx = cfg.get("cross_attention_dim", 1280)
        if not isinstance(ctx, int):
            raise UNetConfigError(f"{source}: cross_attention_dim {ctx!r} must be one int")
        try:
            return cls(in_channels=int(cfg.get("in_channels", 4)), out_channels=int(cfg.get("out_channels", 4)),
                       model_channels=mc, channel_mult=tuple(c // mc for c in boc), num_res_blocks=lpb,
                       transformer_depth=tuple(d if kinds[k] else 0 for d, k in zip(tlpb, down)),
                       transformer_depth_middle=tlpb[-1], num_head_channels=head_channels.pop(), context_dim=ctx,
                       adm_in_channels=int(adm), size_embed_dim=int(cfg.get("addition_time_embed_dim", 256)),
                       norm_num_groups=int(cfg.get("norm_num_groups", 32)))
        except UNetConfigError as e:
            raise UNetConfigError(f"{source}: {e}") from None

    def to_diffusers_config(self):
        """diffusers' UNet2DConditionModel config dict. diffusers gives the middle block the last level's
        transformer depth: a config whose middle depth differs from an attention last level cannot be written."""
        depth = list(self.transformer_depth)
        if depth[-1] and depth[-1] != self.transformer_depth_middle:
            raise UNetConfigError(f"diffusers cannot express transformer_depth_middle={self.transformer_depth_middle}"
                                  f" next to a last level of depth {depth[-1]}")
        tlpb = [d if d else 1 for d in depth]
        tlpb[-1] = self.transformer_depth_middle
        down = ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depth]
        return {"_class_name": "UNet2DConditionModel", "sample_size": 128, "in_channels": self.in_channels,
                "out_channels": self.out_channels, "down_block_types": down,
                "up_block_types": [k.replace("Down", "Up") for k in reversed(down)],
                "mid_block_type": "UNetMidBlock2DCrossAttn", "block_out_channels": list(self.level_channels),
                "layers_per_block": self.num_res_blocks, "transformer_layers_per_block": tlpb,
                "attention_head_dim": [self.heads(c) for c in self.level_channels],
                "cross_attention_dim": self.context_dim, "use_linear_projection": True,
                "addition_embed_type": "text_time", "addition_time_embed_dim": self.size_embed_dim,
                "projection_class_embeddings_input_dim": self.adm_in_channels, "norm_num_groups": self.norm_num_groups,
                "norm_eps": 1e-5, "act_fn": "silu", "flip_sin_to_cos": True, "freq_shift": 0,
                "center_input_sample": False, "upcast_attention": False}


configs = {
    # Stability AI's sd_xl_base.yaml (attention_resolutions [4, 2] leave level 0 without attention)
    "sdxl-base": UNetConfig(),
    # every path at toy size: a level without attention after one with it (its upsampler is output_blocks.*.1.conv),
    # transformer depth 2 at the last level and in the middle, a channel change with a skip conv in the encoder (and
    # every decoder ResBlock), one head at level 0 and two above, 4 GroupNorm groups, 8-wide size embeddings
    "sdxl-tiny": UNetConfig(model_channels=8, channel_mult=(1, 2, 2), num_res_blocks=2, transformer_depth=(1, 0, 2),
                            num_head_channels=8, context_dim=16, adm_in_channels=64, size_embed_dim=8,
                            norm_num_groups=4),
}


def unet_config(name_or_config):
    """A preset by name ('sdxl-base', 'sdxl-tiny') or a UNetConfig passed through."""
    return preset(name_or_config, UNetConfig, configs, what="UNet", error=UNetConfigError)
