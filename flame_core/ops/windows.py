"""PyTorch's window functions for signal processing: hann, hamming, blackman, bartlett and kaiser windows, periodic
(the default: a window of length N + 1 without its last point, for spectral analysis) or symmetric. Computed in
float64 on the host (a window is small) and returned in the requested dtype (the default float type) on the device."""
import math

import numpy as np

from .. import dtypes as D
from .creation import tensor


def _window(name, window_length, periodic, dtype, device, requires_grad, fn):
    if not isinstance(window_length, int) or isinstance(window_length, bool) or window_length < 0:
        raise ValueError(f"{name}: window_length must be a non-negative int, got {window_length!r}")
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    if not dt.is_floating_point:
        raise TypeError(f"{name}: expected a floating point dtype, got {dt.name}")
    if window_length <= 1:
        w = np.ones(window_length)
    else:
        n = window_length + 1 if periodic else window_length
        w = fn(np.arange(n, dtype=np.float64), n - 1)[:window_length]
    return tensor(w, dtype=dt, device=device, requires_grad=requires_grad)


def hann_window(window_length, periodic=True, *, dtype=None, device=None, requires_grad=False):
    return _window("hann_window", window_length, periodic, dtype, device, requires_grad,
                   lambda k, m: 0.5 - 0.5 * np.cos(2 * math.pi * k / m))


def hamming_window(window_length, periodic=True, alpha=0.54, beta=0.46, *, dtype=None, device=None,
                   requires_grad=False):
    return _window("hamming_window", window_length, periodic, dtype, device, requires_grad,
                   lambda k, m: alpha - beta * np.cos(2 * math.pi * k / m))


def blackman_window(window_length, periodic=True, *, dtype=None, device=None, requires_grad=False):
    return _window("blackman_window", window_length, periodic, dtype, device, requires_grad,
                   lambda k, m: 0.42 - 0.5 * np.cos(2 * math.pi * k / m) + 0.08 * np.cos(4 * math.pi * k / m))


def bartlett_window(window_length, periodic=True, *, dtype=None, device=None, requires_grad=False):
    return _window("bartlett_window", window_length, periodic, dtype, device, requires_grad,
                   lambda k, m: 1 - np.abs(2 * k / m - 1))


def kaiser_window(window_length, periodic=True, beta=12.0, *, dtype=None, device=None, requires_grad=False):
    return _window("kaiser_window", window_length, periodic, dtype, device, requires_grad,
                   lambda k, m: np.i0(beta * np.sqrt(np.clip(1 - (2 * k / m - 1) ** 2, 0, None))) / np.i0(beta))
