"""Rotary position embedding in the Flux layout on arrays (kernel: cuda_src/rope.cu).

x: (B, H, L, D) queries or keys; freqs: the per-position 2x2 rotation matrices, (B or 1, 1, L, D/2, 2, 2) as Flux's
`EmbedND` returns them ([[cos, -sin], [sin, cos]]), or (L, D/2, 2, 2). Adjacent pairs (x[2j], x[2j+1]) rotate:
    out[2j] = f[j,0,0] x[2j] + f[j,0,1] x[2j+1];   out[2j+1] = f[j,1,0] x[2j] + f[j,1,1] x[2j+1]
in fp32 (float64 for float64 x on the reference path), cast back to x's dtype.

    rope_forward(x, freqs)           -> out
    rope_backward(dout, freqs)       -> dx   (the transposed rotation)
    rope_freqs_backward(dout, x, freqs) -> dfreqs (reference code on any device; positions are rarely learned)
"""
import numpy as np

from .. import backend
from ..errors import ShapeError
from . import launching as KL
from . import loader as L
from . import plans as P


def _check(x, freqs):
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ShapeError(f"rope: x must be (B, H, L, D) with even D, got shape {tuple(x.shape)}")
    b, _, l, d = x.shape
    fs = tuple(freqs.shape)
    tail_ok = fs[-4:] == (l, d // 2, 2, 2)
    lead = fs[:-4]
    lead_ok = lead == () or (len(lead) == 2 and lead[0] in (1, b) and lead[1] == 1)
    if not (tail_ok and lead_ok and freqs.ndim in (4, 6)):
        raise ShapeError(f"rope: freqs of shape {fs} do not fit x of shape {tuple(x.shape)}: expected "
                         f"({b} or 1, 1, {l}, {d // 2}, 2, 2) or ({l}, {d // 2}, 2, 2)")
    return (fs[0] if freqs.ndim == 6 else 1)


def _f6(freqs):
    return freqs if freqs.ndim == 6 else freqs[None, None]


# ----------------------------------------------------------------------------- references
def _rope_ref(x, freqs, transpose):
    """Each pair's two outputs written into one new array through its strided even / odd views (no (.., D/2, 2, 2)
    temporaries): the same products and sums, in the same order, as the rotation's matrix form."""
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    f = _f6(freqs).astype(cd, copy=False)                        # (Bf, 1, L, D/2, 2, 2)
    a = x.astype(cd, copy=False)
    xe, xo = a[..., 0::2], a[..., 1::2]
    if transpose:  # out_k = sum_i f[i, k] x_i
        f00, f01, f10, f11 = f[..., 0, 0], f[..., 1, 0], f[..., 0, 1], f[..., 1, 1]
    else:          # out_i = sum_k f[i, k] x_k
        f00, f01, f10, f11 = f[..., 0, 0], f[..., 0, 1], f[..., 1, 0], f[..., 1, 1]
    out = xp.empty(a.shape, cd)
    oe, oo = out[..., 0::2], out[..., 1::2]
    xp.multiply(f00, xe, out=oe)
    oe += f01 * xo
    xp.multiply(f10, xe, out=oo)
    oo += f11 * xo
    return out.astype(x.dtype, copy=False)


def rope_freqs_backward(dout, x, freqs):
    """d freqs[..., i, k] = sum over the broadcast axes of dout_i * x_k, in freqs' shape and dtype."""
    _check(x, freqs)
    cd = L.compute_dtype(x.dtype)
    g2 = dout.astype(cd).reshape(*x.shape[:-1], -1, 2)
    x2 = x.astype(cd).reshape(*x.shape[:-1], -1, 2)
    d = g2[..., :, None] * x2[..., None, :]                      # (B, H, L, D/2, 2, 2)
    f6 = _f6(freqs)
    d = d.sum(axis=1, keepdims=True)
    if f6.shape[0] == 1:
        d = d.sum(axis=0, keepdims=True)
    return d.reshape(freqs.shape).astype(freqs.dtype)


# ----------------------------------------------------------------------------- kernels
def _rope_kernel(x, freqs, transpose):
    fb = _check(x, freqs)
    b, h, l, d = x.shape
    x = P.contiguous(x)
    f = P.contiguous(freqs.astype(np.float32, copy=False))
    out = backend.xp_of(x).empty_like(x)
    grid, block = P.elementwise_grid(x.size, x.dtype)
    KL.launch(L.get_function("rope", "rope_apply", x.dtype), grid, block,
              (x, f, out, KL.i64(x.size), KL.i32(h * l), KL.i32(l), KL.i32(d), KL.i32(fb > 1), KL.i32(transpose)))
    return out


# ----------------------------------------------------------------------------- API
def rope_forward(x, freqs):
    _check(x, freqs)
    if L.use_kernel(x) and x.size:
        return _rope_kernel(x, freqs, 0)
    return _rope_ref(x, freqs, False)


def rope_backward(dout, freqs):
    _check(dout, freqs)
    if L.use_kernel(dout) and dout.size:
        return _rope_kernel(dout, freqs, 1)
    return _rope_ref(dout, freqs, True)
