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
    b = like.shape[0] if like.ndim > 1 else 1
    s = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)        # (B, H)
    if b == 1 and s.shape[0] != 1:
        s = s.sum(0, keepdim=True)
    return s.reshape(like.shape).to(like.dtype)


class Modulate(Function):
    @staticmethod
    def forward(ctx, x, shift, scale):
        nx, nshift, nscale = ctx.needs_input_grad
        ctx.save_for_backward(x if nscale else None, shift, scale)  # x only for dscale (frozen adaLN: not kept)
        return _wrap(K.modulate_forward(x._data, shift._data, scale._data))

    @staticmethod
    def backward(ctx, g):
        x, shift, scale = ctx.saved_tensors
        nx, nshift, nscale = ctx.needs_input_grad
        if state.enabled:
            dx = g * (1 + _bcast(scale, g)) if nx else None
            dscale = _sum_like(g * x, scale) if nscale else None
            return dx, (_sum_like(g, shift) if nshift else None), dscale
        if x is None:  # a frozen scale (no x kept): the input gradient alone, one fused pass
            return (_wrap(K.broadcast_scale(g._data, scale._data, 1.0)) if nx else None), \
                (_sum_like(g, shift) if nshift else None), None
        dx, dshift, dscale = K.modulate_backward(g._data, x._data, shift._data, scale._data)
        return _wrap(dx), _wrap(dshift), _wrap(dscale)


def modulate(x, shift, scale):
    check_same_device("modulate", x, shift, scale)
    return Modulate.apply(x, shift, scale)


class GatedResidual(Function):
    @staticmethod
    def forward(ctx, x, gate, y):
        _, ngate, _ = ctx.needs_input_grad
        ctx.save_for_backward(gate, y if ngate else None)  # y only for dgate (a frozen gate keeps no y)
        return _wrap(K.gated_residual_forward(x._data, gate._data, y._data))

    @staticmethod
    def backward(ctx, g):
        gate, y = ctx.saved_tensors
        nx, ngate, ny = ctx.needs_input_grad
        if state.enabled:
            return (g if nx else None), (_sum_like(g * y, gate) if ngate else None), \
                (g * _bcast(gate, g) if ny else None)
        if y is None:  # a frozen gate (no y kept): dy = g * gate in one fused pass
            return (g if nx else None), None, (_wrap(K.broadcast_scale(g._data, gate._data, 0.0)) if ny else None)
        _, dgate, dy = K.gated_residual_backward(g._data, gate._data, y._data)
        return g, _wrap(dgate), _wrap(dy)


def gated_residual(x, gate, y):
    check_same_device("gated_residual", x, gate, y)
    return GatedResidual.apply(x, gate, y)
