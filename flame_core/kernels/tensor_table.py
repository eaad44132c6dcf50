"""The device-side table of many tensors that a multi-tensor kernel (cuda_src/adamw8bit.cu, optim_multi.cu) walks in
one launch: one int64 row per tensor -- its parameter's and gradient's addresses, up to four state addresses (0 where
absent), its element count and its kinds: bits 0-3 the gradient's dtype (0 float32 / 1 float16 / 2 bfloat16), bits
4-7 the parameter's (0 float32 / 2 bfloat16) and bits 8+ the tensor's salt (0 unless given) -- and the block table: the
tensor and first element of each block's `chunk` elements.

    table = TensorTable(rows, chunk)    # rows: (param, grad, *states); absent states None
    table.set_grads(grads)              # later steps: the gradients' arrays, wherever they are now (same sizes)

Parameters: contiguous float32 on the GPU (bfloat16 too where the kernel takes it: `param_dtypes`, each with its
`salts` entry); gradients of the parameter's size in float32 / float16 / bfloat16; states: float32 of the parameter's
size unless `check_state(t, k, state, numel)` (raising for a bad one) says otherwise.
"""
import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import loader as L

STATES = 4
GRAD_KIND = {"float32": 0, "float16": 1, "bfloat16": 2}  # the kernels' gradient-dtype argument (adamw.cu's too)


def check_array(a, size, what, dtypes):
    """Raise unless `a` is a contiguous GPU array of `size` elements and one of `dtypes` (names)."""
    if not backend.is_cuda_array(a):
        raise ShapeError(f"{what} must be on the GPU")
    if not a.flags.c_contiguous or a.size != size:
        raise ShapeError(f"{what} must be contiguous with {size} elements, got shape {tuple(a.shape)}")
    if L.dtype_name(a.dtype) not in dtypes:
        raise DTypeError(f"{what} must be {' or '.join(dtypes)}, got {a.dtype}")


def _float32_state(t, k, s, n):
    check_array(s, n, f"tensor {t}'s state {'abcd'[k]}", ("float32",))


PARAM_KIND = {"float32": 0, "bfloat16": 2}


class TensorTable:
    def __init__(self, rows, chunk, check_state=_float32_state, param_dtypes=("float32",), salts=None):
        if not rows:
            raise ShapeError("tensor table: no tensors")
        if salts is not None and len(salts) != len(rows):
            raise ShapeError(f"tensor table: {len(salts)} salts for {len(rows)} tensors")
        host = np.zeros((len(rows), 8), dtype=np.int64)
        for t, row in enumerate(rows):
            if len(row) > 2 + STATES:
                raise ShapeError(f"tensor table: tensor {t} has {len(row) - 2} states, at most {STATES}")
            p, g, *states = row
            n = int(p.size)
            check_array(p, n, f"tensor {t}'s parameter", param_dtypes)
            check_array(g, n, f"tensor {t}'s gradient", tuple(GRAD_KIND))
            for k, s in enumerate(states):
                if s is not None:
                    check_state(t, k, s, n)
            host[t, :2] = (p.data.ptr, g.data.ptr)
            host[t, 2:2 + len(states)] = [0 if s is None else s.data.ptr for s in states]
            host[t, 6] = n
            salt = 0 if salts is None else int(salts[t])
            if not 0 <= salt < 1 << 32:
                raise ShapeError(f"tensor table: tensor {t}'s salt {salt} is not a 32-bit count")
            host[t, 7] = GRAD_KIND[L.dtype_name(g.dtype)] | PARAM_KIND[L.dtype_name(p.dtype)] << 4 | salt << 8
        self.rows, self.chunk, self.host = len(rows), int(chunk), host
        self.tables = (backend.cupy.asarray(host),) + block_table(tuple(int(n) for n in host[:, 6]), self.chunk)
        self.n_blocks = int(self.tables[1].size)

    def set_grads(self, grads):
        """Point the rows at these gradient arrays (one per row, in order, each of the row's size): the device
        table is written only when an address or a dtype changed."""
        if len(grads) != self.rows:
            raise ShapeError(f"tensor table: {len(grads)} gradients for {self.rows} tensors")
        for t, g in enumerate(grads):
            if g.size != self.host[t, 6] or g.dtype.name not in GRAD_KIND or not g.flags.c_contiguous \
                    or not backend.is_cuda_array(g):
                check_array(g, int(self.host[t, 6]), f"tensor {t}'s gradient", tuple(GRAD_KIND))
        ptr = np.fromiter((g.data.ptr for g in grads), np.int64, self.rows)
        kind = np.fromiter((GRAD_KIND[g.dtype.name] for g in grads), np.int64, self.rows)
        kind |= self.host[:, 7] & ~np.int64(15)   # the parameter's kind and the salt stay
        if not (np.array_equal(ptr, self.host[:, 1]) and np.array_equal(kind, self.host[:, 7])):
            self.host[:, 1] = ptr
            self.host[:, 7] = kind
            self.tables[0].set(self.host)


_CHUNKS = {}  # (device, chunk, sizes) -> (chunk_tensor int32, chunk_start int64) on the device


def block_rows(sizes, chunk):
    """(chunk_tensor int32, chunk_start int64) as NumPy arrays: the tensor and first element of every block of
    `chunk` elements over tensors of `sizes` elements, tensor by tensor."""
    nb = np.array([-(-int(n) // chunk) for n in sizes], dtype=np.int64)
    total = int(nb.sum())
    if total >= 2 ** 31:
        raise ShapeError(f"tensor table: {total} blocks exceed the grid's limit")
    chunk_t = np.repeat(np.arange(len(nb), dtype=np.int32), nb)
    chunk_s = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)) * chunk
    return chunk_t, chunk_s


def block_table(sizes, chunk):
    """block_rows on the current GPU, cached (the same parameter sets every step)."""
    key = (backend.cupy.cuda.runtime.getDevice(), chunk) + tuple(sizes)
    hit = _CHUNKS.get(key)
    if hit is None:
        if len(_CHUNKS) >= 16:
            _CHUNKS.pop(next(iter(_CHUNKS)))
        cp = backend.cupy
        hit = _CHUNKS[key] = tuple(cp.asarray(x) for x in block_rows(sizes, chunk))
    return hit
