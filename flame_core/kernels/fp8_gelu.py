"""An MLP's GELU fused into the delayed-scaling fp8 casts around it (kernels: cuda_src/fp8_gelu.cu), for an
fp8-compute fc2(gelu(fc1(x))) (flame_nn.offload.fp8_compute.Float8ComputeGeluMlp):

    gelu_quantize_delayed(h, site, approximate)        -> (q, scale): quantize_delayed(gelu(h), site) in one pass
    gelu_quantize_with_scale(h, scale, approximate)    -> (q, scale'): quantize_with_scale(gelu(h), scale)
    gelu_grad_quantize_delayed(dg, h, site, approximate) -> (q, scale): quantize_delayed(dg * gelu'(h), site)
    cat_gelu_quantize_delayed(a, h, site, approximate)  -> (q, scale): quantize_parts_delayed([a, gelu(h)], site)
    cat_gelu_quantize_with_scale(a, h, scale, approximate)   the same with a given pair (a recompute)

h: fc1's output, dg: the gradient of gelu(h) (fc2's input gradient), one float16 / bfloat16 / float32 dtype and
shape; a (rows, ca) and h (rows, ch) 2-D with h's rows any distance apart (a column block of a wider output, read in
place). The numbers are those of the composed ops -- activations.gelu_forward / gelu_backward writing h's dtype, then
fp8_tensor's quantisation of that (each value is rounded to h's dtype before its cast) -- without the intermediate
array: on cuda one kernel reads what the two read first and writes only the e4m3 operand. A site's first call (no
history yet: its own amax starts it), a cpu array or a tensor without kernels takes the composed ops.
"""
import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import activations as A
from . import fp8_tensor as T
from . import gelu_rows as _R
from . import launching as KL
from . import loader as L
from . import plans as P

_APPROX = {"tanh": 1, "none": 0}


def _check(what, approximate, *arrays):
    if approximate not in _APPROX:
        raise ValueError(f"{what}: approximate must be 'none' or 'tanh', got {approximate!r}")
    dt = arrays[0].dtype
    if any(a.dtype != dt for a in arrays) or L.dtype_name(dt) not in T._FLOATS:
        raise DTypeError(f"{what}: expects float16/bfloat16/float32 arrays of one dtype, got "
                         f"{[str(a.dtype) for a in arrays]}")
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ShapeError(f"{what}: the gradient {tuple(arrays[0].shape)} and h {tuple(arrays[1].shape)} differ")


def _on_kernel(st, *arrays):
    """The fused kernel runs: cuda arrays with kernels on, a state on their device (the site has started)."""
    return (st is not None and L.use_kernel(*arrays) and arrays[0].size and backend.is_cuda_array(st)
            and st.device.id == arrays[0].device.id)


def _launch(name, ins, st, hist, update, approximate):
    cp = backend.cupy
    ins = tuple(P.contiguous(a) for a in ins)
    n = int(ins[0].size)
    q = cp.empty(ins[0].shape, dtype=np.uint8)
    scale = cp.empty(2, dtype=np.float32)
    KL.launch(L.get_function("fp8_gelu", name, ins[0].dtype), T.delayed_grid(n), (256,),
              (*ins, q, st, scale, KL.i64(n), KL.i32(hist), KL.i32(update), KL.i32(_APPROX[approximate])))
    return q, scale


def gelu_quantize_delayed(h, site, approximate="tanh"):
    """(q, scale) of gelu(h) as fp8_tensor.quantize_delayed(gelu(h), site) gives them (site: a DelayedScaling)."""
    _check("gelu_quantize_delayed", approximate, h)
    if not _on_kernel(site.state, h):
        return T.quantize_delayed(A.gelu_forward(h, approximate), site)
    return _launch("fp8_gelu_quantize", (h,), site.state, site.history, 1, approximate)


def gelu_quantize_with_scale(h, scale, approximate="tanh"):
    """(q, scale') of gelu(h) cast with a given pair, as fp8_tensor.quantize_with_scale(gelu(h), scale)."""
    _check("gelu_quantize_with_scale", approximate, h)
    if not _on_kernel(scale, h):
        return T.quantize_with_scale(A.gelu_forward(h, approximate), scale)
    return _launch("fp8_gelu_quantize", (h,), P.contiguous(scale), 0, 0, approximate)


def gelu_grad_quantize_delayed(dg, h, site, approximate="tanh"):
    """(q, scale) of dg * gelu'(h) as fp8_tensor.quantize_delayed(gelu_backward(dg, h), site) gives them."""
    _check("gelu_grad_quantize_delayed", approximate, dg, h)
    if not _on_kernel(site.state, dg, h):
        return T.quantize_delayed(A.gelu_backward(dg, h, approximate), site)
    return _launch("fp8_gelu_bwd_quantize", (dg, h), site.state, site.history, 1, approximate)


def _check_cat(what, approximate, a, h):
    if approximate not in _APPROX:
        raise ValueError(f"{what}: approximate must be 'none' or 'tanh', got {approximate!r}")
    T._check_parts([a, h], what)


def _cat_launch(a, h, st, hist, update, approximate):
    cp = backend.cupy
    a = P.contiguous(a)
    ldh = _R.strided_rows(h)     # h's rows read in place where its columns are adjacent
    if ldh is None:
        h = P.contiguous(h)
        ldh = h.shape[1]
    rows, ca, ch = a.shape[0], a.shape[1], h.shape[1]
    q = cp.empty((rows, ca + ch), dtype=np.uint8)
    scale = cp.empty(2, dtype=np.float32)
    KL.launch(L.get_function("fp8_gelu", "fp8_cat_gelu_quantize", a.dtype), T.delayed_grid(rows * (ca + ch)), (256,),
              (a, KL.i64(ca), h, KL.i64(ldh), KL.i64(ch), KL.i64(rows), q, st, scale, KL.i32(hist), KL.i32(update),
               KL.i32(_APPROX[approximate])))
    return q, scale


def cat_gelu_quantize_delayed(a, h, site, approximate="tanh"):
    """(q, scale) of the column concatenation [a, gelu(h)] as fp8_tensor.quantize_parts_delayed([a, gelu(h)], site)
    gives them: q (rows, ca + ch) bytes, one site, one amax over both parts."""
    _check_cat("cat_gelu_quantize_delayed", approximate, a, h)
    if not _on_kernel(site.state, a, h):
        return T.quantize_parts_delayed([a, A.gelu_forward(h, approximate)], site)
    return _cat_launch(a, h, site.state, site.history, 1, approximate)


def cat_gelu_quantize_with_scale(a, h, scale, approximate="tanh"):
    """cat_gelu_quantize_delayed with a given pair, as fp8_tensor.quantize_parts_with_scale([a, gelu(h)], scale)."""
    _check_cat("cat_gelu_quantize_with_scale", approximate, a, h)
    if not _on_kernel(scale, a, h):
        return T.quantize_parts_with_scale([a, A.gelu_forward(h, approximate)], scale)
    return _cat_launch(a, h, P.contiguous(scale), 0, 0, approximate)
