"""Fused multi-tensor AdamW over flat buffers (kernel: cuda_src/adamw.cu), PyTorch's update rule:

    w *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Gradients, the moments `exp_avg` / `exp_avg_sq` (fp32) and optional fp32 `master` weights are flat 1-D buffers; tensor i
occupies [offsets[i], offsets[i] + params[i].size) in each. The parameters themselves are separate arrays (all one
dtype: float32, or bfloat16 / float16 with fp32 master weights) updated in place; with `master`, the math reads and
writes the master copy and the parameter receives its rounded value.

    plan = adamw_plan(params, offsets)          # once per parameter set: the device-side chunk table
    adamw_step(plan, grad, exp_avg, exp_avg_sq, lr=..., beta1=..., beta2=..., eps=..., weight_decay=..., step=t,
               master=None, grad_scale=1.0)     # one launch for every tensor
"""
import math

import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import launching as KL
from . import loader as L
from .tensor_table import GRAD_KIND, block_rows

CHUNK = 16384  # elements per block


class AdamWPlan:
    """The parameter list, its offsets into the flat buffers and (on the GPU) the chunk table of the kernel."""

    def __init__(self, params, offsets):
        if len(params) != len(offsets):
            raise ShapeError(f"adamw_plan: {len(params)} params but {len(offsets)} offsets")
        if not params:
            raise ShapeError("adamw_plan: no parameters")
        dt = params[0].dtype
        for i, p in enumerate(params):
            if p.dtype != dt:
                raise DTypeError(f"adamw_plan: parameter {i} is {p.dtype}, parameter 0 is {dt}; one plan per dtype")
            if not p.flags.c_contiguous:
                raise ShapeError(f"adamw_plan: parameter {i} of shape {tuple(p.shape)} is not contiguous")
        self.params = list(params)
        self.offsets = [int(o) for o in offsets]
        self.sizes = [int(p.size) for p in params]
        self.numel = max(o + n for o, n in zip(self.offsets, self.sizes))
        self.dtype = dt
        self.tables = None
        self.on_gpu = all(backend.is_cuda_array(p) for p in params)
        if self.on_gpu:
            cp = backend.cupy
            chunk_t, chunk_s = block_rows(self.sizes, CHUNK)
            self.tables = (cp.asarray(np.array([p.data.ptr for p in params], dtype=np.int64)),
                           cp.asarray(np.array(self.sizes, dtype=np.int64)),
                           cp.asarray(np.array(self.offsets, dtype=np.int64)),
                           cp.asarray(chunk_t), cp.asarray(chunk_s))
            self.n_chunks = len(chunk_t)


def adamw_plan(params, offsets):
    return AdamWPlan(params, offsets)


def _check_flat(plan, name, a, dtypes=("float32",)):
    if a.ndim != 1 or a.size < plan.numel:
        raise ShapeError(f"adamw_step: {name} must be a flat buffer of at least {plan.numel} elements, "
                         f"got shape {tuple(a.shape)}")
    if L.dtype_name(a.dtype) not in dtypes:
        raise DTypeError(f"adamw_step: {name} must be {' or '.join(dtypes)}, got {a.dtype}")


def _step_ref(plan, grad, m, v, master, lr, b1, b2, eps, wd, bc1, sqrt_bc2, grad_scale):
    for p, o, n in zip(plan.params, plan.offsets, plan.sizes):
        sl = slice(o, o + n)
        g = grad[sl].astype(np.float32) * np.float32(grad_scale)
        w = master[sl] if master is not None else p.reshape(-1).astype(np.float32)
        w = w * np.float32(1 - lr * wd)
        m[sl] = b1 * m[sl] + (1 - b1) * g
        v[sl] = b2 * v[sl] + (1 - b2) * g * g
        w = w - np.float32(lr / bc1) * m[sl] / (backend.xp_of(w).sqrt(v[sl]) / np.float32(sqrt_bc2) + np.float32(eps))
        if master is not None:
            master[sl] = w
        p.reshape(-1)[...] = w.astype(p.dtype)


def adamw_step(plan, grad, exp_avg, exp_avg_sq, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, step,
               master=None, grad_scale=1.0):
    """One AdamW step (step counts from 1) over every tensor of `plan`; updates params, moments and master in place."""
    _check_flat(plan, "grad", grad, tuple(GRAD_KIND))
    _check_flat(plan, "exp_avg", exp_avg)
    _check_flat(plan, "exp_avg_sq", exp_avg_sq)
    if master is not None:
        _check_flat(plan, "master", master)
    elif L.dtype_name(plan.dtype) != "float32":
        raise DTypeError(f"adamw_step: {plan.dtype} parameters need fp32 master weights (pass master=)")
    if step < 1:
        raise ValueError(f"adamw_step: step counts from 1, got {step}")
    bc1 = 1.0 - beta1 ** step
    sqrt_bc2 = math.sqrt(1.0 - beta2 ** step)
    if plan.on_gpu and L.use_kernel(grad, exp_avg, exp_avg_sq, master, *plan.params[:1]):
        ptrs, sizes, offsets, chunk_t, chunk_s = plan.tables
        KL.launch(L.get_function("adamw", "adamw_multi", plan.dtype), (plan.n_chunks,), (256,),
                  (ptrs, sizes, offsets, chunk_t, chunk_s, KL.i32(CHUNK), grad,
                  KL.i32(GRAD_KIND[L.dtype_name(grad.dtype)]),
                  exp_avg, exp_avg_sq, KL.null() if master is None else master, KL.f32(lr), KL.f32(beta1),
                  KL.f32(beta2), KL.f32(eps), KL.f32(weight_decay), KL.f32(bc1), KL.f32(sqrt_bc2), KL.f32(grad_scale)))
        return
    _step_ref(plan, grad, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, bc1, sqrt_bc2,
              grad_scale)
