"""layer_norm, rms_norm, add_layer_norm, add_rms_norm, joint_rms_norm, group_norm, group_norm_silu: differentiable,
fused (flame_core.kernels.norms, .add_layer_norm, .joint_rms_norm, .groupnorm) on every device.

Each op records one node; its backward calls the fused array backward. Under `create_graph=True` the backward is
written with Tensor ops instead (slower, but twice differentiable).
"""
import ml_dtypes

from .. import memory_formats as MF
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..errors import ShapeError, fmt_shape
from ..kernels import add_layer_norm as AK
from ..kernels import groupnorm as GN
from ..kernels import joint_rms_norm as JK
from ..kernels import norms as K
from ..tensor import Tensor, _wrap, check_same_device


def _normalized_dims(x, normalized_shape, op):
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(int(s) for s in normalized_shape)
    if not ns or tuple(x.shape[x.ndim - len(ns):]) != ns or len(ns) > x.ndim:
        raise ShapeError(f"{op}: normalized_shape {ns} does not match the trailing dims of input shape "
                         f"{tuple(x.shape)}")
    return ns


def _flat(p):
    if p is None:
        return None
    a = p._data
    return a if a.ndim == 1 else a.reshape(-1)


def _composed_norm_backward(g, x, weight, bias, n, eps, rms):
    """d(out)/d(inputs) of the normalisation written with Tensor ops (differentiable again)."""
    dims = tuple(range(x.ndim - n, x.ndim))
    red = tuple(range(x.ndim - n))
    xf = x.float() if x.dtype.itemsize < 4 else x
    gf = g.to(xf.dtype)
    xc = xf if rms else xf - xf.mean(dims, keepdim=True)
    rstd = ((xc * xc).mean(dims, keepdim=True) + eps).rsqrt()
    xh = xc * rstd
    gw = gf * weight.to(xf.dtype) if weight is not None else gf
    dot = (gw * xh).mean(dims, keepdim=True)
    dx = rstd * (gw - xh * dot) if rms else rstd * (gw - gw.mean(dims, keepdim=True) - xh * dot)
    dw = (gf * xh).sum(red).to(weight.dtype) if weight is not None else None
    db = gf.sum(red).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw, db


def _residual(ctx, a, shape2):
    """x's gradient from its other consumers (a pre-norm block's residual path), when the engine holds one in x's
    layout: the kernel adds it into dx in the same pass instead of the engine adding the two afterwards (a full read
    and write of an activation-sized gradient per norm)."""
    if not ctx.needs_input_grad[0]:
        return None
    p = ctx.pending_grad(0)
    if p is None:
        return None
    pd = p._data
    if type(pd) is not type(a) or pd.shape != a.shape or pd.dtype != a.dtype or not pd.flags.c_contiguous:
        return None
    return ctx.take_pending_grad(0)._data.reshape(shape2)


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, rms):
        a = x._data
        a2 = a.reshape(a.shape[:a.ndim - n] + (-1,)) if n != 1 else a
        stats = any(ctx.needs_input_grad[:3])   # no backward to come: no statistics written or kept
        if rms:
            (y, rstd), mean = K.rms_norm_forward(a2, _flat(weight), eps, stats), None
        else:
            y, mean, rstd = K.layer_norm_forward(a2, _flat(weight), _flat(bias), eps, stats)
        ctx.save_for_backward(x, weight, bias)
        ctx.mean, ctx.rstd, ctx.n, ctx.eps, ctx.rms = mean, rstd, n, eps, rms
        return _wrap(y if n == 1 else y.reshape(a.shape))

    @staticmethod
    def backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        n, rms = ctx.n, ctx.rms
        if state.enabled:
            dx, dw, db = _composed_norm_backward(g, x, weight, bias, n, ctx.eps, rms)
        else:
            a = x._data
            lead = a.shape[:a.ndim - n]
            a2, g2 = a.reshape(lead + (-1,)), g._data.reshape(lead + (-1,))
            w = _flat(weight)
            want_w = weight is not None and ctx.needs_input_grad[1]
            res = _residual(ctx, a, a2.shape)
            if rms:
                dxa, dwa = K.rms_norm_backward(g2, a2, w, ctx.rstd, weight_grad=want_w, residual=res)
                dba = None
            else:
                want_b = bias is not None and ctx.needs_input_grad[2]
                dxa, dwa, dba = K.layer_norm_backward(g2, a2, w, ctx.mean, ctx.rstd, _flat(bias) if want_b else None,
                                                      weight_grad=want_w, residual=res)
            dx = _wrap(dxa.reshape(a.shape))
            dw = _wrap(dwa.reshape(weight.shape)) if dwa is not None else None
            db = _wrap(dba.reshape(bias.shape)) if dba is not None else None
        return dx, dw, db, None, None, None


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing `normalized_shape` dims (fp32 statistics), optional elementwise affine."""
    if (type(normalized_shape) is tuple and len(normalized_shape) == 1 and isinstance(input, Tensor)
            and isinstance(weight, Tensor) and isinstance(bias, Tensor)):
        # the common case's checks on the arrays (flame_nn.LayerNorm: one dim, weight and bias): see below
        xd, wd, bd = input._data, weight._data, bias._data
        if (xd.shape[-1:] == normalized_shape and wd.shape == normalized_shape and bd.shape == normalized_shape
                and type(wd) is type(xd) and type(bd) is type(xd) and type(normalized_shape[0]) is int):
            return LayerNorm.apply(input, weight, bias, 1, float(eps), False)
    ns = _normalized_dims(input, normalized_shape, "layer_norm")
    check_same_device("layer_norm", input, weight, bias)
    for p, what in ((weight, "weight"), (bias, "bias")):
        if p is not None and tuple(p.shape) != ns:
            raise ShapeError(f"layer_norm: {what} shape {tuple(p.shape)} differs from normalized_shape {ns}")
    return LayerNorm.apply(input, weight, bias, len(ns), float(eps), False)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """RMSNorm: x * rsqrt(mean(x^2) + eps) * weight over the trailing dims, statistics in fp32.
    eps=None uses the machine epsilon of the input dtype (as torch.nn.functional.rms_norm)."""
    ns = _normalized_dims(input, normalized_shape, "rms_norm")
    check_same_device("rms_norm", input, weight)
    if weight is not None and tuple(weight.shape) != ns:
        raise ShapeError(f"rms_norm: weight shape {tuple(weight.shape)} differs from normalized_shape {ns}")
    if eps is None:
        eps = float(ml_dtypes.finfo(input.dtype.np).eps)
    return LayerNorm.apply(input, weight, None, len(ns), float(eps), True)


class AddLayerNorm(Function):
    """(s, y) = (x + r, norm(x + r) w + b): the residual add and the norm after it in one kernel each way; s's
    gradient and the norm's come back as one (x's and r's alike)."""

    @staticmethod
    def forward(ctx, x, r, weight, bias, eps, rms):
        s, y, mean, rstd = AK.add_layer_norm_forward(x._data, r._data, _flat(weight), _flat(bias), eps, rms,
                                                     stats=any(ctx.needs_input_grad[:4]))
        s = _wrap(s)
        ctx.save_for_backward(s, weight, bias)
        ctx.mean, ctx.rstd, ctx.eps, ctx.rms = mean, rstd, eps, rms
        return s, _wrap(y)

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if state.enabled:  # create_graph: the normalisation rule in Tensor ops
            dx, dw, db = _composed_norm_backward(dy, s, weight, bias, 1, ctx.eps, ctx.rms)
            dsum = dx + ds if ds is not None else dx
        else:
            want_w, want_b = weight is not None and needs[2], bias is not None and needs[3]
            dsa, dwa, dba = AK.add_layer_norm_backward(dy._data, None if ds is None else ds._data, s._data,
                                                       _flat(weight), ctx.mean, ctx.rstd, ctx.rms, want_w, want_b)
            dsum = _wrap(dsa)
            dw = _wrap(dwa.reshape(weight.shape)) if dwa is not None else None
            db = _wrap(dba.astype(bias.dtype.np, copy=False).reshape(bias.shape)) if dba is not None else None
        return (dsum if needs[0] else None, dsum if needs[1] else None, dw if needs[2] else None,
                db if needs[3] else None, None, None)


def _add_norm(op, input, residual, weight, bias, eps, rms):
    check_same_device(op, input, residual, weight, bias)
    if tuple(input.shape) != tuple(residual.shape):
        raise ShapeError(f"{op}: input {fmt_shape(input.shape)} and residual {fmt_shape(residual.shape)} must have "
                         f"one shape (no broadcasting)")
    if input.dtype != residual.dtype:  # as the add would: both to the promoted dtype
        from ..dtypes import promote_types
        dt = promote_types(input.dtype, residual.dtype)
        input, residual = input.to(dt), residual.to(dt)
    return AddLayerNorm.apply(input, residual, weight, bias, float(eps), rms)


def add_layer_norm(input, residual, weight=None, bias=None, eps=1e-5):
    """(s, y) = (input + residual, layer_norm(s, (D,), weight, bias, eps)) over the last dim D in one op: a pre-norm
    block's `x = x + f(x); h = norm(x)` as `x, h = add_layer_norm(x, f(x), norm.weight, norm.bias, norm.eps)`.
    y normalises s as stored (rounded to its dtype): the same numbers as the add and layer_norm, up to the reduction
    order."""
    return _add_norm("add_layer_norm", input, residual, weight, bias, eps, False)


def add_rms_norm(input, residual, weight=None, eps=1e-6):
    """(s, y) = (input + residual, rms_norm(s, (D,), weight, eps)) over the last dim in one op (add_layer_norm's
    RMS form: T5's and Qwen's pre-norm blocks)."""
    return _add_norm("add_rms_norm", input, residual, weight, None, eps, True)


class JointRMSNorm(Function):
    """cat([rms_norm(x_p) w_p], dim=1) of one or two (B, L_p, H, D) parts, rotated by per-row RoPE tables when given:
    one kernel each way reading the parts in place; the gains and the tables are constants here (joint_rms_norm takes
    the composed ops when one needs a gradient)."""

    @staticmethod
    def forward(ctx, x0, x1, w0, w1, eps, rope=None):
        xs = [x0] if x1 is None else [x0, x1]
        ws = [w0] if x1 is None else [w0, w1]
        y = JK.joint_rms_norm_forward([x._data for x in xs], [_flat(w) for w in ws], eps,
                                      None if rope is None else rope._data)
        ctx.save_for_backward(x0, x1, w0, w1, rope)
        ctx.eps = eps
        return _wrap(y)

    @staticmethod
    def backward(ctx, g):
        x0, x1, w0, w1, rope = ctx.saved_tensors
        xs, ws = ([x0], [w0]) if x1 is None else ([x0, x1], [w0, w1])
        if state.enabled:  # create_graph: the normalisation rule in Tensor ops, part by part
            if rope is not None:
                g = _rope_rows(g, rope.detach(), transpose=True)
            dxs, l0 = [], 0
            for x, w in zip(xs, ws):
                gp = g[:, l0:l0 + x.shape[1]]
                l0 += x.shape[1]
                dxs.append(_composed_norm_backward(gp, x, w.detach() if w is not None else None, None, 1, ctx.eps,
                                                   True)[0])
        else:
            dxs = [_wrap(d) for d in JK.joint_rms_norm_backward(g._data, [x._data for x in xs],
                                                                [_flat(w) for w in ws], ctx.eps,
                                                                None if rope is None else rope._data)]
        return dxs[0], dxs[1] if x1 is not None else None, None, None, None, None


def _rope_rows(y, rope, transpose=False):
    """y (B, L, H, D) rotated by per-row tables rope (B * L, 1, 1, D / 2, 2, 2) (or (B * L, D / 2, 2, 2)) with Tensor
    ops (differentiable again; transpose: the transposed matrices)."""
    from .rope import _apply, apply_rope
    B, L, H, D = y.shape
    f = rope.reshape(B * L, 1, 1, D // 2, 2, 2)
    x = y.reshape(B * L, H, 1, D)
    return (_apply(x, f, transpose=True) if transpose else apply_rope(x, f)).reshape(B, L, H, D)


def joint_rms_norm(inputs, weights=None, eps=1e-6, rope=None):
    """cat([rms_norm(x, (D,), w, eps) for x, w in zip(inputs, weights)], dim=1): one or two (B, L_p, H, D) parts (the
    q or k of each stream of a joint attention, e.g. strided views of a qkv projection) normalised over D with a (D,)
    gain each (or None) and written into one contiguous (B, L0 + L1, H, D) tensor, part 0 first -- one kernel each
    way instead of copies of the views, the norms and a concatenation. rope: Flux's rotary embedding of the result,
    as one table of D / 2 2x2 rotations per joint token row ((B * (L0 + L1), 1, 1, D / 2, 2, 2), float32:
    flame_models.bfl.ops.rope_rows), applied inside the same kernels (before the one rounding; the backward rotates
    the gradient back first) -- `apply_rope` of the result, without a pass of its own. The gains and the tables get
    no gradient on that path: when one requires grad (under grad mode) the ops are composed instead."""
    inputs = list(inputs)
    weights = [None] * len(inputs) if weights is None else list(weights)
    if len(inputs) not in (1, 2) or len(weights) != len(inputs):
        raise ValueError(f"joint_rms_norm: one or two inputs and as many weights (or None), got {len(inputs)} inputs "
                         f"and {len(weights)} weights")
    check_same_device("joint_rms_norm", *inputs, *weights, *(() if rope is None else (rope,)))
    if rope is not None:
        JK._check_rope(rope._data, [x._data for x in inputs])
    if state.enabled and any(t is not None and t.requires_grad for t in weights + [rope]):
        JK._check([x._data for x in inputs], [None if w is None else w._data for w in weights])  # (the kernels' own)
        from .shape import cat
        parts = [LayerNorm.apply(x, w, None, 1, float(eps), True) for x, w in zip(inputs, weights)]
        y = parts[0] if len(parts) == 1 else cat(parts, dim=1)
        return y if rope is None else _rope_rows(y, rope)
    x1, w1 = (inputs[1], weights[1]) if len(inputs) == 2 else (None, None)
    return JointRMSNorm.apply(inputs[0], x1, weights[0], w1, float(eps), rope)


def _composed_silu_grad(g, x, num_groups, weight, bias, eps):
    """dy of silu(z) -> dz, z = group_norm(x) w + b recomputed with Tensor ops (differentiable again)."""
    n, c = x.shape[:2]
    wshape = (1, c) + (1,) * (x.ndim - 2)
    xg = (x.float() if x.dtype.itemsize < 4 else x).reshape(n, num_groups, -1)
    xc = xg - xg.mean(-1, keepdim=True)
    z = (xc * ((xc * xc).mean(-1, keepdim=True) + eps).rsqrt()).reshape(x.shape)
    if weight is not None:
        z = z * weight.to(z.dtype).reshape(wshape)
    if bias is not None:
        z = z + bias.to(z.dtype).reshape(wshape)
    s = z.sigmoid()
    return g.to(z.dtype) * (s * (1 + z * (1 - s)))


class GroupNorm(Function):
    """y = group_norm(x) w + b, or with act="silu" silu of that (the activation fused into the same kernels)."""

    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, act=None, channels_last=False):
        y, mean, rstd = GN.group_norm_forward(x._data, num_groups, _flat(weight), _flat(bias), eps, act,
                                              channels_last)
        ctx.save_for_backward(x, weight, bias)
        ctx.mean, ctx.rstd, ctx.g, ctx.eps, ctx.act = mean, rstd, num_groups, eps, act
        return _wrap(y)

    @staticmethod
    def backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        act = ctx.act
        if state.enabled:  # y = xhat * w_c + b_c: fold w into the gradient, then the plain normalisation rule
            n, c = x.shape[:2]
            wshape = (1, c) + (1,) * (x.ndim - 2)
            if act is not None:
                g = _composed_silu_grad(g, x, ctx.g, weight, bias, ctx.eps)
            gw = g * weight.reshape(wshape) if weight is not None else g
            dxg, _, _ = _composed_norm_backward(gw.reshape(n, ctx.g, -1), x.reshape(n, ctx.g, -1), None, None, 1,
                                                ctx.eps, False)
            red = (0,) + tuple(range(2, x.ndim))
            dw = db = None
            if weight is not None:
                xg = (x.float() if x.dtype.itemsize < 4 else x).reshape(n, ctx.g, -1)
                xc = xg - xg.mean(-1, keepdim=True)
                xh = (xc * ((xc * xc).mean(-1, keepdim=True) + ctx.eps).rsqrt()).reshape(x.shape)
                dw = (g.to(xh.dtype) * xh).sum(red).to(weight.dtype)
            if bias is not None:
                db = g.sum(red).to(bias.dtype)
            return dxg.reshape(x.shape), None, dw, db, None, None, None
        want_b = bias is not None and ctx.needs_input_grad[3]
        # with the activation, bias enters z (the kernels then return its gradient too)
        dxa, dwa, dba = GN.group_norm_backward(g._data, x._data, ctx.g, _flat(weight), ctx.mean, ctx.rstd,
                                              _flat(bias) if want_b or act is not None else None, act)
        dba = dba if want_b else None
        return (_wrap(dxa), None, _wrap(dwa) if dwa is not None else None,
                _wrap(dba) if dba is not None else None, None, None, None)


def _channels_last_out(input, memory_format, op):
    """Whether a norm writes its output channels-last: memory_format flame.channels_last (4-D input), or
    flame.preserve_format (the default) with a channels-last input."""
    fmt = MF.check(memory_format, op)
    if fmt is MF.channels_last and input.ndim != 4:
        raise ShapeError(f"{op}: memory_format=flame.channels_last needs a 4-D (N, C, H, W) input, got "
                         f"{fmt_shape(input.shape)}")
    return fmt is MF.channels_last or (fmt is MF.preserve_format and input.ndim == 4
                                       and MF.suggested(input._data) is MF.channels_last)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *, memory_format=MF.preserve_format):
    """GroupNorm over (N, C, *): statistics per (sample, group of C/num_groups channels), per-channel affine.
    memory_format (a FLAME extension): the output's memory layout - flame.preserve_format (the input's: channels-last
    stays so), flame.contiguous_format, or flame.channels_last, written by the same pass (a channels-last conv
    then reads it without a copy)."""
    check_same_device("group_norm", input, weight, bias)
    cl = _channels_last_out(input, memory_format, "group_norm")
    return GroupNorm.apply(input, int(num_groups), weight, bias, float(eps), None, cl)


def group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-5, *, memory_format=MF.preserve_format):
    """silu(group_norm(input, num_groups, weight, bias, eps)) in one pass forward and backward: the normalised
    pre-activation is kept in fp32 inside the kernel (never rounded to the input dtype nor stored). memory_format as
    group_norm's."""
    check_same_device("group_norm_silu", input, weight, bias)
    cl = _channels_last_out(input, memory_format, "group_norm_silu")
    return GroupNorm.apply(input, int(num_groups), weight, bias, float(eps), "silu", cl)
