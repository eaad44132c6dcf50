"""GEGLU of rows holding [a | gate] (kernel: cuda_src/geglu.cu), one pass each way.

    geglu_forward(x, approximate)        x (..., 2C) -> a * gelu(gate)                        (..., C)
    gate_first=True (both directions): rows hold [gate | a] (T5's gelu(wi_0 x) * wi_1 x over [wi_0 | wi_1]), the
    gradient in that order too
    geglu_backward(dy, x, approximate)   -> dx (..., 2C): [dy * gelu(gate) | dy * a * gelu'(gate)]
    geglu_backward(dy, x, approximate, inplace=True)   the same written over x (x must be contiguous): for an x
                                                      that dies with this backward, no second (..., 2C) buffer

SDXL's feed-forward (diffusers' GEGLU) splits its projection into the two halves; done with separate ops, the
forward keeps GELU(gate) for the product's backward and the backward holds both halves' gradients before joining
them: at the 64x64 level of a 1024^2 step that is 60 MB more at the step's peak. The kernels store neither. The
reference (and non-CUDA path) computes in float32 (float64 for float64) and rounds once, as the kernels do.
"""
from .. import backend
from . import launching as KL
from . import loader as L
from . import plans as P
from .activations import _approx_flag, _gelu_grad_ref, _gelu_ref


def _halves(x, what):
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"{what}: the last dimension holds [a | gate] and must be even, got shape {tuple(x.shape)}")
    return x.shape[-1] // 2


def _parts(x, c, gate_first):
    """(a, gate) halves of the rows of x."""
    lo, hi = x[..., :c], x[..., c:]
    return (hi, lo) if gate_first else (lo, hi)


def geglu_reference(x, approximate="none", gate_first=False):
    xp = backend.xp_of(x)
    c = _halves(x, "geglu")
    cd = L.compute_dtype(x.dtype)
    a, g = (h.astype(cd) for h in _parts(x, c, gate_first))
    return xp.ascontiguousarray((a * _gelu_ref(g, approximate)).astype(x.dtype))


def geglu_grad_reference(dy, x, approximate="none", gate_first=False):
    xp = backend.xp_of(x)
    c = _halves(x, "geglu backward")
    cd = L.compute_dtype(x.dtype)
    (a, g), d = (h.astype(cd) for h in _parts(x, c, gate_first)), dy.astype(cd)
    da, dg = d * _gelu_ref(g, approximate), _gelu_grad_ref(d * a, g, approximate)
    return xp.concatenate([dg, da] if gate_first else [da, dg], axis=-1).astype(x.dtype)


def geglu_forward(x, approximate="none", gate_first=False):
    flag = _approx_flag(approximate) | (2 if gate_first else 0)
    c = _halves(x, "geglu")
    if not (L.use_kernel(x) and x.size):
        return geglu_reference(x, approximate, gate_first)
    x = P.contiguous(x)
    rows = x.size // (2 * c)
    y = backend.xp_of(x).empty(x.shape[:-1] + (c,), dtype=x.dtype)
    grid, block = P.rows_grid(rows)
    KL.launch(L.get_function("geglu", "geglu_fwd", x.dtype), grid, block,
              (x, y, KL.i64(rows), KL.i32(c), KL.i32(flag)))
    return y


def geglu_backward(dy, x, approximate="none", inplace=False, gate_first=False):
    flag = _approx_flag(approximate) | (2 if gate_first else 0)
    c = _halves(x, "geglu backward")
    if tuple(dy.shape) != tuple(x.shape[:-1]) + (c,):
        raise ValueError(f"geglu_backward: gradient shape {tuple(dy.shape)} does not match input {tuple(x.shape)} "
                         f"(expected {tuple(x.shape[:-1]) + (c,)})")
    if inplace and not x.flags.c_contiguous:
        raise ValueError("geglu_backward(inplace=True) needs a contiguous x")
    if not (L.use_kernel(x) and x.size):
        dx = geglu_grad_reference(dy, x, approximate, gate_first)
        if inplace:
            x[...] = dx
            return x
        return dx
    if not inplace:
        x = P.contiguous(x)
    dy = P.contiguous(dy.astype(x.dtype, copy=False))
    rows = x.size // (2 * c)
    dx = x if inplace else backend.xp_of(x).empty(x.shape, dtype=x.dtype)
    grid, block = P.rows_grid(rows)
    KL.launch(L.get_function("geglu", "geglu_bwd", x.dtype), grid, block,
              (x, dy, dx, KL.i64(rows), KL.i32(c), KL.i32(flag)))
    return dx
