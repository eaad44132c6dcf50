"""One-launch multi-tensor steps of the elementwise optimizers (kernels: cuda_src/optim_multi.cu): Lion,
AdamWScheduleFree and Prodigy over every tensor of a table at once, computing what their per-operation paths in
flame_nn.optim compute (bit for bit with float32 gradients; Prodigy's two sums are reduced in another order).

    table = TensorTable(rows)     # rows: (param, grad, state_a, state_b, state_c, state_d); absent states None
    table.set_grads(grads)        # later steps: the gradients' arrays, wherever they are now (same sizes)
    lion_step(table, lr=..., beta1=..., beta2=..., decay=...)                 # a = exp_avg
    sfadamw_step(table, beta2=..., bc2=..., eps=..., decay=..., ckp1=..., y_coef=..., lr=...)   # a = z, b = v
    dot, abs_s = prodigy_stats(table, beta1=..., m_coef=..., beta2=..., v_coef=..., beta3=..., s_coef=...)
    prodigy_update(table, dlr=..., d_eps=..., decay=...)          # a = p0, b = exp_avg, c = exp_avg_sq, d = s

Parameters and states: contiguous float32 on the GPU, of the parameter's size (Prodigy's p0 may be absent: an
all-zero initial point); gradients of that size in float32 / float16 / bfloat16.
"""
import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import launching as KL
from . import loader as L

CHUNK = 4096   # elements per block (OM_CHUNK)
THREADS = 256  # OM_THREADS
STATES = 4
_GRAD_KIND = {"float32": 0, "float16": 1, "bfloat16": 2}


def _check(a, size, what, dtypes):
    if not backend.is_cuda_array(a):
        raise ShapeError(f"optim_multi: {what} must be on the GPU")
    if not a.flags.c_contiguous or a.size != size:
        raise ShapeError(f"optim_multi: {what} must be contiguous with {size} elements, got shape {tuple(a.shape)}")
    if L.dtype_name(a.dtype) not in dtypes:
        raise DTypeError(f"optim_multi: {what} must be {' or '.join(dtypes)}, got {a.dtype}")


class TensorTable:
    """The device-side rows (addresses, sizes, gradient dtypes) and block table of a set of tensors."""

    def __init__(self, rows):
        if not rows:
            raise ShapeError("optim_multi: no tensors")
        host = np.zeros((len(rows), 8), dtype=np.int64)
        for t, row in enumerate(rows):
            if len(row) > 2 + STATES:
                raise ShapeError(f"optim_multi: tensor {t} has {len(row) - 2} states, at most {STATES}")
            p, g, *states = row
            n = int(p.size)
            _check(p, n, f"tensor {t}'s parameter", ("float32",))
            _check(g, n, f"tensor {t}'s gradient", tuple(_GRAD_KIND))
            for k, s in enumerate(states):
                if s is not None:
                    _check(s, n, f"tensor {t}'s state {'abcd'[k]}", ("float32",))
            host[t, :2] = (p.data.ptr, g.data.ptr)
            host[t, 2:2 + len(states)] = [0 if s is None else s.data.ptr for s in states]
            host[t, 6] = n
            host[t, 7] = _GRAD_KIND[L.dtype_name(g.dtype)]
        self.rows = len(rows)
        self.host = host
        self.tables = (backend.cupy.asarray(host),) + _chunks(tuple(int(n) for n in host[:, 6]))
        self.n_blocks = int(self.tables[1].size)

    def set_grads(self, grads):
        """Point the rows at these gradient arrays (one per row, in order, each of the row's size): the device
        table is written only when an address or a dtype changed."""
        if len(grads) != self.rows:
            raise ShapeError(f"optim_multi: {len(grads)} gradients for {self.rows} tensors")
        for t, g in enumerate(grads):
            if g.size != self.host[t, 6] or g.dtype.name not in _GRAD_KIND or not g.flags.c_contiguous \
                    or not backend.is_cuda_array(g):
                _check(g, int(self.host[t, 6]), f"tensor {t}'s gradient", tuple(_GRAD_KIND))
        ptr = np.fromiter((g.data.ptr for g in grads), np.int64, self.rows)
        kind = np.fromiter((_GRAD_KIND[g.dtype.name] for g in grads), np.int64, self.rows)
        if not (np.array_equal(ptr, self.host[:, 1]) and np.array_equal(kind, self.host[:, 7])):
            self.host[:, 1] = ptr
            self.host[:, 7] = kind
            self.tables[0].set(self.host)


_CHUNKS = {}  # (device, sizes) -> (chunk_tensor, chunk_start) on the device


def _chunks(sizes):
    key = (backend.cupy.cuda.runtime.getDevice(),) + sizes
    hit = _CHUNKS.get(key)
    if hit is None:
        nb = np.array([-(-n // CHUNK) for n in sizes], dtype=np.int64)
        total = int(nb.sum())
        if total >= 2 ** 31:
            raise ShapeError(f"optim_multi: {total} blocks exceed the grid's limit")
        chunk_t = np.repeat(np.arange(len(sizes), dtype=np.int32), nb)
        chunk_s = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)) * CHUNK
        if len(_CHUNKS) >= 16:
            _CHUNKS.pop(next(iter(_CHUNKS)))
        cp = backend.cupy
        hit = _CHUNKS[key] = (cp.asarray(chunk_t), cp.asarray(chunk_s))
    return hit


def _launch(name, table, *scalars, extra=()):
    tensors, chunk_t, chunk_s = table.tables
    KL.launch(L.get_function("optim_multi", name), (table.n_blocks,), (THREADS,),
              (tensors, chunk_t, chunk_s) + tuple(extra) + scalars)


def lion_step(table, *, lr, beta1, beta2, decay):
    """Lion over every row (state a: exp_avg); decay: the factor the weights are scaled by (1 - lr wd), 1 for none."""
    _launch("lion_multi", table, KL.f32(lr), KL.f32(beta1), KL.f32(1 - beta1), KL.f32(beta2), KL.f32(1 - beta2),
            KL.f32(decay), KL.i32(0 if decay == 1 else 1))


def sfadamw_step(table, *, beta2, bc2, eps, decay, ckp1, y_coef, lr):
    """AdamWScheduleFree in train mode (parameters at y; state a: z, b: exp_avg_sq); decay: weight_decay (0: none)."""
    _launch("sfadamw_multi", table, KL.f32(beta2), KL.f32(1 - beta2), KL.f32(bc2), KL.f32(eps), KL.f32(decay),
            KL.i32(1 if decay else 0), KL.f32(ckp1), KL.f32(y_coef), KL.f32(lr))


def prodigy_stats(table, *, beta1, m_coef, beta2, v_coef, beta3, s_coef):
    """Prodigy's first pass (states: a p0 or absent, b exp_avg or absent, c exp_avg_sq, d s); returns (sum of
    g (p0 - p), sum of |s|) over every row as Python floats (fp32 block sums added in float64; one synchronisation)."""
    cp = backend.cupy
    partials = cp.empty(2 * table.n_blocks, dtype=np.float32)
    _launch("prodigy_stats_multi", table, KL.f32(beta1), KL.f32(m_coef), KL.f32(beta2), KL.f32(v_coef),
            KL.f32(beta3), KL.f32(s_coef), extra=(partials,))
    sums = partials.reshape(-1, 2).astype(np.float64).sum(axis=0).get()
    return float(sums[0]), float(sums[1])


def prodigy_update(table, *, dlr, d_eps, decay):
    """Prodigy's second pass (states: b exp_avg, c exp_avg_sq); decay: the factor the weights are scaled by
    (1 - weight_decay dlr with decoupled decay), 1 for none."""
    _launch("prodigy_update_multi", table, KL.f32(dlr), KL.f32(d_eps), KL.f32(decay), KL.i32(0 if decay == 1 else 1))
