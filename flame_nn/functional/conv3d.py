"""conv3d and conv_transpose3d (PyTorch's F.conv3d / F.conv_transpose3d) built from the 2-D ones: a 3-D kernel is
kD 2-D kernels, one per depth tap, so

    conv3d:           y[:, :, d] = sum_kd conv2d(x[:, :, d * sD + kd * dD], w[:, :, kd])
                      -- for each tap kd, the taps' depth slices of every output depth go through ONE conv2d as a
                      batch of N * D_out images, and the kD results are summed;
    conv_transpose3d: each input depth's conv_transpose2d with w[:, :, kd] lands at output depth d * sD + kd * dD
                      (stride-interleaved with zeros), summed over the taps, then cropped by the padding.

The 2-D ops run FLAME's convolutions (cuda kernels or im2col + GEMM), and the gradients come through them and the
slicing. Inputs (N, C, D, H, W) or unbatched (C, D, H, W); padding an int, a triple, 'valid' or (conv3d, stride 1)
'same' (PyTorch's: the odd extra on the far side)."""
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops.conv import conv2d
from flame_core.ops.conv_transpose import conv_transpose2d
from flame_core.ops.creation import zeros
from flame_core.ops.indexing import pad
from flame_core.ops.shape import cat


def _triple(v, name, op):
    if isinstance(v, int):
        return (v, v, v)
    v = tuple(int(i) for i in v)
    if len(v) != 3:
        raise ValueError(f"{op}: {name} must be an int or a 3-tuple, got {v}")
    return v


def _batched(op, input, weight):
    if weight.ndim != 5 or input.ndim not in (4, 5):
        raise ShapeError(f"{op} expects input (N, C, D, H, W) or (C, D, H, W) and a 5-D weight, got "
                         f"{fmt_shape(input.shape)} and {fmt_shape(weight.shape)}")
    return (input.unsqueeze(0), True) if input.ndim == 4 else (input, False)


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """input (N, C, D, H, W), weight (O, C/groups, kD, kH, kW) -> (N, O, D', H', W')."""
    x, unbatched = _batched("conv3d", input, weight)
    st, dl = _triple(stride, "stride", "conv3d"), _triple(dilation, "dilation", "conv3d")
    k = tuple(weight.shape[2:])
    if x.shape[1] != weight.shape[1] * groups:
        raise ShapeError(f"conv3d: input has {x.shape[1]} channels, the weight expects {weight.shape[1] * groups} "
                         f"(weight {fmt_shape(weight.shape)}, groups={groups})")
    if isinstance(padding, str):
        if padding == "valid":
            lo = hi = (0, 0, 0)
        elif padding == "same":
            if st != (1, 1, 1):
                raise ValueError("conv3d: padding='same' is not supported for strided convolutions")
            total = [d * (kk - 1) for d, kk in zip(dl, k)]
            lo = tuple(t // 2 for t in total)
            hi = tuple(t - t // 2 for t in total)
        else:
            raise ValueError(f"conv3d: padding must be an int, a 3-tuple, 'valid' or 'same', got {padding!r}")
    else:
        lo = hi = _triple(padding, "padding", "conv3d")
    if lo[0] or hi[0] or lo[1:] != hi[1:]:   # depth always, and uneven height / width padding, padded here
        x = pad(x, (lo[2], hi[2], lo[1], hi[1], lo[0], hi[0]))
        hw_pad = (0, 0)
    else:
        hw_pad = lo[1:]
    N, C, Dp = x.shape[:3]
    Do = (Dp - dl[0] * (k[0] - 1) - 1) // st[0] + 1
    if Do <= 0:
        raise ShapeError(f"conv3d: the kernel (depth {k[0]}, dilation {dl[0]}) is larger than the padded input "
                         f"depth {Dp}")
    y = None
    for kd in range(k[0]):
        s0 = kd * dl[0]
        xs = x[:, :, s0:s0 + st[0] * (Do - 1) + 1:st[0]]                    # (N, C, Do, H, W)
        xs = xs.permute(0, 2, 1, 3, 4).reshape(N * Do, C, x.shape[3], x.shape[4])
        part = conv2d(xs, weight[:, :, kd], None, st[1:], hw_pad, dl[1:], groups)
        y = part if y is None else y + part
    y = y.reshape(N, Do, y.shape[1], y.shape[2], y.shape[3]).permute(0, 2, 1, 3, 4)
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1, 1)
    return y.squeeze(0) if unbatched else y


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """input (N, Cin, D, H, W), weight (Cin, Cout/groups, kD, kH, kW) -> (N, Cout, D', H', W') with
    D' = (D - 1) * stride - 2 * padding + dilation * (kD - 1) + output_padding + 1 (likewise H', W')."""
    x, unbatched = _batched("conv_transpose3d", input, weight)
    op = "conv_transpose3d"
    st, pd = _triple(stride, "stride", op), _triple(padding, "padding", op)
    opad, dl = _triple(output_padding, "output_padding", op), _triple(dilation, "dilation", op)
    if any(o >= max(s, d) for o, s, d in zip(opad, st, dl)):
        raise ValueError(f"conv_transpose3d: output_padding {opad} must be smaller than either stride {st} or "
                         f"dilation {dl}")
    if x.shape[1] != weight.shape[0]:
        raise ShapeError(f"conv_transpose3d: input has {x.shape[1]} channels, the weight {fmt_shape(weight.shape)} "
                         f"expects {weight.shape[0]}")
    N, Cin, D, H, W = x.shape
    kD = weight.shape[2]
    Dfull = (D - 1) * st[0] + dl[0] * (kD - 1) + 1 + opad[0]
    Do = Dfull - 2 * pd[0]
    if Do <= 0:
        raise ShapeError(f"conv_transpose3d: the output depth {Do} is not positive (input depth {D}, padding "
                         f"{pd[0]})")
    xs = x.permute(0, 2, 1, 3, 4).reshape(N * D, Cin, H, W)
    total = None
    for kd in range(kD):
        z = conv_transpose2d(xs, weight[:, :, kd], None, st[1:], pd[1:], opad[1:], groups, dl[1:])
        Co, Ho, Wo = z.shape[1:]
        z = z.reshape(N, D, Co, Ho, Wo)
        if st[0] > 1:   # input depth d lands at d * stride: interleave stride - 1 zero slices after each
            gap = zeros((N, D, st[0] - 1, Co, Ho, Wo), dtype=z.dtype, device=z.device)
            z = cat([z.unsqueeze(2), gap], dim=2).reshape(N, D * st[0], Co, Ho, Wo)[:, :(D - 1) * st[0] + 1]
        before, after = kd * dl[0], Dfull - kd * dl[0] - z.shape[1]
        parts = [z]
        if before:
            parts.insert(0, zeros((N, before, Co, Ho, Wo), dtype=z.dtype, device=z.device))
        if after:
            parts.append(zeros((N, after, Co, Ho, Wo), dtype=z.dtype, device=z.device))
        z = cat(parts, dim=1) if len(parts) > 1 else z
        total = z if total is None else total + z
    y = total[:, pd[0]:pd[0] + Do].permute(0, 2, 1, 3, 4)
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1, 1)
    return y.squeeze(0) if unbatched else y

