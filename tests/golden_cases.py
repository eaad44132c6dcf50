"""The check shared by the tests of PyTorch golden fixtures (tests/core/test_torch_surface_golden.py,
tests/nn/test_nn_parity.py; the fixtures written by tests/fixtures/golden_io.py's run_cases): a case
`fn(lib, *inputs)` run with FLAME on the fixture's inputs gives PyTorch's outputs -- the same shapes, floats of the
same width within tolerance (NaN where PyTorch has NaN), integers and bools exactly -- and, where the case checks
gradients, the gradients of sum(out0 * go) (none, or zeros, where PyTorch gives none)."""
import numpy as np

import flame_core as flame

_KIND = {"b": "b", "i": "i", "u": "i"}


def host(t):
    return np.asarray(t.detach().cpu().numpy()) if isinstance(t, flame.Tensor) else np.asarray(t)


def check_case(case, golden, lib, fn, names, grad, device, out_tol=(1e-10, 1e-12), grad_tol=(1e-9, 1e-11)):
    args = []
    for n in names:
        a = golden[f"in.{n}"]
        t = flame.tensor(a, device=device)
        args.append(t.requires_grad_() if grad and a.dtype.kind == "f" else t)
    out = fn(lib, *args)
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    want = [golden[k] for k in sorted((k for k in golden if k.startswith(f"{case}.out")),
                                      key=lambda k: int(k.rsplit("out", 1)[1]))]
    assert len(outs) == len(want), f"{case}: {len(outs)} outputs, PyTorch gives {len(want)}"
    for i, (o, w) in enumerate(zip(outs, want)):
        h = host(o)
        assert h.shape == w.shape, f"{case}.out{i}: shape {h.shape}, PyTorch {w.shape}"
        kind = _KIND.get(w.dtype.kind, "f")
        assert _KIND.get(h.dtype.kind, "f") == kind, f"{case}.out{i}: dtype {h.dtype}, PyTorch {w.dtype}"
        if kind == "f":
            assert h.dtype.itemsize == w.dtype.itemsize, f"{case}.out{i}: dtype {h.dtype}, PyTorch {w.dtype}"
            np.testing.assert_allclose(h, w, rtol=out_tol[0], atol=out_tol[1], equal_nan=True, err_msg=f"{case}.out{i}")
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
            assert a.grad is None or not np.any(host(a.grad)), f"{case}: input {j} got a gradient, PyTorch none"
            continue
        np.testing.assert_allclose(host(a.grad), golden[key], rtol=grad_tol[0], atol=grad_tol[1], equal_nan=True,
                                   err_msg=f"{case}.grad{j}")
