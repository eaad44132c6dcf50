"""matmul (cuBLAS through CuPy on cuda), bmm, outer, einsum (torch.linalg is the package flame_core.linalg)."""
import numpy as np

from .. import backend
from .. import dtypes as D
from .. import threads as _threads
from ..amp import autocast_mode as _amp  # autocast hook (flame_core.amp): one line per op, a flag test when off
from ..autograd.function import Function
from ..autograd.grad_mode import is_grad_enabled
from ..errors import DTypeError, ShapeError, fmt_shape
from ..kernels import gemm as _cublas
from ..kernels import gemm_small as _small
from ..tensor import Tensor, _wrap, check_same_device

_HALF = (np.dtype(np.float16), D.bfloat16.np)
_BF16 = np.dtype(D.bfloat16.np)


def mm_arrays(a, b):
    """a @ b of two 2-D arrays (NumPy or CuPy, e.g. tensors' `.array`), outside autograd: cuBLAS directly on cuda
    (flame_core.kernels.gemm.mm); on NumPy half types are multiplied in float32 (no half BLAS) and rounded back.
    Public for layers that compute on arrays inside their own Function (flame_nn's fp8 Linear)."""
    if backend.xp_of(a) is np:
        if a.dtype in _HALF:
            return _threads.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
        return _threads.matmul(a, b)
    if a.ndim == 2 and b.ndim == 2:   # a small product: FLAME's own kernel (no cuBLAS call's host cost)
        r = _small.matmul(a, b)
        if r is not None:
            return r
    return _cublas.mm(a, b)


class Matmul(Function):
    @staticmethod
    def forward(ctx, a, b):
        xa, xb = a._data, b._data
        na, nb = ctx.needs_input_grad
        ctx.save_for_backward(a if nb else None, b if na else None)  # dA needs B, dB needs A (as PyTorch)
        ctx.shapes = (xa.shape, xb.shape)   # the arrays' tuples (Tensor.shape builds a Size per read)
        return _wrap(mm_arrays(xa, xb))

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        a, b = ctx.saved_tensors
        na, nb = ctx.needs_input_grad
        sa, sb = ctx.shapes
        if not is_grad_enabled() and len(sa) >= 2 and len(sb) >= 2 and (len(sb) == 2 or sa[:-2] == sb[:-2]):
            # the usual backward (no create_graph) of x @ W and of equal-batch products: on the arrays (no Tensor
            # op, no node, no reshape Function), as Linear's
            return _matmul_grads(g._data, a, b, sa, sb, na, nb)
        if len(sa) == 1 and len(sb) == 1:
            return (g * b if na else None), (g * a if nb else None)
        ga = gb = None
        if len(sb) == 2 and len(sa) > 2:  # (*, K) @ (K, N): one 2-D GEMM each, no batched product + reduction
            K, N = sb
            if na:
                ga = (g.reshape(-1, N) @ b.mT).reshape(sa)
            if nb:
                gb = a.reshape(-1, K).mT @ g.reshape(-1, N)
            return ga, gb
        g2 = g
        if len(sa) == 1:
            g2 = g2.unsqueeze(-2)
        if len(sb) == 1:
            g2 = g2.unsqueeze(-1)
        if na:
            b2 = b.unsqueeze(-1) if len(sb) == 1 else b
            a2_shape = (1,) + tuple(sa) if len(sa) == 1 else tuple(sa)
            ga = sum_to(matmul(g2, b2.mT), a2_shape).reshape(sa)
        if nb:
            a2 = a.unsqueeze(0) if len(sa) == 1 else a
            b2_shape = tuple(sb) + (1,) if len(sb) == 1 else tuple(sb)
            gb = sum_to(matmul(a2.mT, g2), b2_shape).reshape(sb)
        return ga, gb


def _matmul_grads(gd, a, b, sa, sb, na, nb):
    """Matmul's (dA, dB) on arrays for A (*, M, K) @ B (K, N) (one 2-D GEMM each over the leading dimensions) and
    for A (*, M, K) @ B (*, K, N) with equal batch shapes (batched GEMMs, nothing to reduce)."""
    ga = gb = None
    if len(sb) == 2:
        K, N = sb
        g2 = gd.reshape(-1, N)
        if na:
            ga = _wrap(mm_arrays(g2, b._data.T).reshape(sa))
        if nb:
            gb = _wrap(mm_arrays(a._data.reshape(-1, K).T, g2))
        return ga, gb
    if na:
        ga = _wrap(mm_arrays(gd, b._data.swapaxes(-1, -2)))
    if nb:
        gb = _wrap(mm_arrays(a._data.swapaxes(-1, -2), gd))
    return ga, gb


_MM_DTYPES = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, D.bfloat16.np))


def matmul(a, b):
    if not _amp.active and isinstance(a, Tensor) and isinstance(b, Tensor):
        # the common case's checks on the arrays (no Size, dtype or device objects): x @ W and equal-batch products
        xa, xb = a._data, b._data
        if (type(xa) is type(xb) and xa.dtype is xb.dtype and xa.dtype in _MM_DTYPES and xa.ndim >= 2
                and (xb.ndim == 2 or (xb.ndim == xa.ndim and xa.shape[:-2] == xb.shape[:-2]))
                and xa.shape[-1] == xb.shape[-2] and not (a._f8 or b._f8)):
            return Matmul.apply(a, b)
    check_same_device("matmul", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: both arguments need at least 1 dimension, got {fmt_shape(a.shape)} and "
                         f"{fmt_shape(b.shape)}")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ShapeError(f"matmul: shapes {fmt_shape(a.shape)} and {fmt_shape(b.shape)} cannot be multiplied "
                         f"({ka} != {kb})")
    if _amp.active:  # autocast hook
        a, b = _amp.cast_inputs("lower", a, b)
    if a._f8 or b._f8 or a.dtype is D.float8_e4m3fn or b.dtype is D.float8_e4m3fn:
        from .promotion import _fp8_storage_only
        _fp8_storage_only("matmul")
    if a._data.dtype != b._data.dtype:
        raise DTypeError(f"matmul: expected both operands to have the same dtype, got {a.dtype.name} and "
                         f"{b.dtype.name} (as PyTorch, no promotion: cast one with .to(), or compute under "
                         f"flame.amp.autocast)")
    return Matmul.apply(a, b)


def mm(a, b):
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"mm: expected 2-D tensors, got {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    return matmul(a, b)


def mv(input, vec):
    """torch.mv: a 2-D matrix times a 1-D vector."""
    if input.ndim != 2 or vec.ndim != 1:
        raise ShapeError(f"mv: expected a 2-D matrix and a 1-D vector, got shapes {fmt_shape(input.shape)} and "
                         f"{fmt_shape(vec.shape)}")
    return matmul(input, vec)


def bmm(a, b):
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ShapeError(f"bmm: expected 3-D tensors with equal batch, got {fmt_shape(a.shape)} and "
                         f"{fmt_shape(b.shape)}")
    return matmul(a, b)


def outer(a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"outer: expected 1-D tensors, got {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    return a.unsqueeze(1) * b.unsqueeze(0)


def dot(a, b):
    return matmul(a, b)


class Einsum(Function):
    @staticmethod
    def forward(ctx, spec, *xs):
        if any(x.dtype is D.float8_e4m3fn for x in xs):
            from .promotion import _fp8_storage_only
            _fp8_storage_only("einsum")
        ins, out = spec
        arrs = [x._data for x in xs]
        dt = arrs[0].dtype
        for x in xs[1:]:
            if x._data.dtype != dt:
                dt = D.promote_types(D.dtype_of(dt), x.dtype).np
        arrs = [a.astype(dt, copy=False) for a in arrs]
        xp = backend.xp_of(arrs[0])
        up = dt in _HALF and (xp is np or dt == _BF16)  # no half BLAS in NumPy; no batched bf16 in CuPy
        if up:
            arrs = [a.astype(np.float32) for a in arrs]
        try:
            r = xp.einsum(",".join(ins) + "->" + out, *arrs, optimize=len(arrs) > 2 if xp is np else False)
        except ValueError as e:  # a label with two sizes (NumPy says "broadcast", CuPy "size of label")
            raise ShapeError(f"einsum {','.join(ins)}->{out}: operand shapes "
                             f"{', '.join(fmt_shape(a.shape) for a in arrs)} do not fit ({e})") from e
        ctx.save_for_backward(*xs)
        ctx.spec = spec
        return _wrap(r.astype(dt) if up else r)

    @staticmethod
    def backward(ctx, g):
        ins, out = ctx.spec
        xs = ctx.saved_tensors
        grads = [None]
        for k, x in enumerate(xs):
            if not ctx.needs_input_grad[k + 1]:
                grads.append(None)
                continue
            others = [ins[j] for j in range(len(ins)) if j != k]
            present = set(out).union(*others) if others else set(out)
            labels = "".join(dict.fromkeys(ins[k]))  # each label of operand k once, in order
            size = dict(zip(ins[k], x.shape))
            target = "".join(c for c in labels if c in present)
            gk = einsum(",".join([out] + others) + "->" + target, g, *[xs[j] for j in range(len(xs)) if j != k])
            if target != labels:  # labels summed only within operand k: broadcast back (target keeps the order)
                gk = gk.reshape([size[c] if c in present else 1 for c in labels]).expand([size[c] for c in labels])
            if labels != ins[k]:  # a label repeated inside operand k (a diagonal): the gradient lives on it
                gk = _onto_diagonals(gk, labels, ins[k], size, "".join(ins) + out)
            grads.append(gk)
        return tuple(grads)


def _onto_diagonals(gk, labels, spec, size, used):
    """gk over `labels` (each once) placed on the diagonals of `spec`: each repeat of a label gets a fresh label
    tied to the first by an identity matrix, e.g. i -> ii is einsum("i,ij->ij", gk, eye)."""
    from .creation import eye
    fresh = iter(c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used)
    seen, new_spec, eyes = set(), "", []
    for c in spec:
        if c in seen:
            f = next(fresh)
            new_spec += f
            eyes.append((c + f, eye(size[c], dtype=gk.dtype, device=gk.device)))
        else:
            seen.add(c)
            new_spec += c
    return einsum(",".join([labels] + [e for e, _ in eyes]) + "->" + new_spec, gk, *[t for _, t in eyes])


def _parse_einsum(equation, operands):
    eq = equation.replace(" ", "")
    if "->" in eq:
        lhs, out = eq.split("->")
    else:
        lhs = eq
        letters = lhs.replace(",", "").replace(".", "")
        out = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    ins = lhs.split(",")
    if len(ins) != len(operands):
        raise ShapeError(f"einsum: equation '{equation}' has {len(ins)} operands but {len(operands)} were given")
    if any("." in s for s in ins + [out]):
        ins, out = _expand_ellipsis(ins, out, operands)
    for s, x in zip(ins, operands):
        if len(s) != x.ndim:
            raise ShapeError(f"einsum: subscripts '{s}' do not match operand of shape {fmt_shape(x.shape)}")
    return tuple(ins), out


def _expand_ellipsis(ins, out, operands):
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(ins) + out]
    n_ell = max(x.ndim - (len(s) - 3) for s, x in zip(ins, operands) if "..." in s)
    ell = "".join(free[:n_ell])
    new_ins = []
    for s, x in zip(ins, operands):
        if "..." in s:
            k = x.ndim - (len(s) - 3)
            s = s.replace("...", ell[n_ell - k:])
        new_ins.append(s)
    if "..." in out:
        out = out.replace("...", ell)
    return new_ins, out


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _from_sublists(args):
    """einsum(op0, sub0, op1, sub1, ..., [out]) -> (equation, operands); sublists hold ints in [0, 52) or ...."""
    def letters(sub):
        try:
            return "".join("..." if s is Ellipsis else _LETTERS[s] for s in sub)
        except (IndexError, TypeError):
            raise ValueError(f"einsum: sublist entries must be ints in [0, 52) or Ellipsis, got {sub!r}") from None
    ops, subs = args[0:len(args) - len(args) % 2:2], args[1:len(args) - len(args) % 2:2]
    eq = ",".join(letters(s) for s in subs)
    if len(args) % 2:
        eq += "->" + letters(args[-1])
    return eq, tuple(ops)


def einsum(equation, *operands):
    """torch.einsum: "ij,jk->ik" with operands (or a list of them), or the sublist form einsum(a, [0, 1], b,
    [1, 2], [0, 2]); ellipses broadcast; differentiable, including repeated labels (diagonals, traces)."""
    from ..tensor import Tensor
    if isinstance(equation, Tensor):
        equation, operands = _from_sublists((equation,) + operands)
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    check_same_device("einsum", *operands)
    spec = _parse_einsum(equation, operands)
    if _amp.active:  # autocast hook
        operands = _amp.cast_inputs("lower", *operands)
    return Einsum.apply(spec, *operands)
