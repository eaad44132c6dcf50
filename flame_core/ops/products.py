"""PyTorch's tensor products beyond matmul, composed of differentiable ops (their gradients come with them): kron,
tensordot, inner, cross (linalg.cross), block_diag."""
from ..errors import ShapeError
from . import linalg as L
from . import shape as S


def kron(a, b):
    """The Kronecker product: for a (p, q) and b (r, s), the (p r, q s) blocks a[i, j] * b (any ranks: the shorter
    shape padded with ones on the left), as torch.kron."""
    nd = max(a.ndim, b.ndim)
    a = a.reshape((1,) * (nd - a.ndim) + tuple(a.shape))
    b = b.reshape((1,) * (nd - b.ndim) + tuple(b.shape))
    # a[..., i, ...] * b[..., k, ...] on interleaved dims (i0, k0, i1, k1, ...), then merged pairwise
    ai = a.reshape(sum(((n, 1) for n in a.shape), ()))
    bi = b.reshape(sum(((1, n) for n in b.shape), ()))
    prod = ai * bi
    return prod.reshape(tuple(p * q for p, q in zip(a.shape, b.shape)))


def tensordot(a, b, dims=2):
    """Sum over the last `dims` dims of a and the first `dims` of b (an int), or over the paired dims ([a dims],
    [b dims]), as torch.tensordot."""
    if isinstance(dims, int):
        if dims < 0:
            raise ValueError(f"tensordot: expects dims >= 0, got {dims}")
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = ([d] if isinstance(d, int) else list(d) for d in dims)
    da = [d % a.ndim for d in da]
    db = [d % b.ndim for d in db] if b.ndim else []
    if len(da) != len(db) or any(a.shape[i] != b.shape[j] for i, j in zip(da, db)):
        raise ShapeError(f"tensordot: contracted dims {da} of {tuple(a.shape)} and {db} of {tuple(b.shape)} do not "
                         f"match")
    fa = [d for d in range(a.ndim) if d not in da]
    fb = [d for d in range(b.ndim) if d not in db]
    k = 1
    for d in da:
        k *= a.shape[d]
    a2 = S.permute(a, *(fa + da)).reshape(-1, k)
    b2 = S.permute(b, *(db + fb)).reshape(k, -1)
    return L.matmul(a2, b2).reshape(tuple(a.shape[d] for d in fa) + tuple(b.shape[d] for d in fb))


def inner(a, b):
    """Sum over the last dim of both (a scalar operand multiplies), as torch.inner."""
    if a.ndim == 0 or b.ndim == 0:
        return a * b
    if a.shape[-1] != b.shape[-1]:
        raise ShapeError(f"inner: last dims of {tuple(a.shape)} and {tuple(b.shape)} differ")
    return tensordot(a, b, dims=([a.ndim - 1], [b.ndim - 1]))


def cross(a, b, dim=None):
    """The 3-vector cross product along dim (torch.cross: default the first dim of size 3; linalg.cross: -1)."""
    shape = S.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    a, b = S.expand(a, *shape), S.expand(b, *shape)
    if dim is None:
        dim = next((i for i, n in enumerate(shape) if n == 3), None)
        if dim is None:
            raise ShapeError(f"cross: no dimension of size 3 in {shape}")
    dim %= len(shape)
    if shape[dim] != 3:
        raise ShapeError(f"cross: dimension {dim} of {shape} has size {shape[dim]}, expected 3")
    a0, a1, a2 = S.unbind(a, dim)
    b0, b1, b2 = S.unbind(b, dim)
    return S.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], dim=dim)


def block_diag(*tensors):
    """The tensors (0-, 1- or 2-d) as the blocks of a block-diagonal matrix, as torch.block_diag."""
    from .indexing import pad
    mats = []
    for t in tensors:
        if t.ndim > 2:
            raise ShapeError(f"block_diag: expects 0-, 1- or 2-d tensors, got {t.ndim}-d")
        mats.append(t.reshape(1, 1) if t.ndim == 0 else t.reshape(1, -1) if t.ndim == 1 else t)
    if not mats:
        raise ValueError("block_diag: expects at least one tensor")
    width = sum(m.shape[1] for m in mats)
    rows, left = [], 0
    for m in mats:
        rows.append(pad(m, (left, width - left - m.shape[1])))
        left += m.shape[1]
    return S.cat(rows, dim=0)
