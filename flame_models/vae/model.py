"""AutoencoderKL: the LDM VAE of SDXL, SD3 and Flux. Images (B, 3, H, W) in [-1, 1] <-> unscaled latents.

Parameter names are the LDM / BFL checkpoint keys (encoder.down.0.block.0.norm1.weight, decoder.up.3.upsample.conv
.weight, encoder.mid.attn_1.q.weight, quant_conv.weight), so an `ae.safetensors` loads by name; the latent scale and
shift of a model family live in LatentFormat, not here.
"""
import flame_core as flame
import flame_nn

from . import tiling
from .config import vae_config
from .distribution import DiagonalGaussianDistribution
from .layers import Downsample, MidBlock, ResnetBlock, Upsample, group_norm, norm_silu

AUTO_TILE_MAX_PIXELS = 2 * 1024 * 1024  # images above this area are tiled unless tiling is switched off


class DownLevel(flame_nn.Module):
    def __init__(self, in_channels, out_channels, num_blocks, downsample, config, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.block = flame_nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, config, **kw) for i in range(num_blocks))
        if downsample:
            self.downsample = Downsample(out_channels, **kw)
        self.has_downsample = downsample


class UpLevel(flame_nn.Module):
    def __init__(self, in_channels, out_channels, num_blocks, upsample, config, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.block = flame_nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, config, **kw) for i in range(num_blocks))
        if upsample:
            self.upsample = Upsample(out_channels, **kw)
        self.has_upsample = upsample


class Encoder(flame_nn.Module):
    """(B, in_channels, H, W) -> moments (B, 2*z_channels, H/f, W/f), f = 2^(levels - 1)."""

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        c = config
        kw = dict(dtype=dtype, device=device)
        n = len(c.ch_mult)
        self.conv_in = flame_nn.Conv2d(c.in_channels, c.ch, 3, padding=1, **kw)
        channels_in = (c.ch,) + c.block_out_channels[:-1]
        self.down = flame_nn.ModuleList(
            DownLevel(channels_in[i], c.block_out_channels[i], c.num_res_blocks, i != n - 1, c, **kw)
            for i in range(n))
        top = c.block_out_channels[-1]
        self.mid = MidBlock(top, c, **kw)
        self.norm_out = group_norm(top, c, **kw)
        self.conv_out = flame_nn.Conv2d(top, 2 * c.z_channels, 3, padding=1, **kw)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if level.has_downsample:
                h = level.downsample(h)
        h = self.mid(h)
        h = norm_silu(self.norm_out, h, self.conv_out)
        return self.conv_out(h)


class Decoder(flame_nn.Module):
    """z (B, z_channels, h, w) -> images (B, out_channels, h*f, w*f). up.0 is the full-resolution level; the
    levels run from up.(n-1) down to up.0."""

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        c = config
        kw = dict(dtype=dtype, device=device)
        n = len(c.ch_mult)
        top = c.block_out_channels[-1]
        self.conv_in = flame_nn.Conv2d(c.z_channels, top, 3, padding=1, **kw)
        self.mid = MidBlock(top, c, **kw)
        # up.i takes the channels of level i+1 (the top level's for i = n-1) to those of level i
        channels_in = c.block_out_channels[1:] + (top,)
        self.up = flame_nn.ModuleList(
            UpLevel(channels_in[i], c.block_out_channels[i], c.num_res_blocks + 1, i != 0, c, **kw)
            for i in range(n))
        self.norm_out = group_norm(c.block_out_channels[0], c, **kw)
        self.conv_out = flame_nn.Conv2d(c.block_out_channels[0], c.out_channels, 3, padding=1, **kw)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid(h)
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if level.has_upsample:
                h = level.upsample(h)
        h = norm_silu(self.norm_out, h, self.conv_out)
        return self.conv_out(h)


class AutoencoderKL(flame_nn.Module):
    """AutoencoderKL(config) with config a VAEConfig or a preset name ('flux', 'sd3', 'sdxl').

    encode(images, generator=None) -> the posterior mean, or a sample with a generator (unscaled latents);
    decode(z) -> images, nominally in [-1, 1] (not clamped). Both take NCHW tensors and compute in the weights'
    dtype. Large inputs are tiled (see enable_tiling / disable_tiling / enable_auto_tiling)."""

    def __init__(self, config="flux", *, dtype=None, device=None):
        super().__init__()
        c = vae_config(config)
        self.config = c
        kw = dict(dtype=dtype, device=device)
        self.encoder = Encoder(c, **kw)
        self.decoder = Decoder(c, **kw)
        self.quant_conv = flame_nn.Conv2d(2 * c.z_channels, 2 * c.z_channels, 1, **kw) if c.use_quant_conv else None
        self.post_quant_conv = flame_nn.Conv2d(c.z_channels, c.z_channels, 1, **kw) if c.use_post_quant_conv \
            else None
        # tiling: None = automatic (tiles above auto_tile_max_pixels), True = always (diffusers' enable_tiling:
        # every input larger than a tile), False = never
        self.use_tiling = None
        self.tile_sample_min_size = c.sample_size
        self.tile_overlap_factor = 0.25
        self.auto_tile_max_pixels = AUTO_TILE_MAX_PIXELS

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """A VAE from a checkpoint file or folder; see flame_models.vae.load_vae."""
        from .loading import load_vae
        return load_vae(path, dtype=dtype, device=device, **kwargs)

    @property
    def dtype(self):
        return self.encoder.conv_in.weight.dtype

    @property
    def device(self):
        return self.encoder.conv_in.weight.device

    # ------------------------------------------------------------------ tiling switches
    @property
    def tile_latent_min_size(self):
        return int(self.tile_sample_min_size / self.config.downsample_factor)

    def enable_tiling(self, tile_sample_min_size=None, tile_overlap_factor=None):
        """Tile every input larger than a tile (diffusers' semantics); optionally set the tile size in pixels
        and the overlap factor (0.25: neighbouring tiles share a quarter of a tile, blended linearly)."""
        if tile_sample_min_size is not None:
            f = self.config.downsample_factor
            if int(tile_sample_min_size) < f or int(tile_sample_min_size) % f:
                raise ValueError(f"enable_tiling: tile_sample_min_size={tile_sample_min_size} must be a positive "
                                 f"multiple of the VAE's downsample factor {f}")
            self.tile_sample_min_size = int(tile_sample_min_size)
        if tile_overlap_factor is not None:
            if not 0.0 <= float(tile_overlap_factor) < 1.0:
                raise ValueError(f"enable_tiling: tile_overlap_factor={tile_overlap_factor} must be in [0, 1)")
            self.tile_overlap_factor = float(tile_overlap_factor)
        self.use_tiling = True
        return self

    def disable_tiling(self):
        """Never tile (also switches off the automatic tiling of large inputs)."""
        self.use_tiling = False
        return self

    def enable_auto_tiling(self, max_pixels=AUTO_TILE_MAX_PIXELS):
        """The default: tile only inputs whose image area exceeds max_pixels (and that are larger than a tile)."""
        self.auto_tile_max_pixels = int(max_pixels)
        self.use_tiling = None
        return self

    def _tiles(self, height, width, tile, image_pixels):
        """Whether an input of height x width (in the units of `tile`) goes through the tiled path."""
        if self.use_tiling is False or not (height > tile or width > tile):
            return False
        return self.use_tiling is True or image_pixels > self.auto_tile_max_pixels

    # ------------------------------------------------------------------ encode
    def _check(self, x, channels, what):
        if not isinstance(x, flame.Tensor):
            raise TypeError(f"AutoencoderKL.{what}: expected a Tensor, got {type(x).__name__}")
        if x.ndim != 4 or x.shape[1] != channels:
            raise ValueError(f"AutoencoderKL.{what}: expected a (B, {channels}, H, W) tensor, got shape "
                             f"{tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"AutoencoderKL.{what}: expected a floating point tensor, got {x.dtype}")
        if x.device != self.device:
            raise flame.DeviceError(f"AutoencoderKL.{what}: the input is on {x.device} but the VAE is on "
                                    f"{self.device}; move one of them (.to(device))")
        return x.to(self.dtype)

    def _encode_tile(self, x):
        h = self.encoder(x)
        return self.quant_conv(h) if self.quant_conv is not None else h

    def encode_moments(self, images):
        """The encoder's (mean | logvar) (B, 2*z, H/f, W/f), tiled when the tiling switches say so."""
        x = self._check(images, self.config.in_channels, "encode")
        H, W = x.shape[-2:]
        if self._tiles(H, W, self.tile_sample_min_size, H * W):
            return tiling.tiled_encode(self, x)
        return self._encode_tile(x)

    def encode_dist(self, images):
        """The posterior (diffusers' `encode(x).latent_dist`): .mean, .logvar, .std, .sample(generator)."""
        return DiagonalGaussianDistribution(self.encode_moments(images))

    def encode(self, images, generator=None):
        """Unscaled latents of images (B, C, H, W) in [-1, 1]: the posterior mean, or mean + std * eps with eps
        drawn from `generator` when one is given."""
        dist = self.encode_dist(images)
        return dist.mean if generator is None else dist.sample(generator=generator)

    # ------------------------------------------------------------------ decode
    def _decode_tile(self, z):
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def decode(self, z):
        """Images (B, out_channels, h*f, w*f), nominally in [-1, 1] (not clamped), from unscaled latents."""
        z = self._check(z, self.config.z_channels, "decode")
        h, w = z.shape[-2:]
        f = self.config.downsample_factor
        if self._tiles(h, w, self.tile_latent_min_size, h * w * f * f):
            return tiling.tiled_decode(self, z)
        return self._decode_tile(z)

    def forward(self, images, sample_posterior=False, generator=None):
        """decode(encode(images)), with a sampled latent when sample_posterior (diffusers' forward)."""
        dist = self.encode_dist(images)
        z = dist.sample(generator=generator) if sample_posterior else dist.mode()
        return self.decode(z)


__all__ = ["AutoencoderKL", "Encoder", "Decoder"]
