"""One-launch multi-tensor steps of the elementwise optimizers (kernels: cuda_src/optim_multi.cu): Lion,
AdamWScheduleFree and Prodigy over every tensor of a table at once, computing what their per-operation paths in
flame_nn.optim compute (bit for bit with float32 gradients; Prodigy's two sums are reduced in another order).

    table = optim_table(rows)     # rows: (param, grad, state_a, state_b, state_c, state_d); absent states None
    table.set_grads(grads)        # later steps: the gradients' arrays, wherever they are now (same sizes)
    lion_step(table, lr=..., beta1=..., beta2=..., decay=...)                 # a = exp_avg
    sfadamw_step(table, beta2=..., bc2=..., eps=..., decay=..., ckp1=..., y_coef=..., lr=...)   # a = z, b = v
    dot, abs_s = prodigy_stats(table, beta1=..., m_coef=..., beta2=..., v_coef=..., beta3=..., s_coef=...)
    prodigy_update(table, dlr=..., d_eps=..., decay=...)          # a = p0, b = exp_avg, c = exp_avg_sq, d = s
    table = adafactor_table(rows, salts)   # rows: (param (..., R, C), grad, exp_avg or None, row (..., R),
                                           # col (..., C)), or (param of < 2 dims, grad, exp_avg or None,
                                           # exp_avg_sq, None)
    adafactor_step(table, eps1=..., beta2t=..., eps2=..., rel=..., scale_parameter=..., clip_threshold=...,
                   beta1=..., weight_decay=..., seed=step)        # four launches; table.rms(t): rms(w) of tensor t

Parameters and states: contiguous float32 on the GPU, of the parameter's size (Prodigy's p0 may be absent: an
all-zero initial point); gradients of that size in float32 / float16 / bfloat16. Adafactor also takes bfloat16
parameters (a full fine-tune's train.full_bf16): updated in float32 and written back with stochastic rounding
(sr_bits(seed, the row's salt, the element), as flame_core.kernels.stochastic_rounding's NumPy path).
"""
import numpy as np

from .. import backend
from ..errors import ShapeError
from . import launching as KL
from . import loader as L
from .tensor_table import TensorTable, check_array

CHUNK = 4096   # elements per block (OM_CHUNK)
THREADS = 256  # OM_THREADS


def optim_table(rows):
    """The kernels' TensorTable of these rows (flame_core.kernels.tensor_table), OM_CHUNK elements a block."""
    return TensorTable(rows, CHUNK)


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


AF_HEAD = 5   # scratch floats before a tensor's row and column sums: rms(w), sum u^2, mean(row), lr_t, sum w^2
AF_SMALL = 16  # the largest R and C of a batch of matrices (a parameter of more than 2 dimensions) the kernels take


def adafactor_kind(shape):
    """How the kernels take a parameter of `shape`: "matrix" (2-D: factored), "batched" (more dimensions, factored
    over the last two, each at most AF_SMALL: convolution kernels), "unfactored" (fewer), or None (not at all)."""
    if len(shape) == 2:
        return "matrix"
    if len(shape) < 2:
        return "unfactored"
    return "batched" if shape[-2] <= AF_SMALL and shape[-1] <= AF_SMALL else None


class AdafactorTable(TensorTable):
    """A TensorTable of Adafactor's parameters -- factored ones (2-D, or batches of small matrices: `adafactor_kind`)
    with row and column states (the shapes transformers' Adafactor gives them: shape[:-1], shape[:-2] + shape[-1:]),
    the rest unfactored (exp_avg_sq of the parameter's size) -- with each tensor's scratch (zeroed once; the kernels
    leave the sums zero between steps) and its (R, C) (0, 0: unfactored). Parameters float32 or bfloat16 (salts: one
    32-bit count per row, the stochastic rounding's)."""

    def __init__(self, rows, salts=None):
        cp = backend.cupy
        shapes = [tuple(r[0].shape) for r in rows]
        dims, sums = [], []
        for t, (shape, row) in enumerate(zip(shapes, rows)):
            if len(row) != 5:
                raise ShapeError(f"adafactor_table: tensor {t}: rows are (param, grad, exp_avg, row or exp_avg_sq, "
                                 f"col)")
            kind = adafactor_kind(shape)
            if kind is None:
                raise ShapeError(f"adafactor_table: tensor {t} of shape {shape}: the kernels factor a batch of "
                                 f"matrices of at most {AF_SMALL} x {AF_SMALL}")
            if (kind == "unfactored") != (row[4] is None):
                raise ShapeError(f"adafactor_table: tensor {t} of shape {shape}: a parameter of 2+ dimensions takes "
                                 f"row and column states, any other a whole exp_avg_sq and col None")
            dims.append(shape[-2:] if kind != "unfactored" else (0, 0))
            sums.append(sum(shape) if kind == "matrix" else 0)   # (the 2-D ones' row and column sums)
        offsets = np.cumsum([0] + [AF_HEAD + k for k in sums])
        self.scratch = cp.zeros(int(offsets[-1]), dtype=np.float32)
        full = [tuple(row) + (self.scratch[o:o + AF_HEAD + k],) for row, o, k in zip(rows, offsets, sums)]

        def check_state(t, k, s, n, dims=dims, sums=sums):
            R, C = dims[t]
            want = (n, n // C if C else n, n // R if R else 0, AF_HEAD + sums[t])[k]
            check_array(s, want, f"tensor {t}'s "
                        f"{('exp_avg', 'exp_avg_sq_row' if C else 'exp_avg_sq', 'exp_avg_sq_col', 'scratch')[k]}",
                        ("float32",))
        super().__init__(full, CHUNK, check_state, param_dtypes=("float32", "bfloat16"), salts=salts)
        self.dims = cp.asarray(np.array(dims, dtype=np.int64).reshape(-1))
        self.offsets = offsets

    def rms(self, t):
        """A 0-d view of tensor t's rms(w) at the last step (the scratch's first float: it changes every step)."""
        o = int(self.offsets[t])
        return self.scratch[o:o + 1].reshape(())


def adafactor_table(rows, salts=None):
    return AdafactorTable(rows, salts)


def adafactor_step(table, *, eps1, beta2t, eps2, rel, scale_parameter, clip_threshold, beta1, weight_decay, seed=0):
    """One Adafactor step over every tensor of `table` (AdafactorTable): rel is the step's relative step size (lr,
    or the relative-step schedule's), scaled per tensor by max(eps2, rms(w)) when scale_parameter; seed: the 32-bit
    seed of bfloat16 parameters' stochastic rounding (the optimizer passes the step)."""
    tensors, chunk_t, chunk_s = table.tables
    one_minus = KL.f32(1.0 - beta2t)
    KL.launch(L.get_function("optim_multi", "adafactor_sums_multi"), (table.n_blocks,), (THREADS,),
              (tensors, chunk_t, chunk_s, table.dims, KL.f32(eps1), KL.f32(beta2t), one_minus))
    KL.launch(L.get_function("optim_multi", "adafactor_factors_multi"), (table.rows,), (THREADS,),
              (tensors, table.dims, KL.f32(beta2t), one_minus, KL.f32(eps2), KL.f32(rel),
               KL.i32(1 if scale_parameter else 0)))
    KL.launch(L.get_function("optim_multi", "adafactor_rms_multi"), (table.n_blocks,), (THREADS,),
              (tensors, chunk_t, chunk_s, table.dims))
    KL.launch(L.get_function("optim_multi", "adafactor_update_multi"), (table.n_blocks,), (THREADS,),
              (tensors, chunk_t, chunk_s, table.dims, KL.f32(clip_threshold), KL.f32(beta1 or 0.0),
               KL.i32(0 if beta1 is None else 1), KL.f32(weight_decay), KL.u32(int(seed) & 0xFFFFFFFF)))
