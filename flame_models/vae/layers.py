"""The blocks of the LDM AutoencoderKL, named as in the LDM / BFL checkpoints (`block.0.norm1`, `attn_1.q`, ...).

Every forward keeps as few full-resolution tensors alive as it can: a statement per step, so each intermediate is
dropped as soon as the next one exists (at 1024^2 one 128-channel bf16 map is 256 MiB). The residual sum is done in
place when nothing records gradients.
"""
import flame_core as flame
import flame_nn
import flame_nn.functional as F

from .attention import single_head_attention


def inplace_ok(*tensors):
    """Whether an op may overwrite one of `tensors` in place: nothing records gradients through them (the SDXL
    UNet's blocks use this and add_residual too)."""
    return not flame.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def add_residual(h, x):
    """h + x, written into h when no gradient is being recorded (h is a fresh tensor the caller owns)."""
    if inplace_ok(h, x):
        h += x
        return h
    return h + x


def plain_conv(conv):
    """Whether `conv` is a plain flame_nn.Conv2d - no adapters mixed in, no hooks, zero padding - whose weights a
    fused functional (F.conv2d_add, F.pad_conv2d) may take in its place."""
    return type(conv) is flame_nn.Conv2d and conv.padding_mode == "zeros" and not conv.has_hooks()


def conv_add(conv, x, add=None, residual=None):
    """conv(x) (+ add[:, :, None, None]) (+ residual): for a plain conv one F.conv2d_add (the adds in the
    convolution's epilogue on the wgmma path), else the layer (its adapters see x) and then the adds."""
    if plain_conv(conv):
        return F.conv2d_add(x, conv.weight, conv.bias, add, residual, conv.stride, conv.padding, conv.dilation,
                            conv.groups)
    h = conv(x)
    if add is not None:
        e = add[:, :, None, None]
        if inplace_ok(h, e):
            h += e
        else:
            h = h + e
    return h if residual is None else add_residual(h, residual)


def group_norm(num_channels, config, dtype=None, device=None):
    return flame_nn.GroupNorm(config.norm_num_groups, num_channels, eps=config.norm_eps, affine=True,
                              dtype=dtype, device=device)


def norm_silu(norm, x, conv=None):
    """silu(norm(x)) for a flame_nn.GroupNorm `norm`, as one fused op with its parameters, group count and eps (one
    pass over the activation instead of two; the norm stays a module, so checkpoint keys do not change). The SDXL
    UNet's blocks use this too. `conv`: the plain conv that reads the result next - the result is then written in
    the memory format that conv reads in place (F.conv2d_memory_format: channels-last for the implicit GEMM), so no
    transpose sits between the norm and the conv."""
    fmt = flame.contiguous_format
    if conv is not None and plain_conv(conv):
        fmt = F.conv2d_memory_format(x, conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups)
    return F.group_norm_silu(x, norm.num_groups, norm.weight, norm.bias, norm.eps, memory_format=fmt)


class ResnetBlock(flame_nn.Module):
    """norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> conv2, plus the input (through a 1x1 nin_shortcut when the channel
    count changes). No timestep embedding and no dropout: the VAE's blocks never use them."""

    def __init__(self, in_channels, out_channels, config, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1 = group_norm(in_channels, config, **kw)
        self.conv1 = flame_nn.Conv2d(in_channels, out_channels, 3, padding=1, **kw)
        self.norm2 = group_norm(out_channels, config, **kw)
        self.conv2 = flame_nn.Conv2d(out_channels, out_channels, 3, padding=1, **kw)
        if in_channels != out_channels:
            self.nin_shortcut = flame_nn.Conv2d(in_channels, out_channels, 1, **kw)

    def forward(self, x):                                        # (B, C_in, H, W)
        h = norm_silu(self.norm1, x, self.conv1)
        h = self.conv1(h)
        h = norm_silu(self.norm2, h, self.conv2)
        if self.in_channels == self.out_channels:               # the residual added by conv2 (F.conv2d_add)
            return conv_add(self.conv2, h, residual=x)
        h = self.conv2(h)                                        # (B, C_out, H, W); the shortcut after, so that
        return add_residual(h, self.nin_shortcut(x))             # conv2's input is gone before it exists


class AttnBlock(flame_nn.Module):
    """Single-head self-attention over the H*W positions, q/k/v/proj_out stored as 1x1 convs (C, C, 1, 1), run as
    Linears on the (B, H*W, C) tokens; the attention itself a block of query rows at a time (attention.py)."""

    def __init__(self, channels, config, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.channels = channels
        self.norm = group_norm(channels, config, **kw)
        self.q = flame_nn.Conv2d(channels, channels, 1, **kw)
        self.k = flame_nn.Conv2d(channels, channels, 1, **kw)
        self.v = flame_nn.Conv2d(channels, channels, 1, **kw)
        self.proj_out = flame_nn.Conv2d(channels, channels, 1, **kw)

    def _pointwise(self, conv, tokens):
        C = self.channels
        return F.linear(tokens, conv.weight.reshape(C, C), conv.bias)

    def forward(self, x):                                        # (B, C, H, W)
        B, C, H, W = x.shape
        h = self.norm(x)
        h = h.reshape(B, C, H * W).transpose(1, 2).contiguous()  # (B, L, C), one copy for q, k and v
        q = self._pointwise(self.q, h)
        k = self._pointwise(self.k, h)
        v = self._pointwise(self.v, h)
        del h
        o = single_head_attention(q, k, v)                       # (B, L, C)
        del q, k, v
        o = self._pointwise(self.proj_out, o)
        o = o.transpose(1, 2).reshape(B, C, H, W)
        return add_residual(o, x)


class Downsample(flame_nn.Module):
    """Zero pad one pixel right and bottom, then a 3x3 stride-2 conv (LDM's asymmetric padding). The plain layer
    folds the padding into the convolution (F.pad_conv2d: no padded copy of the activation); a conv with adapters
    or hooks gets the padded input, as its adapters' own convolutions expect."""

    def __init__(self, channels, dtype=None, device=None):
        super().__init__()
        self.conv = flame_nn.Conv2d(channels, channels, 3, stride=2, padding=0, dtype=dtype, device=device)

    def forward(self, x):
        c = self.conv
        if plain_conv(c):
            return F.pad_conv2d(x, c.weight, c.bias, (0, 1, 0, 1), stride=c.stride)
        return c(F.pad(x, (0, 1, 0, 1)))


class Upsample(flame_nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels, dtype=None, device=None):
        super().__init__()
        self.conv = flame_nn.Conv2d(channels, channels, 3, padding=1, dtype=dtype, device=device)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(x)


class MidBlock(flame_nn.Module):
    """block_1 -> attn_1 -> block_2 at the lowest resolution (attn_1 absent when config.mid_attention is off)."""

    def __init__(self, channels, config, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.block_1 = ResnetBlock(channels, channels, config, **kw)
        if config.mid_attention:
            self.attn_1 = AttnBlock(channels, config, **kw)
        self.block_2 = ResnetBlock(channels, channels, config, **kw)
        self.has_attention = config.mid_attention

    def forward(self, x):
        x = self.block_1(x)
        if self.has_attention:
            x = self.attn_1(x)
        return self.block_2(x)
