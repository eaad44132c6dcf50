"""PyTorch's math functions, order statistics, arranging helpers, tensor products and finding / counting functions
(flame_core.ops.math_ops, order_stats, arrangement, products, binning) against golden outputs and gradients made
with PyTorch (tests/fixtures/make_torch_surface_fixtures.py): the same case code (tests/core/torch_surface_cases.py)
runs with lib = flame_core here. Values within 1e-10 (float64), NaN where PyTorch has NaN, the same dtype kind and
shape; gradients of sum(out * go) likewise (None where PyTorch gives none)."""
import os
import sys
import types

import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_surface_cases import CASES  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "torch_surface.safetensors")


class _Flame(types.ModuleType):
    """flame_core with `nn.functional` = flame_nn.functional: the cases' `L` for FLAME (torch.nn.functional's place)."""

    def __getattr__(self, name):
        return getattr(flame, name)


LIB = _Flame("flame_surface")
LIB.nn = types.SimpleNamespace(functional=flame_nn.functional)


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


def _host(t):
    return np.asarray(t.detach().cpu().numpy()) if isinstance(t, flame.Tensor) else np.asarray(t)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    fn, names, grad, *tol = CASES[case]
    args = []
    for n in names:
        a = golden[f"in.{n}"]
        t = flame.tensor(a, device=device)
        args.append(t.requires_grad_() if grad and a.dtype.kind == "f" else t)
    out = fn(LIB, *args)
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    want = [golden[k] for k in sorted((k for k in golden if k.startswith(f"{case}.out")),
                                      key=lambda k: int(k.rsplit("out", 1)[1]))]
    assert len(outs) == len(want), f"{case}: {len(outs)} outputs, PyTorch gives {len(want)}"
    for i, (o, w) in enumerate(zip(outs, want)):
        h = _host(o)
        assert h.shape == w.shape, f"{case}.out{i}: shape {h.shape}, PyTorch {w.shape}"
        kind = {"b": "b", "i": "i", "u": "i"}.get(w.dtype.kind, "f")
        assert {"b": "b", "i": "i", "u": "i"}.get(h.dtype.kind, "f") == kind, \
            f"{case}.out{i}: dtype {h.dtype}, PyTorch {w.dtype}"
        if kind == "f":
            assert h.dtype.itemsize == w.dtype.itemsize, f"{case}.out{i}: dtype {h.dtype}, PyTorch {w.dtype}"
            np.testing.assert_allclose(h, w, rtol=tol[0] if tol else 1e-10, atol=tol[1] if len(tol) > 1 else 1e-12,
                                       equal_nan=True, err_msg=f"{case}.out{i}")
        else:
            assert h.dtype == w.dtype, f"{case}.out{i}: dtype {h.dtype}, PyTorch {w.dtype}"
            np.testing.assert_array_equal(h, w, err_msg=f"{case}.out{i}")
    if not grad:
        return
    go = flame.tensor(golden[f"{case}.go"], device=device)
    (outs[0] * go).sum().backward()
    for j, a in enumerate(args):
        if not a.requires_grad:
            continue
        key = f"{case}.grad{j}"
        if key not in golden:
            assert a.grad is None or not np.any(_host(a.grad)), f"{case}: input {j} got a gradient, PyTorch none"
            continue
        np.testing.assert_allclose(_host(a.grad), golden[key], rtol=max(1e-9, tol[0]) if tol else 1e-9,
                                   atol=tol[1] if len(tol) > 1 else 1e-11, equal_nan=True, err_msg=f"{case}.grad{j}")
