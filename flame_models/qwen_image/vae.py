"""Qwen-Image's VAE (diffusers' AutoencoderKLQwenImage: Wan-2.1's causal 3-D autoencoder fine-tuned) for single
images, in diffusers' parameter names. On one frame the causal 3-D network is exactly a 2-D one: a causal conv pads
2*p_t zero frames in FRONT, so with no cache only its last temporal tap meets data (a 3x3x3 conv is Conv2d with
weight[:, :, -1], a 1x1x1 conv weight[:, :, 0]), and the temporal up / down convolutions (`time_conv`) are skipped
for the first frame. So this model is 2-D; the `time_conv` tensors of a checkpoint are video-only and not read.

RMS norm: x / max(|x|_2 over channels, 1e-12) * sqrt(C) * gamma (float32 for half inputs). Residual blocks
(norm, SiLU, conv) x 2 plus a 1x1 shortcut when the width changes; single-head attention (q | k | v channel thirds of
a 1x1 conv) in the mid blocks; downsampling by zero padding right / bottom then a stride-2 3x3 conv; upsampling by
nearest x2 then a 3x3 conv halving the channels. encode(images) gives the posterior mean (unscaled; Qwen-Image's
per-channel normalisation is latents.ChannelLatentFormat), decode(z) images clamped to [-1, 1] as diffusers (its
tiled path does not clamp, nor does this one). Tiles: 256 px, stride 192, blended linearly (diffusers')."""
import dataclasses
import json
import os
from dataclasses import dataclass

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_nn.empty_init import new_parameter

from .. import checkpoint_io as CIO
from ..vae import tiling
from ..vae.attention import single_head_attention
from ..vae.distribution import DiagonalGaussianDistribution
from .latents import LATENTS_MEAN, LATENTS_STD

CONFIG_METADATA_KEY = "flame.qwen_image_vae_config"


@dataclass(frozen=True)
class QwenImageVAEConfig:
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple = ()
    temperal_downsample: tuple = (False, True, True)
    input_channels: int = 3
    latents_mean: tuple = LATENTS_MEAN
    latents_std: tuple = LATENTS_STD

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"temperal_downsample {self.temperal_downsample} needs {len(self.dim_mult) - 1} entries "
                             f"(one per downsampling of dim_mult {self.dim_mult})")
        if self.base_dim < 1 or self.z_dim < 1 or self.num_res_blocks < 1:
            raise ValueError(f"base_dim, z_dim and num_res_blocks must be positive: {self}")

    @property
    def downsample_factor(self):
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def from_diffusers(cls, config):
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in fields})


class RMSNorm(flame_nn.Module):
    """x / max(|x| over channels, 1e-12) * sqrt(C) * gamma; gamma (C, 1, 1) (the checkpoint's (C, 1, 1, 1) in 3-D
    uses is reshaped on load)."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = new_parameter((dim, 1, 1), dtype, device)
        flame_nn.init.ones_(self.gamma)

    def forward(self, x):
        xf = x.float() if x.dtype in (flame.float16, flame.bfloat16) else x
        n = (xf * xf).sum(dim=1, keepdim=True).sqrt().clamp(min=1e-12)
        return (xf / n).to(x.dtype) * self.scale * self.gamma


class ResidualBlock(flame_nn.Module):
    def __init__(self, in_dim, out_dim, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.norm1 = RMSNorm(in_dim, **kw)
        self.conv1 = flame_nn.Conv2d(in_dim, out_dim, 3, padding=1, **kw)
        self.norm2 = RMSNorm(out_dim, **kw)
        self.conv2 = flame_nn.Conv2d(out_dim, out_dim, 3, padding=1, **kw)
        self.conv_shortcut = flame_nn.Conv2d(in_dim, out_dim, 1, **kw) if in_dim != out_dim else flame_nn.Identity()

    def forward(self, x):
        h = self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))
        return x + h


class AttentionBlock(flame_nn.Module):
    """One head over the H*W tokens with head dim C; q, k, v are the channel thirds of `to_qkv`."""

    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.norm = RMSNorm(dim, **kw)
        self.to_qkv = flame_nn.Conv2d(dim, 3 * dim, 1, **kw)
        self.proj = flame_nn.Conv2d(dim, dim, 1, **kw)

    def forward(self, x):
        B, C, H, W = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(B, 3 * C, H * W).transpose(1, 2)          # (B, L, 3C)
        q, k, v = qkv.split([C, C, C], dim=-1)
        o = single_head_attention(q.contiguous(), k.contiguous(), v.contiguous())         # (B, L, C)
        return self.proj(o.transpose(1, 2).reshape(B, C, H, W)) + x


class MidBlock(flame_nn.Module):
    def __init__(self, dim, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.resnets = flame_nn.ModuleList([ResidualBlock(dim, dim, **kw), ResidualBlock(dim, dim, **kw)])
        self.attentions = flame_nn.ModuleList([AttentionBlock(dim, **kw)])

    def forward(self, x):
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Resample(flame_nn.Module):
    """`resample.1` is the Conv2d (`resample.0` is diffusers' padding / upsampling, without parameters); the 3-D
    modes' `time_conv` acts across frames only (a single image skips it)."""

    def __init__(self, dim, mode, dtype=None, device=None):
        super().__init__()
        self.mode = mode
        kw = dict(dtype=dtype, device=device)
        if mode.startswith("down"):
            conv = flame_nn.Conv2d(dim, dim, 3, stride=2, **kw)
        else:
            conv = flame_nn.Conv2d(dim, dim // 2, 3, padding=1, **kw)
        self.resample = flame_nn.ModuleList([flame_nn.Identity(), conv])

    def forward(self, x):
        if self.mode.startswith("down"):
            return self.resample[1](F.pad(x, (0, 1, 0, 1)))
        up = F.interpolate(x.float() if x.dtype != flame.float64 else x, scale_factor=2.0, mode="nearest")
        return self.resample[1](up.to(x.dtype))


class UpBlock(flame_nn.Module):
    def __init__(self, in_dim, out_dim, num_res_blocks, upsample_mode, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.resnets = flame_nn.ModuleList(ResidualBlock(in_dim if i == 0 else out_dim, out_dim, **kw)
                                           for i in range(num_res_blocks + 1))
        self.upsamplers = None if upsample_mode is None else flame_nn.ModuleList(
            [Resample(out_dim, upsample_mode, **kw)])

    def forward(self, x):
        for r in self.resnets:
            x = r(x)
        return x if self.upsamplers is None else self.upsamplers[0](x)


class Encoder(flame_nn.Module):
    def __init__(self, c, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        dims = [c.base_dim * u for u in (1,) + c.dim_mult]
        self.conv_in = flame_nn.Conv2d(c.input_channels, dims[0], 3, padding=1, **kw)
        blocks, scale = [], 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(c.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, **kw))
                if scale in c.attn_scales:
                    blocks.append(AttentionBlock(out_dim, **kw))
                in_dim = out_dim
            if i != len(c.dim_mult) - 1:
                blocks.append(Resample(out_dim, "downsample3d" if c.temperal_downsample[i] else "downsample2d",
                                       **kw))
                scale /= 2.0
        self.down_blocks = flame_nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1], **kw)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = flame_nn.Conv2d(dims[-1], 2 * c.z_dim, 3, padding=1, **kw)

    def forward(self, x):
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Decoder(flame_nn.Module):
    def __init__(self, c, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        mult = c.dim_mult
        dims = [c.base_dim * u for u in (mult[-1],) + mult[::-1]]
        upsample = tuple(reversed(c.temperal_downsample))
        self.conv_in = flame_nn.Conv2d(c.z_dim, dims[0], 3, padding=1, **kw)
        self.mid_block = MidBlock(dims[0], **kw)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                in_dim = in_dim // 2
            mode = None if i == len(mult) - 1 else ("upsample3d" if upsample[i] else "upsample2d")
            blocks.append(UpBlock(in_dim, out_dim, c.num_res_blocks, mode, **kw))
        self.up_blocks = flame_nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1], **kw)
        self.conv_out = flame_nn.Conv2d(dims[-1], c.input_channels, 3, padding=1, **kw)

    def forward(self, z):
        x = self.mid_block(self.conv_in(z))
        for b in self.up_blocks:
            x = b(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class AutoencoderKLQwenImage(flame_nn.Module):
    """encode(images (B, 3, H, W) in [-1, 1]) -> unscaled posterior mean (B, 16, H/8, W/8); decode(z) -> images
    clamped to [-1, 1] (untiled; tiled decoding is not clamped, as diffusers). Tiling as flame_models.vae's
    (use_tiling None: automatic above auto_tile_max_pixels; True: every input larger than a tile)."""

    def __init__(self, config=None, *, dtype=None, device=None):
        super().__init__()
        c = config if isinstance(config, QwenImageVAEConfig) else QwenImageVAEConfig(**(config or {}))
        self.config = c
        kw = dict(dtype=dtype, device=device)
        self.encoder = Encoder(c, **kw)
        self.quant_conv = flame_nn.Conv2d(2 * c.z_dim, 2 * c.z_dim, 1, **kw)
        self.post_quant_conv = flame_nn.Conv2d(c.z_dim, c.z_dim, 1, **kw)
        self.decoder = Decoder(c, **kw)
        self.use_tiling = None
        self.tile_sample_min_size = 256
        self.tile_overlap_factor = 0.25            # stride 192 px of 256
        self.auto_tile_max_pixels = 1024 * 1024

    @property
    def dtype(self):
        return self.encoder.conv_in.weight.dtype

    @property
    def device(self):
        return self.encoder.conv_in.weight.device

    @property
    def tile_latent_min_size(self):
        return self.tile_sample_min_size // self.config.downsample_factor

    def enable_tiling(self, tile_sample_min_size=None, tile_sample_stride=None):
        """Tile every input larger than a tile: `tile_sample_min_size` px tiles (default 256) every
        `tile_sample_stride` px (default 192), both multiples of 8."""
        f = self.config.downsample_factor
        size = int(tile_sample_min_size or self.tile_sample_min_size)
        stride = int(tile_sample_stride or size * (1 - self.tile_overlap_factor))
        if size < f or size % f or stride % f or not 0 < stride <= size:
            raise ValueError(f"enable_tiling: tiles of {size} px every {stride} px: both multiples of {f}, "
                             f"0 < stride <= size")
        self.tile_sample_min_size, self.tile_overlap_factor = size, 1.0 - stride / size
        self.use_tiling = True
        return self

    def disable_tiling(self):
        self.use_tiling = False
        return self

    def _tiles(self, h, w, tile, pixels):
        if self.use_tiling is False or not (h > tile or w > tile):
            return False
        return self.use_tiling is True or pixels > self.auto_tile_max_pixels

    def _check(self, x, channels, what):
        if not isinstance(x, flame.Tensor) or x.ndim != 4 or x.shape[1] != channels:
            shape = tuple(x.shape) if isinstance(x, flame.Tensor) else type(x).__name__
            raise ValueError(f"AutoencoderKLQwenImage.{what}: expected a (B, {channels}, H, W) tensor (one frame), "
                             f"got {shape}")
        f = self.config.downsample_factor if what == "encode" else 1
        if x.shape[2] % f or x.shape[3] % f:
            raise ValueError(f"AutoencoderKLQwenImage.{what}: H and W must be multiples of {f}, got "
                             f"{tuple(x.shape[2:])}")
        return x.to(self.device).to(self.dtype)

    def _encode_tile(self, x):
        return self.quant_conv(self.encoder(x))

    def _decode_tile(self, z):
        return self.decoder(self.post_quant_conv(z))

    def encode_moments(self, images):
        x = self._check(images, self.config.input_channels, "encode")
        H, W = x.shape[-2:]
        if self._tiles(H, W, self.tile_sample_min_size, H * W):
            return tiling.tiled_encode(self, x)
        return self._encode_tile(x)

    def encode_dist(self, images):
        return DiagonalGaussianDistribution(self.encode_moments(images))

    def encode(self, images, generator=None):
        dist = self.encode_dist(images)
        return dist.mean if generator is None else dist.sample(generator=generator)

    def decode(self, z):
        z = self._check(z, self.config.z_dim, "decode")
        h, w = z.shape[-2:]
        f = self.config.downsample_factor
        if self._tiles(h, w, self.tile_latent_min_size, h * w * f * f):
            return tiling.tiled_decode(self, z)
        return self._decode_tile(z).clamp(-1.0, 1.0)


# ----------------------------------------------------------------------------- files
class QwenImageVAECheckpointError(CIO.CheckpointError, RuntimeError):
    """A Qwen-Image VAE file with missing, unexpected or misshaped tensors."""


VIDEO_ONLY = ".time_conv."        # temporal convolutions: never reached by one frame


def _file_key_shape(model_shape, file_shape):
    """Whether a file tensor fits a model tensor: the same, a (C, 1, 1, 1) gain for (C, 1, 1), or a 3-D conv kernel
    (O, I, t, kh, kw) for (O, I, kh, kw)."""
    if tuple(file_shape) == tuple(model_shape):
        return True
    if len(model_shape) == 3 and tuple(file_shape) == tuple(model_shape) + (1,):
        return True
    return len(file_shape) == 5 and len(model_shape) == 4 and file_shape[:2] + file_shape[3:] == tuple(model_shape)


def _to_model(t, model_shape):
    if t.ndim == len(model_shape):
        return t
    if len(model_shape) == 3:
        return t.reshape(*model_shape)
    return t[:, :, t.shape[2] - 1].contiguous()        # causal: the last temporal tap meets the frame


def load_vae(path, dtype=None, device=None, *, config=None, strict=True):
    """AutoencoderKLQwenImage from a diffusers folder (a pipeline's `vae/` too: config.json + weights) or a file in
    diffusers' names (FLAME's config metadata, or the released config). `time_conv` tensors are skipped (video
    only). ComfyUI's / Wan's original VAE layout (`encoder.downsamples...`) is not read yet."""
    files = CIO.safetensors_files(path, what="Qwen-Image VAE", error=QwenImageVAECheckpointError, subfolder="vae")
    with CIO.SafetensorsCheckpoint(files, label=os.fspath(path)) as ckpt:
        ckpt.error = QwenImageVAECheckpointError
        if config is None:
            meta = ckpt.metadata(CONFIG_METADATA_KEY)
            folder = CIO.read_config_json(os.path.dirname(files[0]), QwenImageVAECheckpointError)
            if meta is not None:
                config = QwenImageVAEConfig(**json.loads(meta))
            elif folder is not None and str(folder.get("_class_name", "")) == "AutoencoderKLQwenImage":
                config = QwenImageVAEConfig.from_diffusers(folder)
            else:
                config = QwenImageVAEConfig()
        if dtype is None:
            dtype = CIO.compute_dtype(ckpt.stored_dtype("encoder.conv_in.weight")) \
                if ckpt.has("encoder.conv_in.weight") else flame.float32
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = AutoencoderKLQwenImage(config)
        targets = dict(model.named_parameters())
        keys = [k for k in ckpt.keys() if VIDEO_ONLY not in k]
        missing = [k for k in targets if not ckpt.has(k)]
        unexpected = [k for k in keys if k not in targets]
        misshaped = [f"{k}: {ckpt.shape(k)} in the file, {tuple(t.shape)} in the model" for k, t in targets.items()
                     if ckpt.has(k) and not _file_key_shape(tuple(t.shape), ckpt.shape(k))]
        CIO.check_mismatch(QwenImageVAECheckpointError, f"cannot load the Qwen-Image VAE {ckpt.describe()}:", missing,
                           unexpected, misshaped, strict=strict,
                           hint="(ComfyUI's / Wan's own VAE layout is not read yet: use the diffusers vae/ folder)")
        present = {k: t for k, t in targets.items() if ckpt.has(k)}
        return CIO.fill_(model, lambda k, t: _to_model(ckpt.get_like(k, t), tuple(t.shape)), present,
                         desc="loading AutoencoderKLQwenImage")


def save_vae(model, path):
    """Save in diffusers' names as FLAME holds them (2-D kernels; load_vae reads them back), with the config in the
    metadata. Not a file diffusers reads (its kernels are 3-D)."""
    with flame.no_grad():
        state = [(k, t.detach()) for k, t in model.named_parameters()]
    meta = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(dataclasses.asdict(model.config))}
    return CIO.save_weights(state, path, stem="diffusion_pytorch_model", metadata=meta)
