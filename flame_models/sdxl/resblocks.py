"""The UNet's convolutional blocks, named as in SAI's openaimodel.py so parameter names equal checkpoint keys:
ResBlock (in_layers.0 GroupNorm, in_layers.2 conv, emb_layers.1 Linear, out_layers.0 GroupNorm, out_layers.3 conv,
skip_connection), Downsample (op), Upsample (conv), and TimestepEmbedSequential, the container of one input or
output block.

Every block of a stack takes (x, emb, context): ResBlocks read emb, SpatialTransformers context, the rest neither.
Under no_grad the intermediates are dropped as soon as the next one exists and sums are done in place.
"""
import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_core.checkpoint import maybe_checkpoint

from ..vae.layers import conv_add, norm_silu

RESBLOCK_EPS = 1e-5


class ResBlock(flame_nn.Module):
    """h = conv(SiLU(GN(x))); h += Linear(SiLU(emb)) over every pixel; h = conv(SiLU(GN(h))); out = skip(x) + h,
    skip a 1x1 conv when the channel count changes. GroupNorm: 32 groups (config), eps 1e-5, statistics in float32.
    `gradient_checkpointing` is read by whoever runs the block (its TimestepEmbedSequential or run_block)."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, channels, emb_channels, out_channels, groups=32, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.channels, self.out_channels = channels, out_channels
        self.in_layers = flame_nn.Sequential(
            flame_nn.GroupNorm(groups, channels, eps=RESBLOCK_EPS, **kw), flame_nn.SiLU(),
            flame_nn.Conv2d(channels, out_channels, 3, padding=1, **kw))
        self.emb_layers = flame_nn.Sequential(flame_nn.SiLU(), flame_nn.Linear(emb_channels, out_channels, **kw))
        self.out_layers = flame_nn.Sequential(
            flame_nn.GroupNorm(groups, out_channels, eps=RESBLOCK_EPS, **kw), flame_nn.SiLU(),
            flame_nn.Identity(), flame_nn.Conv2d(out_channels, out_channels, 3, padding=1, **kw))
        if channels != out_channels:
            self.skip_connection = flame_nn.Conv2d(channels, out_channels, 1, **kw)
        else:
            self.skip_connection = flame_nn.Identity()

    def forward(self, x, emb, context=None):                         # x (B, C, H, W), emb (B, E)
        h = norm_silu(self.in_layers[0], x, self.in_layers[2])      # in_layers.0 GroupNorm, .1 SiLU
        e = self.emb_layers[1](F.silu(emb)).to(h.dtype)             # (B, C_out)
        h = conv_add(self.in_layers[2], h, add=e)                    # conv + emb over every pixel: one pass
        del e
        h = norm_silu(self.out_layers[0], h, self.out_layers[3])    # out_layers.0 GroupNorm, .1 SiLU
        return conv_add(self.out_layers[3], h, residual=self.skip_connection(x))   # conv + skip: one pass


class Downsample(flame_nn.Module):
    """3x3 conv, stride 2, padding 1 (SAI's `op`)."""

    def __init__(self, channels, dtype=None, device=None):
        super().__init__()
        self.op = flame_nn.Conv2d(channels, channels, 3, stride=2, padding=1, dtype=dtype, device=device)

    def forward(self, x, emb=None, context=None):
        return self.op(x)


class Upsample(flame_nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels, dtype=None, device=None):
        super().__init__()
        self.conv = flame_nn.Conv2d(channels, channels, 3, padding=1, dtype=dtype, device=device)

    def forward(self, x, emb=None, context=None):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class TimestepEmbedSequential(flame_nn.Sequential):
    """One input or output block of the UNet: its layers (ResBlock, SpatialTransformer, Down/Upsample, or the input
    conv) called in order with (x, emb, context). An output block first concatenates the encoder's skip tensor to x.
    The block itself is never checkpointed whole (unless a BlockStreamer streams it): its ResBlocks and transformer
    blocks are, one at a time, as their `gradient_checkpointing` flags say."""

    def forward(self, x, emb, context, skip=None):
        if skip is not None:
            x = flame.cat([x, skip], dim=1)                          # (B, C + C_skip, H, W)
            del skip
        for layer in self:
            if isinstance(layer, ResBlock):
                x = maybe_checkpoint(layer, x, emb, offload=layer.checkpoint_offload)
            elif isinstance(layer, flame_nn.Conv2d):
                x = layer(x)
            else:
                x = layer(x, emb, context)
        return x
