"""Fused multi-tensor AdamW8bit step (kernel: cuda_src/adamw8bit.cu): one launch updates every tensor of a plan --
the weights, and their moments stored as 8-bit codes of the dynamic code books with one float32 absmax per
256 elements (or float32 moments for tensors kept unquantised) -- computing exactly what flame_nn.optim.AdamW8bit's
per-operation path computes.

    table = adamw8bit_table(rows)  # rows: (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax)
    table.set_grads(grads)         # later steps: the gradients' arrays, wherever they are now (same sizes)
    adamw8bit_step(table, signed_book, unsigned_book, lr=..., beta1=..., beta2=..., eps=..., weight_decay=...,
                   step=t)        # one launch for every tensor

A row's absmax entries are None for float32 moments. Params: contiguous float32 or bfloat16 on the GPU (a bfloat16
weight's new value stochastically rounded: sr_bits(seed, its salt, the element) -- `adamw8bit_table(rows, salts)`,
`adamw8bit_step(..., seed=)`; flame_nn.optim.AdamW8bit's NumPy path rounds with the same bits); gradients of the same
size in float32 / float16 / bfloat16.
"""
import math

from .. import backend
from ..errors import DTypeError, ShapeError
from . import launching as KL
from . import loader as L
from .tensor_table import TensorTable, check_array

BLOCK = 256  # elements per quantisation block: the kernel's block size


def _check_state(t, k, s, n):
    """exp_avg / exp_avg_sq: uint8 codes of n elements (float32 when unquantised, the absmax entries then absent);
    exp_avg_absmax / exp_avg_sq_absmax: float32, one per BLOCK elements."""
    name = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")[k]
    if k < 2:
        check_array(s, n, f"tensor {t}'s {name}", ("uint8", "float32"))
    else:
        check_array(s, -(-n // BLOCK), f"tensor {t}'s {name}", ("float32",))


def adamw8bit_table(rows, salts=None):
    """The kernel's TensorTable of rows (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax): both
    absmax entries None for float32 moments, else uint8 codes. salts: one 32-bit count per row (a bfloat16
    parameter's stochastic rounding; default 0)."""
    for t, (p, g, m, v, ma, va) in enumerate(rows):
        quantised = ma is not None
        if quantised != (va is not None):
            raise ShapeError(f"adamw8bit_table: tensor {t} has one absmax array of two")
        want = "uint8" if quantised else "float32"
        for name, a in (("exp_avg", m), ("exp_avg_sq", v)):
            if L.dtype_name(a.dtype) != want:
                raise DTypeError(f"adamw8bit_table: tensor {t}'s {name} must be {want} "
                                 f"({'quantised' if quantised else 'float32 moments'}), got {a.dtype}")
    return TensorTable(rows, BLOCK, _check_state, param_dtypes=("float32", "bfloat16"), salts=salts)


def adamw8bit_step(table, signed_book, unsigned_book, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                   step, seed=None):
    """One AdamW8bit step (step counts from 1) over every tensor of `table` (adamw8bit_table), in place. seed: the
    32-bit seed of bfloat16 parameters' stochastic rounding (default: the step)."""
    if step < 1:
        raise ValueError(f"adamw8bit_step: step counts from 1, got {step}")
    for name, book in (("signed_book", signed_book), ("unsigned_book", unsigned_book)):
        if book.size != BLOCK or L.dtype_name(book.dtype) != "float32" or not backend.is_cuda_array(book):
            raise ShapeError(f"adamw8bit_step: {name} must be {BLOCK} float32 values on the GPU, got "
                             f"{book.size} {book.dtype}")
    bc1 = 1.0 - beta1 ** step
    tensors, chunk_t, chunk_s = table.tables
    KL.launch(L.get_function("adamw8bit", "adamw8bit_multi"), (table.n_blocks,), (BLOCK,),
              (tensors, chunk_t, chunk_s, signed_book, unsigned_book, KL.f32(lr / bc1), KL.f32(beta1),
               KL.f32(1 - beta1), KL.f32(beta2), KL.f32(1 - beta2), KL.f32(eps),
               KL.f32(math.sqrt(1 - beta2 ** step)), KL.f32(1 - lr * weight_decay), KL.i32(1 if weight_decay else 0),
               KL.u32((step if seed is None else seed) & 0xFFFFFFFF)))
