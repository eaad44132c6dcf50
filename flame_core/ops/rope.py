"""apply_rope: Flux rotary embedding of q or k (B, H, L, D) by per-position 2x2 rotations
freqs (B or 1, 1, L, D/2, 2, 2) on adjacent pairs, in fp32 (flame_core.kernels.rope)."""
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..kernels import rope as K
from ..tensor import _wrap, check_same_device


class ApplyRope(Function):
    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(x if freqs.requires_grad else None, freqs)
        return _wrap(K.rope_forward(x._data, freqs._data))

    @staticmethod
    def backward(ctx, g):
        x, freqs = ctx.saved_tensors
        if state.enabled:
            return _apply(g, freqs, transpose=True), (_freqs_grad(g, x, freqs) if x is not None else None)
        dfreqs = _wrap(K.rope_freqs_backward(g._data, x._data, freqs._data)) if x is not None else None
        return _wrap(K.rope_backward(g._data, freqs._data)), dfreqs


def _apply(x, freqs, transpose):
    """The rotation with Tensor ops (differentiable again)."""
    f = freqs if freqs.ndim == 6 else freqs.reshape((1, 1) + tuple(freqs.shape))
    xf = x.float() if x.dtype.itemsize < 4 else x
    f = f.to(xf.dtype)
    x2 = xf.reshape(tuple(x.shape[:-1]) + (-1, 2))
    x0, x1 = x2[..., 0:1], x2[..., 1:2]
    out = (f[..., 0, :] * x0 + f[..., 1, :] * x1) if transpose else (f[..., :, 0] * x0 + f[..., :, 1] * x1)
    return out.reshape(tuple(x.shape)).to(x.dtype)


def _freqs_grad(g, x, freqs):
    g2 = g.reshape(tuple(x.shape[:-1]) + (-1, 2, 1))
    x2 = x.reshape(tuple(x.shape[:-1]) + (-1, 1, 2))
    d = (g2 * x2).sum(1, keepdim=True)
    if freqs.ndim == 4 or freqs.shape[0] == 1:
        d = d.sum(0, keepdim=True)
    return d.reshape(tuple(freqs.shape)).to(freqs.dtype)


def apply_rope(x, freqs):
    """Rotate adjacent pairs of x (B, H, L, D):
    out[2j] = f00 x[2j] + f01 x[2j+1], out[2j+1] = f10 x[2j] + f11 x[2j+1] with f = freqs[..., l, j, :, :]."""
    check_same_device("apply_rope", x, freqs)
    return ApplyRope.apply(x, freqs)
