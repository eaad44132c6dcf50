"""FreeU (Si et al., "FreeU: Free Lunch in Diffusion U-Net", arXiv 2309.11497) on the SDXL UNet's decoder, as
diffusers' `UNet2DConditionModel.enable_freeu(s1, s2, b1, b2)` applies it (diffusers.utils.torch_utils.apply_freeu):
in the two deepest decoder levels -- diffusers' up_blocks 0 and 1, SAI's output_blocks 0-2 and 3-5 --, before each
output block concatenates its skip tensor,

    the backbone h:  its first half of channels times b1 (level 0) / b2 (level 1)
    the skip:        its lowest spatial frequencies times s1 / s2 (fourier_filter)

diffusers' fourier_filter takes each (H, W) plane's 2-D FFT, fftshifts it, scales the 2 x 2 centre of the spectrum
(threshold 1: the frequencies k_y, k_x in {0, -1}), shifts back and keeps the real part of the inverse FFT, in
float32. Those four frequencies make it a rank-2 operator on each side: with F the DFT and P the mask's frequencies,
F⁻¹PF = A_N, A_N[a, b] = (1/N) Σ_{k ∈ {0, -1} mod N} exp(2πi·k·(a - b)/N), so

    filtered = x + (s - 1) · Re(A_H x A_Wᵀ) = x + (s - 1) · (R_H x R_Wᵀ - I_H x I_Wᵀ)

with R, I the real and imaginary parts of A: four small matmuls per plane and no FFT op (the same numbers as the
FFT up to float32 rounding: tests/models/test_sdxl_freeu.py against diffusers' own function and UNet). R and I are
sent to the device once per plane size, so a UNet call copies nothing from the host (SDXL's samplers run it
eagerly; a CUDA graph of it is not tested).
"""
import functools
import math

import numpy as np

import flame_core as flame

from ..numbers import as_float

LEVELS = 2          # the decoder levels FreeU changes (diffusers' resolution_idx 0 and 1)
# FreeU's published values for SDXL (the FreeU repository's README; ComfyUI's FreeU node defaults to SD1.5's)
SDXL_DEFAULTS = dict(b1=1.3, b2=1.4, s1=0.9, s2=0.2)


def check_freeu(s1, s2, b1, b2):
    """The four factors as floats; a ValueError naming a factor that is not a finite number."""
    out = {}
    for name, v in (("s1", s1), ("s2", s2), ("b1", b1), ("b2", b2)):
        f = as_float(v)
        if not math.isfinite(f):
            raise ValueError(f"FreeU {name}: a finite number, got {v!r}")
        out[name] = f
    return out


@functools.lru_cache(maxsize=64)
def _operator(n):
    """(R, I) float32 (n, n): the real and imaginary parts of A_n (the module docstring)."""
    if n == 1:                                   # (frequencies 0 and -1 are the same one)
        return np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32)
    d = np.subtract.outer(np.arange(n), np.arange(n)).astype(np.float64)
    a = 2.0 * np.pi * d / n
    return ((1.0 + np.cos(a)) / n).astype(np.float32), (-np.sin(a) / n).astype(np.float32)


_ON_DEVICE = {}   # (device, n) -> (R, I) there: sent once (every UNet call reuses them; a CUDA graph capturing the
#                  UNet finds them there instead of copying from the host inside the capture)


def _on(device, n):
    key = (str(device), n)
    out = _ON_DEVICE.get(key)
    if out is None:
        r, i = _operator(n)
        out = _ON_DEVICE[key] = (flame.tensor(r, device=device), flame.tensor(i, device=device))
    return out


def fourier_filter(x, scale):
    """diffusers' fourier_filter(x, threshold=1, scale) of x (..., H, W): the lowest frequencies of each plane times
    `scale`, computed in float32, returned in x's dtype."""
    xf = x.float()
    rh, ih = _on(x.device, x.shape[-2])
    rw, iw = _on(x.device, x.shape[-1])
    low = rh @ xf @ rw.transpose(0, 1) - ih @ xf @ iw.transpose(0, 1)
    return (xf + low * (float(scale) - 1.0)).to(x.dtype)


def apply_freeu(level, h, skip, factors):
    """(h, skip) of an output block of decoder `level` (0 = the deepest) with FreeU's `factors` ({s1, s2, b1, b2})
    applied: levels 0 and 1 only (the others are returned as they are)."""
    if level >= LEVELS:
        return h, skip
    b, s = factors["b1" if level == 0 else "b2"], factors["s1" if level == 0 else "s2"]
    half = h.shape[1] // 2
    h = flame.cat([h[:, :half] * b, h[:, half:]], dim=1)   # (a scalar product in h's dtype, as diffusers')
    return h, fourier_filter(skip, s)


def parse_freeu(value):
    """generate's `freeu`: None / False (off), True or "default" (SDXL_DEFAULTS), a dict of some of s1, s2, b1, b2,
    or a string "b1=1.3,s2=0.2" (the command line's) -- the factors not given take SDXL_DEFAULTS'. Returns the four
    factors or None; a ValueError naming what is wrong."""
    if value is None or value is False:
        return None
    if value is True or value == "default":
        return dict(SDXL_DEFAULTS)
    if isinstance(value, str):
        given = {}
        for item in value.split(","):
            name, eq, v = item.strip().partition("=")
            if not eq:
                raise ValueError(f"{value!r}: name=value pairs of s1, s2, b1, b2 (e.g. b1=1.3,b2=1.4,s1=0.9,s2=0.2), "
                                 f"or default")
            given[name.strip()] = v.strip()
        value = given
    if not isinstance(value, dict):
        raise ValueError(f"True, 'default', a dict or 'b1=..,s1=..' of s1, s2, b1, b2; got {value!r}")
    unknown = sorted(set(value) - set(SDXL_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown factor(s) {unknown}: s1, s2, b1, b2")
    return check_freeu(**{**SDXL_DEFAULTS, **value})
