"""adaLN modulation and gated residual (Flux / SD3 / DiT blocks), fused (flame_core.kernels.modulate).

    modulate(x, shift, scale)   = x * (1 + scale) + shift      x (B, L, H); shift, scale (B, 1, H) / (B, H)
    gated_residual(x, gate, y)  = x + gate * y                  gate (B, 1, H) / (B, H)
"""
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..kernels import modulate as K
from ..tensor import _wrap, check_same_device


def _bcast(m, x):
    """The modulation vector viewed so that it broadcasts over x (B, ..., H) along the middle dims."""
    if m.ndim == 2 and x.ndim > 2:
        return m.reshape((m.shape[0],) + (1,) * (x.ndim - 2) + (m.shape[1],))
    return m


def _sum_like(g, like):
    """Reduce a gradient of x's shape to the modulation vector's shape (sums over L, and over B if broadcast)."""
    b, h = like.shape[0] if like.ndim > 1 else 1, like.shape[-1]
    s = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)        # (B, H)
    if b == 1 and s.shape[0] != 1:
        s = s.sum(0, keepdim=True)
    return s.reshape(like.shape).to(like.dtype)


class Modulate(Function):
    @staticmethod
    def forward(ctx, x, shift, scale):
        ctx.save_for_backward(x, shift, scale)
        return _wrap(K.modulate_forward(x._data, shift._data, scale._data))

    @staticmethod
    def backward(ctx, g):
        x, shift, scale = ctx.saved_tensors
        if state.enabled:
            return g * (1 + _bcast(scale, x)), _sum_like(g, shift), _sum_like(g * x, scale)
        dx, dshift, dscale = K.modulate_backward(g._data, x._data, shift._data, scale._data)
        return _wrap(dx), _wrap(dshift), _wrap(dscale)


def modulate(x, shift, scale):
    check_same_device("modulate", x, shift, scale)
    return Modulate.apply(x, shift, scale)


class GatedResidual(Function):
    @staticmethod
    def forward(ctx, x, gate, y):
        ctx.save_for_backward(gate, y)
        return _wrap(K.gated_residual_forward(x._data, gate._data, y._data))

    @staticmethod
    def backward(ctx, g):
        gate, y = ctx.saved_tensors
        if state.enabled:
            return g, _sum_like(g * y, gate), g * _bcast(gate, y)
        _, dgate, dy = K.gated_residual_backward(g._data, gate._data, y._data)
        return g, _wrap(dgate), _wrap(dy)


def gated_residual(x, gate, y):
    check_same_device("gated_residual", x, gate, y)
    return GatedResidual.apply(x, gate, y)
