"""SDXLUNet: SAI's `UNetModel` of SDXL (sgm/modules/diffusionmodules/openaimodel.py) with text_time conditioning.

Parameter names are the SAI checkpoint's keys without `model.diffusion_model.` (input_blocks.4.1.transformer_blocks.0
.attn1.to_q.weight, middle_block.1..., output_blocks.2.2.conv.weight, out.2.weight, label_emb.0.0.weight), so an
SAI / ComfyUI file loads by name; diffusers files are renamed on the way in (keys.py).

The three block stacks -- input_blocks, middle_block, output_blocks -- are ModuleLists run through
`flame_nn.offload.run_block`, so `BlockStreamer.for_model(unet)` streams them; the encoder's skip tensors are plain
activations handed to the output blocks, whatever is streamed.
"""
import flame_core as flame
import flame_nn
from flame_nn.offload import run_block

from ..vae.layers import norm_silu
from .attention import BasicTransformerBlock, SpatialTransformer
from .config import unet_config
from .embeddings import timestep_embedding
from .freeu import apply_freeu, check_freeu
from .resblocks import Downsample, ResBlock, TimestepEmbedSequential, Upsample


class SDXLUNet(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """SDXLUNet(config) with config a UNetConfig or a preset name ('sdxl-base', 'sdxl-tiny').

    `unet(x, timesteps, context, y)`: latents (B, in_channels, H, W), timesteps (B,) integer or float in [0, 1000)
    (one value broadcasts), context (B, L, context_dim), y (B, adm_in_channels) -> (B, out_channels, H, W) in the
    weights' dtype. H and W must be multiples of config.downsample_factor. Build without allocating weights under
    `flame_nn.empty_init`; load with `load_unet(path, dtype=..., device=...)`."""

    def __init__(self, config="sdxl-base", *, dtype=None, device=None):
        super().__init__()
        c = unet_config(config)
        self.config = c
        kw = dict(dtype=dtype, device=device)
        mc, ted, groups = c.model_channels, c.time_embed_dim, c.norm_num_groups

        # embeddings: timestep and the y vector (pooled text + sizes), both to time_embed_dim
        self.time_embed = flame_nn.Sequential(flame_nn.Linear(mc, ted, **kw), flame_nn.SiLU(),
                                              flame_nn.Linear(ted, ted, **kw))
        self.label_emb = flame_nn.Sequential(flame_nn.Sequential(
            flame_nn.Linear(c.adm_in_channels, ted, **kw), flame_nn.SiLU(), flame_nn.Linear(ted, ted, **kw)))

        def res(cin, cout):
            return ResBlock(cin, ted, cout, groups, **kw)

        def transformer(ch, depth):
            return SpatialTransformer(ch, c.heads(ch), c.num_head_channels, depth, c.context_dim, groups, **kw)

        # encoder: conv_in, then per level num_res_blocks x (ResBlock [+ SpatialTransformer]), then a downsample
        self.input_blocks = flame_nn.ModuleList(
            [TimestepEmbedSequential(flame_nn.Conv2d(c.in_channels, mc, 3, padding=1, **kw))])
        skip_channels = [mc]
        ch = mc
        for level, (out_ch, depth) in enumerate(zip(c.level_channels, c.transformer_depth)):
            for _ in range(c.num_res_blocks):
                layers = [res(ch, out_ch)] + ([transformer(out_ch, depth)] if depth else [])
                ch = out_ch
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                skip_channels.append(ch)
            if level != c.num_levels - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch, **kw)))
                skip_channels.append(ch)

        # middle: ResBlock, SpatialTransformer, ResBlock (keys middle_block.0 / .1 / .2)
        self.middle_block = flame_nn.ModuleList(
            [res(ch, ch), transformer(ch, c.transformer_depth_middle), res(ch, ch)])

        # decoder: per level (deepest first) num_res_blocks + 1 x (ResBlock on [h | skip] [+ SpatialTransformer]),
        # the level's last block ending in an upsample
        self.output_blocks = flame_nn.ModuleList()
        for level in reversed(range(c.num_levels)):
            out_ch, depth = c.level_channels[level], c.transformer_depth[level]
            for i in range(c.num_res_blocks + 1):
                layers = [res(ch + skip_channels.pop(), out_ch)] + ([transformer(out_ch, depth)] if depth else [])
                ch = out_ch
                if level and i == c.num_res_blocks:
                    layers.append(Upsample(ch, **kw))
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = flame_nn.Sequential(flame_nn.GroupNorm(groups, ch, eps=1e-5, **kw), flame_nn.SiLU(),
                                       flame_nn.Conv2d(ch, c.out_channels, 3, padding=1, **kw))

    # ------------------------------------------------------------------ FreeU
    freeu = None   # {s1, s2, b1, b2} while FreeU is on (enable_freeu)

    def enable_freeu(self, s1, s2, b1, b2):
        """FreeU on the decoder's two deepest levels, as diffusers' UNet2DConditionModel.enable_freeu (freeu.py
        says what the factors do; SDXL's published values: s1=0.9, s2=0.2, b1=1.3, b2=1.4)."""
        self.freeu = check_freeu(s1, s2, b1, b2)
        return self

    def disable_freeu(self):
        self.freeu = None
        return self

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """An SDXL UNet from an SAI / ComfyUI single file or a diffusers folder / file; see load_unet."""
        from .loading import load_unet
        return load_unet(path, dtype=dtype, device=device, **kwargs)

    # the compute dtype and device are read from the output conv: outside the streamed stacks, and no Linear that
    # fp8 storage would turn into float8 values
    @property
    def dtype(self):
        return self.out[2].weight.dtype

    @property
    def device(self):
        return self.out[2].weight.device

    # ------------------------------------------------------------------ gradient checkpointing
    def checkpointed_blocks(self):
        """The units gradient checkpointing recomputes (flame_nn.GradientCheckpointingMixin): every ResBlock and
        every transformer block. A block a BlockStreamer streams is checkpointed whole by the streamer; these flags
        then nest inside it (a lower peak for one more forward of those parts)."""
        return [m for m in self.modules() if isinstance(m, (ResBlock, BasicTransformerBlock))]

    # ------------------------------------------------------------------ adapters
    def adapter_name_map(self):
        """NameMap from this model's (SAI) Linear names to diffusers' (PEFT files); see lora_keys.py."""
        from .lora_keys import unet_name_map
        return unet_name_map(self)

    # ------------------------------------------------------------------ forward
    def _check(self, x, timesteps, context, y):
        c = self.config
        if not all(isinstance(t, flame.Tensor) for t in (x, timesteps, context, y)):
            raise TypeError("SDXLUNet: x, timesteps, context and y must be Tensors")
        B = x.shape[0]
        f = c.downsample_factor
        if x.ndim != 4 or x.shape[1] != c.in_channels or x.shape[2] % f or x.shape[3] % f:
            raise ValueError(f"SDXLUNet: x must be (B, {c.in_channels}, H, W) with H and W multiples of {f}, got "
                             f"{tuple(x.shape)}")
        if timesteps.ndim > 1 or (timesteps.ndim == 1 and timesteps.shape[0] not in (1, B)):
            raise ValueError(f"SDXLUNet: timesteps must be ({B},) (or one for the batch), got "
                             f"{tuple(timesteps.shape)}")
        if context.ndim != 3 or context.shape[0] != B or context.shape[2] != c.context_dim:
            raise ValueError(f"SDXLUNet: context must be ({B}, L, {c.context_dim}), got {tuple(context.shape)}")
        if y.ndim != 2 or tuple(y.shape) != (B, c.adm_in_channels):
            raise ValueError(f"SDXLUNet: y must be ({B}, {c.adm_in_channels}), got {tuple(y.shape)}")
        for name, t in (("timesteps", timesteps), ("context", context), ("y", y)):
            if t.device != x.device:
                raise flame.DeviceError(f"SDXLUNet: {name} is on {t.device}, x on {x.device}")

    def forward(self, x, timesteps, context, y):
        """SAI's UNetModel.forward: x (B, C, H, W), timesteps (B,), context (B, L, context_dim), y (B, adm) ->
        (B, out_channels, H, W)."""
        self._check(x, timesteps, context, y)
        if timesteps.ndim == 0 or timesteps.shape[0] != x.shape[0]:
            timesteps = timesteps.reshape(1).expand(x.shape[0])
        dtype = self.dtype
        x, context, y = x.to(dtype), context.to(dtype), y.to(dtype)

        # one embedding per sample: the timestep's plus the y vector's
        emb = self.time_embed(timestep_embedding(timesteps, self.config.model_channels).to(dtype))
        emb = emb + self.label_emb(y)                                          # (B, time_embed_dim)

        # encoder, keeping every block's output for the decoder's skip connections
        hs = []
        h = x
        for i in range(len(self.input_blocks)):
            h = run_block(self.input_blocks, i, h, emb, context)
            hs.append(h)
        for i in range(len(self.middle_block)):
            h = run_block(self.middle_block, i, h, emb, context)
        per_level = self.config.num_res_blocks + 1
        for i in range(len(self.output_blocks)):
            skip = hs.pop()
            if self.freeu is not None:
                h, skip = apply_freeu(i // per_level, h, skip, self.freeu)
            h = run_block(self.output_blocks, i, h, emb, context, skip)   # [h | skip] inside the block
            del skip
        return self.out[2](norm_silu(self.out[0], h, self.out[2]))            # out.0 GroupNorm, out.1 SiLU
