"""Fused multi-tensor AdamW8bit step (kernel: cuda_src/adamw8bit.cu): one launch updates every tensor of a plan --
the weights, and their moments stored as 8-bit codes of the dynamic code books with one float32 absmax per
256 elements (or float32 moments for tensors kept unquantised) -- computing exactly what flame_nn.optim.AdamW8bit's
per-operation path computes.

    plan = adamw8bit_plan(rows)   # rows: (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax)
    plan.set_grads(grads)         # later steps: the gradients' arrays, wherever they are now (same sizes)
    adamw8bit_step(plan, signed_book, unsigned_book, lr=..., beta1=..., beta2=..., eps=..., weight_decay=...,
                   step=t)        # one launch for every tensor

A row's absmax entries are None for float32 moments. Params: contiguous float32 on the GPU; gradients of the same
size in float32 / float16 / bfloat16.
"""
import math

import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import launching as KL
from . import loader as L
from .adamw import GRAD_KIND as _GRAD_KIND

BLOCK = 256  # elements per quantisation block: the kernel's block size


def _contiguous_1d(a, size, what, dtypes):
    if not a.flags.c_contiguous or a.size != size:
        raise ShapeError(f"adamw8bit_plan: {what} must be contiguous with {size} elements, got shape "
                         f"{tuple(a.shape)}")
    if L.dtype_name(a.dtype) not in dtypes:
        raise DTypeError(f"adamw8bit_plan: {what} must be {' or '.join(dtypes)}, got {a.dtype}")


class AdamW8bitPlan:
    """The device-side tensor table (addresses, sizes, kinds) and the block table of one set of tensors."""

    def __init__(self, rows):
        if not rows:
            raise ShapeError("adamw8bit_plan: no tensors")
        table = np.zeros((len(rows), 8), dtype=np.int64)
        for t, (p, g, m, v, ma, va) in enumerate(rows):
            n = int(p.size)
            _contiguous_1d(p, n, f"tensor {t}'s parameter", ("float32",))
            _contiguous_1d(g, n, f"tensor {t}'s gradient", tuple(_GRAD_KIND))
            quantised = ma is not None
            nb = -(-n // BLOCK)
            for name, a, size, dts in (("exp_avg", m, n, ("uint8",) if quantised else ("float32",)),
                                       ("exp_avg_sq", v, n, ("uint8",) if quantised else ("float32",))):
                _contiguous_1d(a, size, f"tensor {t}'s {name}", dts)
            if quantised:
                if va is None:
                    raise ShapeError(f"adamw8bit_plan: tensor {t} has exp_avg_absmax but no exp_avg_sq_absmax")
                _contiguous_1d(ma, nb, f"tensor {t}'s exp_avg_absmax", ("float32",))
                _contiguous_1d(va, nb, f"tensor {t}'s exp_avg_sq_absmax", ("float32",))
            if not all(backend.is_cuda_array(a) for a in (p, g, m, v) + ((ma, va) if quantised else ())):
                raise ShapeError(f"adamw8bit_plan: tensor {t}: every array must be on the GPU")
            table[t] = (p.data.ptr, g.data.ptr, m.data.ptr, v.data.ptr, ma.data.ptr if quantised else 0,
                        va.data.ptr if quantised else 0, n, _GRAD_KIND[L.dtype_name(g.dtype)] | (4 if quantised else 0))
        self.rows = len(rows)
        self.host = table
        self.tables = (backend.cupy.asarray(table),) + _blocks(tuple(int(r[0].size) for r in rows))
        self.n_blocks = int(self.tables[1].size)

    def set_grads(self, grads):
        """Point the tensors at these gradient arrays (one per row, in order; each the row's size, contiguous, on
        the GPU): the device table is written only when an address or a dtype changed."""
        if len(grads) != self.rows:
            raise ShapeError(f"adamw8bit_plan.set_grads: {len(grads)} gradients for {self.rows} tensors")
        ptr = np.fromiter((g.data.ptr for g in grads), np.int64, self.rows)
        kind = np.fromiter((_GRAD_KIND.get(g.dtype.name, -1) for g in grads), np.int64, self.rows)
        size = np.fromiter((g.size for g in grads), np.int64, self.rows)
        bad = np.flatnonzero((kind < 0) | (size != self.host[:, 6]))
        bad = bad if bad.size else [t for t, g in enumerate(grads) if not g.flags.c_contiguous]
        if len(bad):
            t = int(bad[0])
            _contiguous_1d(grads[t], int(self.host[t, 6]), f"tensor {t}'s gradient", tuple(_GRAD_KIND))
        flags = (self.host[:, 7] & ~3) | kind
        if not (np.array_equal(ptr, self.host[:, 1]) and np.array_equal(flags, self.host[:, 7])):
            self.host[:, 1] = ptr
            self.host[:, 7] = flags
            self.tables[0].set(self.host)


_BLOCK_TABLES = {}  # tensor sizes -> (chunk_tensor, chunk_block) on the device: the same sizes every step


def _blocks(sizes):
    sizes = (backend.cupy.cuda.runtime.getDevice(),) + sizes
    hit = _BLOCK_TABLES.get(sizes)
    if hit is None:
        nb = np.array([-(-n // BLOCK) for n in sizes[1:]], dtype=np.int64)
        total = int(nb.sum())
        if total >= 2 ** 31:
            raise ShapeError(f"adamw8bit_plan: {total} blocks exceed the grid's limit")
        chunk_t = np.repeat(np.arange(len(nb), dtype=np.int32), nb)
        chunk_b = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)).astype(np.int32)
        if len(_BLOCK_TABLES) >= 16:
            _BLOCK_TABLES.pop(next(iter(_BLOCK_TABLES)))
        cp = backend.cupy
        hit = _BLOCK_TABLES[sizes] = (cp.asarray(chunk_t), cp.asarray(chunk_b))
    return hit


def adamw8bit_plan(rows):
    return AdamW8bitPlan(rows)


def adamw8bit_step(plan, signed_book, unsigned_book, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                   step):
    """One AdamW8bit step (step counts from 1) over every tensor of `plan`, in place."""
    if step < 1:
        raise ValueError(f"adamw8bit_step: step counts from 1, got {step}")
    for name, book in (("signed_book", signed_book), ("unsigned_book", unsigned_book)):
        if book.size != BLOCK or L.dtype_name(book.dtype) != "float32" or not backend.is_cuda_array(book):
            raise ShapeError(f"adamw8bit_step: {name} must be {BLOCK} float32 values on the GPU, got "
                             f"{book.size} {book.dtype}")
    bc1 = 1.0 - beta1 ** step
    tensors, chunk_t, chunk_b = plan.tables
    KL.launch(L.get_function("adamw8bit", "adamw8bit_multi"), (plan.n_blocks,), (BLOCK,),
              (tensors, chunk_t, chunk_b, signed_book, unsigned_book, KL.f32(lr / bc1), KL.f32(beta1),
               KL.f32(1 - beta1), KL.f32(beta2), KL.f32(1 - beta2), KL.f32(eps),
               KL.f32(math.sqrt(1 - beta2 ** step)), KL.f32(1 - lr * weight_decay), KL.i32(1 if weight_decay else 0)))
