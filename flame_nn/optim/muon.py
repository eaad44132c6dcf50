"""Muon (Jordan et al. 2024), PyTorch's update rule for 2-D parameters:

    b = lerp(b, g, 1 - momentum) ;  u = lerp(g, b, momentum) if nesterov else b
    O = NS(u):  X = u / max(|u|_F, eps) in bfloat16 (u^T when u is tall), then ns_steps times
                A = X X^T ;  X = a X + (b A + c A A) X
    p *= 1 - lr weight_decay ;  p -= lr' O   with  lr' = lr sqrt(max(1, rows / cols))   (adjust_lr_fn None, "original")
                                                   lr' = lr 0.2 sqrt(max(rows, cols))  ("match_rms_adamw")
The Newton-Schulz products run in bfloat16 as PyTorch's: each product, and each scaled sum with it, accumulated in
float32 and rounded once (on cuda: cuBLAS with a float32 output).
"""
import math

import numpy as np

from flame_core import as_tensor, backend
from flame_core import dtypes as D
from flame_core.kernels import gemm
from flame_core.ops.linalg import mm_arrays
from flame_core.tensor import Tensor

from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device

BF16 = np.dtype(D.bfloat16.np)


def _lerp(start, end, weight):
    """PyTorch's lerp: start + weight (end - start), computed from the nearer end."""
    return start + weight * (end - start) if weight < 0.5 else end - (end - start) * (1 - weight)


def _addmm(c, a, b, beta, alpha):
    """beta c + alpha (a @ b) of bfloat16 arrays, summed in float32 and rounded to bfloat16 once."""
    acc = c.astype(np.float32)
    if backend.is_cuda_array(acc):
        return gemm.matmul(a, b, out=acc, beta=beta, alpha=alpha).astype(BF16)
    return (beta * acc + alpha * mm_arrays(a.astype(np.float32), b.astype(np.float32))).astype(BF16)


def orthogonalize(u, coefficients, steps, eps):
    """Newton-Schulz's approximate orthogonalisation (U S' V^T, S' ~ 1) of a 2-D array: a bfloat16 array of its
    shape."""
    a, b, c = coefficients
    xp = backend.xp_of(u)
    x = u.astype(np.float32).astype(BF16)  # via float32, as PyTorch's conversion
    tall = x.shape[0] > x.shape[1]
    x32 = (x.T if tall else x).astype(np.float32)
    norm = xp.maximum(xp.sqrt((x32 * x32).sum()), np.float32(eps)).astype(BF16).astype(np.float32)
    x = (x32 / norm).astype(BF16)
    for _ in range(steps):
        gram = mm_arrays(x, x.T)
        x = _addmm(x, _addmm(gram, gram, gram, b, c), x, a, 1.0)
    return x.T if tall else x


class Muon(Optimizer):
    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None):
        for k, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if v < 0:
                raise ValueError(f"Muon: invalid {k}={v} (must be >= 0)")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Muon: invalid adjust_lr_fn={adjust_lr_fn!r} (None, 'original' or 'match_rms_adamw')")
        if len(ns_coefficients) != 3:
            raise ValueError(f"Muon: invalid ns_coefficients={ns_coefficients} (three numbers a, b, c)")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"Muon: invalid ns_steps={ns_steps} (0 to 99)")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))

    def add_param_group(self, group):
        ps = group["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        for p in ps:
            if isinstance(p, Tensor) and p.ndim != 2:
                raise ValueError(f"Muon only supports 2-D parameters, got one of shape {tuple(p.shape)} (optimize "
                                 f"biases, norms and embeddings with another optimizer, e.g. AdamW)")
        super().add_param_group({**group, "params": ps})

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            for p, g in grads_of(group):
                w = p.array
                st = state_on_device(self.state.setdefault(p, {}), p)
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = as_tensor(backend.xp_of(g).zeros_like(g))
                buf = st["momentum_buffer"].array
                buf[...] = _lerp(buf, g, 1 - mom)
                o = orthogonalize(_lerp(g, buf, mom) if group["nesterov"] else buf, group["ns_coefficients"],
                                  group["ns_steps"], group["eps"])
                rows, cols = w.shape
                scale = math.sqrt(max(1, rows / cols)) if group["adjust_lr_fn"] != "match_rms_adamw" else \
                    0.2 * math.sqrt(max(rows, cols))
                w *= 1 - lr * group["weight_decay"]
                w -= (lr * scale) * o.astype(w.dtype)
                p._version[0] += 1
        return loss
