"""pixel_shuffle / pixel_unshuffle: (*, C r^2, H, W) <-> (*, C, H r, W r) by a reshape and a permutation."""
from flame_core.errors import ShapeError, fmt_shape


def pixel_shuffle(input, upscale_factor):
    r = int(upscale_factor)
    if input.ndim < 3 or r < 1 or input.shape[-3] % (r * r):
        raise ShapeError(f"pixel_shuffle: input {fmt_shape(input.shape)} needs at least 3 dims and a channel count "
                         f"divisible by upscale_factor^2 = {r * r}")
    *lead, C, H, W = input.shape
    c = C // (r * r)
    x = input.reshape(*lead, c, r, r, H, W)                              # (*, c, r_h, r_w, H, W)
    n = len(lead)
    x = x.permute(*range(n), n, n + 3, n + 1, n + 4, n + 2)              # (*, c, H, r_h, W, r_w)
    return x.reshape(*lead, c, H * r, W * r)


def pixel_unshuffle(input, downscale_factor):
    r = int(downscale_factor)
    if input.ndim < 3 or r < 1 or input.shape[-2] % r or input.shape[-1] % r:
        raise ShapeError(f"pixel_unshuffle: input {fmt_shape(input.shape)} needs at least 3 dims and a height and "
                         f"width divisible by downscale_factor = {r}")
    *lead, C, H, W = input.shape
    h, w = H // r, W // r
    x = input.reshape(*lead, C, h, r, w, r)                              # (*, C, h, r_h, w, r_w)
    n = len(lead)
    x = x.permute(*range(n), n, n + 2, n + 4, n + 1, n + 3)              # (*, C, r_h, r_w, h, w)
    return x.reshape(*lead, C * r * r, h, w)
