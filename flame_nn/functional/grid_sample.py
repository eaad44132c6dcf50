"""affine_grid and grid_sample (PyTorch's F.affine_grid / F.grid_sample) for 4-D inputs, written with differentiable
Tensor ops: the gradient reaches the input (through the gathers) and the grid (through the interpolation weights and
the coordinate maps), as PyTorch's does.

grid_sample: the grid's (x, y) in [-1, 1] are unnormalised to pixel coordinates (align_corners: -1 and 1 are the
corner pixels' centres, else their outer edges), mapped by the padding mode ('zeros': as they are, samples outside
read 0; 'border': clipped to the image; 'reflection': reflected at the border, then clipped), and sampled 'bilinear'
(the four neighbours), 'nearest' (round half to even, as nearbyint; no gradient to the grid) or 'bicubic' (the 4 x 4
neighbours, cubic convolution A = -0.75, each tap's coordinate through the padding mode).
"""
import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops import elementwise as E

from .upsample import CUBIC_A, cubic_weights


def affine_grid(theta, size, align_corners=False):
    """Sampling grid (N, H, W, 2) of the affine maps theta (N, 2, 3) over an output of size (N, C, H, W); or
    (N, D, H, W, 3) of theta (N, 3, 4) for a size (N, C, D, H, W)."""
    size = tuple(int(s) for s in size)
    n = len(size) - 2
    if n not in (2, 3) or tuple(theta.shape) != (size[0], n, n + 1):
        raise ShapeError(f"affine_grid: theta {fmt_shape(theta.shape)} and size {size} do not match: expected theta "
                         f"(N, 2, 3) with size (N, C, H, W) or (N, 3, 4) with (N, C, D, H, W)")
    if not theta.dtype.is_floating_point:
        raise TypeError(f"affine_grid: theta must be floating point, got {theta.dtype}")

    def axis(k):
        if align_corners:
            return np.linspace(-1.0, 1.0, k) if k > 1 else np.zeros(1)
        return (np.arange(k) * 2.0 + 1.0) / k - 1.0
    spatial = size[2:][::-1]  # x (width) first
    mesh = np.meshgrid(*[axis(k) for k in spatial[::-1]], indexing="ij")  # (D,) H, W arrays
    coords = [m.reshape(-1) for m in mesh[::-1]] + [np.ones(mesh[0].size)]  # x, y (, z), 1
    base = flame.as_tensor(np.stack(coords, 1).astype(theta.dtype.np), device=theta.device)  # (P, n + 1)
    grid = base @ theta.transpose(1, 2)  # (N, P, n)
    return grid.reshape(size[0], *size[2:], n)


def _unnormalize(c, n, align_corners):
    return (c + 1.0) * ((n - 1) / 2.0) if align_corners else ((c + 1.0) * n - 1.0) / 2.0


def _reflect(c, low2, high2):
    """PyTorch's reflect_coordinates over [low2 / 2, high2 / 2] (differentiable: the fold count is a constant)."""
    if low2 == high2:
        return c * 0.0
    lo, span = low2 / 2.0, (high2 - low2) / 2.0
    d = E.abs(c - lo)
    with flame.no_grad():
        flips = E.floor(d / span)
        even = E.fmod(flips, 2.0) == 0
    extra = d - flips * span
    return E.where(even, extra + lo, (span - extra) + lo)


def _padded(c, n, padding_mode, align_corners):
    """A pixel coordinate along one axis through the padding mode (PyTorch's compute_coordinates, and for bicubic
    each tap's get_value_bounded): border clips, reflection reflects then clips; 'zeros' leaves it (reads outside the
    image give 0)."""
    if padding_mode == "border":
        return E.clamp(c, 0.0, n - 1.0)
    if padding_mode == "reflection":
        c = _reflect(c, 0.0, 2.0 * (n - 1)) if align_corners else _reflect(c, -1.0, 2.0 * n - 1.0)
        return E.clamp(c, 0.0, n - 1.0)
    return c


def _compute(c, n, padding_mode, align_corners):
    """Source coordinate along one axis: unnormalised, then through the padding mode."""
    return _padded(_unnormalize(c, n, align_corners), n, padding_mode, align_corners)


def _tap(flat, iy, ix, H, W):
    """input values at integer coordinates (iy, ix) (N, Ho, Wo) -> (N, C, Ho, Wo); 0 outside the image."""
    N, C = flat.shape[:2]
    with flame.no_grad():
        inside = (ix >= 0) & (ix < W) & (iy >= 0) & (iy < H)
        idx = (E.clamp(iy, 0, H - 1) * W + E.clamp(ix, 0, W - 1)).to(flame.int64)
        idx = idx.reshape(N, 1, -1).expand(N, C, idx[0].numel())
    v = flat.gather(2, idx).reshape(N, C, *iy.shape[1:])
    return v * inside.unsqueeze(1).to(v.dtype)


def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    """PyTorch's F.grid_sample for input (N, C, H, W) and grid (N, Ho, Wo, 2) -> (N, C, Ho, Wo); align_corners None
    means False, as in PyTorch."""
    if mode not in ("bilinear", "nearest", "bicubic"):
        raise ValueError(f"grid_sample: mode must be 'bilinear', 'nearest' or 'bicubic', got {mode!r}")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise ValueError(f"grid_sample: padding_mode must be 'zeros', 'border' or 'reflection', got {padding_mode!r}")
    if input.ndim != 4:
        raise ShapeError(f"grid_sample: expected a 4-D input (N, C, H, W), got {fmt_shape(input.shape)} (5-D "
                         f"volumes are not supported)")
    if grid.ndim != 4 or grid.shape[-1] != 2 or grid.shape[0] != input.shape[0]:
        raise ShapeError(f"grid_sample: grid {fmt_shape(grid.shape)} must be (N, Ho, Wo, 2) with the input's N = "
                         f"{input.shape[0]}")
    align = bool(align_corners)
    N, C, H, W = input.shape
    dt = input.dtype if input.dtype.itemsize >= 4 else flame.float32
    x = input.to(dt)
    g = grid.to(dt)
    flat = x.reshape(N, C, H * W)
    gx, gy = g[..., 0], g[..., 1]
    if mode == "bicubic":
        # PyTorch: the unclipped source point; each tap's coordinate goes through the padding mode on its own
        ix, iy = _unnormalize(gx, W, align), _unnormalize(gy, H, align)
        with flame.no_grad():
            x0, y0 = E.floor(ix), E.floor(iy)
        wx, wy = cubic_weights(ix - x0, CUBIC_A), cubic_weights(iy - y0, CUBIC_A)
        out = None
        for a, wya in zip(range(-1, 3), wy):
            row = None
            for b, wxb in zip(range(-1, 3), wx):
                with flame.no_grad():
                    tx = _padded(x0 + b, W, padding_mode, align)
                    ty = _padded(y0 + a, H, padding_mode, align)
                v = _tap(flat, ty, tx, H, W) * wxb.unsqueeze(1)
                row = v if row is None else row + v
            v = row * wya.unsqueeze(1)
            out = v if out is None else out + v
        return out.to(input.dtype)
    ix, iy = _compute(gx, W, padding_mode, align), _compute(gy, H, padding_mode, align)
    if mode == "nearest":
        with flame.no_grad():
            nx, ny = E.round(ix), E.round(iy)
        return _tap(flat, ny, nx, H, W).to(input.dtype)
    with flame.no_grad():
        x0, y0 = E.floor(ix), E.floor(iy)
    tx, ty = ix - x0, iy - y0  # differentiable in the grid
    w00, w01 = ((1.0 - tx) * (1.0 - ty)).unsqueeze(1), (tx * (1.0 - ty)).unsqueeze(1)
    w10, w11 = ((1.0 - tx) * ty).unsqueeze(1), (tx * ty).unsqueeze(1)
    out = (_tap(flat, y0, x0, H, W) * w00 + _tap(flat, y0, x0 + 1, H, W) * w01
           + _tap(flat, y0 + 1, x0, H, W) * w10 + _tap(flat, y0 + 1, x0 + 1, H, W) * w11)
    return out.to(input.dtype)

