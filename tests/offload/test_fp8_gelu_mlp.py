"""The fused fp8-compute MLP (Linear.forward_gelu_mlp -> flame_nn.offload.fp8_compute.Float8ComputeGeluMlp) and its
GELU-fused casts (flame_core.kernels.fp8_gelu): against the composed layers (fc1, GELU, fc2 as three nodes, each
quantising on its own) over several steps of delayed scaling -- outputs, input gradients and every site's history --
and the casts against the composed ops on ragged shapes in float32 / float16 / bfloat16. On cpu the GEMM is emulated
and both paths run the same NumPy formulas (bit-equal); with FLAME_DEVICE=cuda the fused kernels run."""
import ml_dtypes
import numpy as np
import pytest
from offload_helpers import npy

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F
from flame_core import backend
from flame_core.amp import autocast
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import activations as KA
from flame_core.kernels import fp8_gelu as G
from flame_core.kernels import fp8_tensor as T
from flame_nn import adapters as A
from flame_nn.offload import fp8_compute as FC
from flame_nn.offload import quantize_linear_weights_, set_fp8_scaling_

DTYPES = {"float32": flame.float32, "float16": flame.float16, "bfloat16": flame.bfloat16}


def _cuda(device):
    return flame.device(device).type == "cuda"


def _mlp(device, d=32, hidden=96, seed=0, scaling="delayed", bias=True):
    """fc1 (d -> hidden), fc2 (hidden -> d): frozen fp8-compute Linears (bf16 compute) with `scaling`."""
    rng = np.random.default_rng(seed)
    fc1 = nn.Linear(d, hidden, bias=bias, device=device, dtype=flame.bfloat16)
    fc2 = nn.Linear(hidden, d, bias=bias, device=device, dtype=flame.bfloat16)
    with flame.no_grad():
        for lin in (fc1, fc2):
            lin.weight.copy_(flame.tensor(0.2 * rng.standard_normal(tuple(lin.weight.shape)), dtype=flame.bfloat16,
                                          device=device))
            if bias:
                lin.bias.copy_(flame.tensor(0.5 * rng.standard_normal(lin.out_features), dtype=flame.bfloat16,
                                            device=device))
    seq = nn.Sequential(fc1, fc2)
    seq.requires_grad_(False)
    quantize_linear_weights_(seq, compute="fp8")
    if scaling == "delayed":
        set_fp8_scaling_(seq, "delayed", history=3)
    return fc1, fc2


def _states(*layers):
    out = []
    for lin in layers:
        sites = lin.__dict__["_fp8_sites"]
        out += [npy(flame.tensor(s.state)) for s in (sites.x, sites.dy)]
    return out


def _run(fc1, fc2, x, fused, monkeypatch):
    monkeypatch.setattr(FC, "FUSED_MLP", fused)
    xt = x.detach().requires_grad_(True)
    y = fc1.forward_gelu_mlp(xt, fc2, approximate="tanh")
    assert (y.grad_fn.name() == "Float8ComputeGeluMlpBackward") is fused
    (y.float() * y.float()).sum().backward()
    return npy(y), npy(xt.grad)


def test_fused_mlp_matches_the_composed_layers_over_delayed_steps(device, monkeypatch):
    """Steps 1-4: the first call of every site scales by its own amax, later ones by the history; the fused node
    gives the composed layers' outputs, input gradients and site histories (bit-equal on cpu)."""
    fused, composed = _mlp(device), _mlp(device)
    rng = np.random.default_rng(3)
    for step in range(4):
        x = flame.tensor(rng.standard_normal((2, 7, 32)) * (1 + step), dtype=flame.bfloat16, device=device)
        y1, g1 = _run(*fused, x, True, monkeypatch)
        y2, g2 = _run(*composed, x, False, monkeypatch)
        if _cuda(device):   # the kernels' roundings are the composed ones'; a value on an e4m3 tie may still differ
            for a, b in ((y1, y2), (g1, g2)):
                assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), f"step {step}"
            for a, b in zip(_states(*fused), _states(*composed)):
                np.testing.assert_allclose(a, b, rtol=1e-2, err_msg=f"step {step}")
        else:
            np.testing.assert_array_equal(y1, y2, err_msg=f"step {step}")
            np.testing.assert_array_equal(g1, g2, err_msg=f"step {step}")
            for a, b in zip(_states(*fused), _states(*composed)):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


def test_fused_mlp_under_autocast_and_without_grad(device, monkeypatch):
    fc1, fc2 = _mlp(device, bias=False)
    ref1, ref2 = _mlp(device, bias=False)
    x = flame.tensor(np.random.default_rng(4).standard_normal((5, 32)), dtype=flame.float32, device=device)
    with flame.no_grad():
        with autocast(flame.device(device).type, dtype=flame.bfloat16):
            y = fc1.forward_gelu_mlp(x, fc2, approximate="tanh")
        assert y.dtype == flame.bfloat16 and y.grad_fn is None
        monkeypatch.setattr(FC, "FUSED_MLP", False)
        want = ref2(F.gelu(ref1(x.to(flame.bfloat16)), approximate="tanh"))
    if _cuda(device):
        assert np.linalg.norm(npy(y) - npy(want)) <= 1e-3 * np.linalg.norm(npy(want))
    else:
        np.testing.assert_array_equal(npy(y), npy(want))


def test_the_fused_mlp_only_where_it_keeps_the_layers_semantics(device):
    x = flame.tensor(np.random.default_rng(5).standard_normal((3, 32)), dtype=flame.bfloat16, device=device)

    def node(fc1, fc2):
        return fc1.forward_gelu_mlp(x, fc2, approximate="tanh").grad_fn.name()

    fused = "Float8ComputeGeluMlpBackward"
    x.requires_grad_(True)
    assert node(*_mlp(device)) == fused
    assert node(*_mlp(device, scaling="current")) != fused          # current scaling: the layers' own grid barrier
    fc1, fc2 = _mlp(device)
    seen = []
    fc2.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    assert node(fc1, fc2) != fused and seen == [(3, 32)]             # a hook sees fc2's call
    fc1, fc2 = _mlp(device)
    fc1.bias.requires_grad_(True)                                    # a trained bias needs dh in the compute dtype
    assert node(fc1, fc2) != fused
    fc1, fc2 = _mlp(device)
    A.adapt(fc2)
    fc2.add_adapter("default", A.LoRA(96, 32, rank=2, dtype=flame.bfloat16, device=device))
    assert node(fc1, fc2) != fused                                  # an adapter needs fc2's input in bf16
    plain1 = nn.Linear(32, 96, device=device, dtype=flame.bfloat16)
    plain2 = nn.Linear(96, 32, device=device, dtype=flame.bfloat16)
    assert node(plain1, plain2) != fused                            # not fp8: the layers' calls
    fc1, fc2 = _mlp(device)
    with pytest.raises(ShapeError, match="do not fit"):
        fc1.forward_gelu_mlp(x, _mlp(device, hidden=64)[1], approximate="tanh")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (33, 24), (257, 40), (5, 1031)])
def test_gelu_casts_match_the_composed_ops(device, dtype, shape):
    """gelu_quantize_delayed / _with_scale / gelu_grad_quantize_delayed against quantize_delayed of the composed
    GELU ops on ragged shapes (the kernels' vector and tail paths; odd sizes misalign nothing: the arrays are new)."""
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    dt = DTYPES[dtype]
    h = flame.tensor(rng.standard_normal(shape) * 3, dtype=dt, device=device)._data
    dg = flame.tensor(rng.standard_normal(shape), dtype=dt, device=device)._data
    for approx in ("tanh", "none"):
        a, b = T.DelayedScaling(4), T.DelayedScaling(4)
        for step in range(3):          # step 0: current scaling (the history starts); then the kernels
            scale = 1 + step
            hs = h * scale
            got = G.gelu_quantize_delayed(hs, a, approx)
            want = T.quantize_delayed(KA.gelu_forward(hs, approx), b)
            _same_cast(got, want, device, f"{approx} forward step {step}")
            got = G.gelu_grad_quantize_delayed(dg, hs, a, approx)
            want = T.quantize_delayed(KA.gelu_backward(dg, hs, approx), b)
            _same_cast(got, want, device, f"{approx} backward step {step}")
            np.testing.assert_allclose(backend.to_numpy(a.state), backend.to_numpy(b.state), rtol=1e-2)
        pair = backend.xp_of(h).asarray(np.array([0.25, 4.0], np.float32))
        got = G.gelu_quantize_with_scale(h, pair, approx)
        want = T.quantize_with_scale(KA.gelu_forward(h, approx), pair)
        _same_cast(got, want, device, f"{approx} with a fixed pair")


def _same_cast(got, want, device, what):
    """The e4m3 codes equal -- on cuda, up to one code step in at most 0.1% of the elements (a GELU value that
    rounds across an e4m3 tie) -- and the pairs used equal."""
    (qa, sa), (qb, sb) = got, want
    qa, qb = backend.to_numpy(qa), backend.to_numpy(qb)
    assert qa.dtype == np.uint8 and qa.shape == qb.shape, what
    np.testing.assert_array_equal(backend.to_numpy(sa), backend.to_numpy(sb), err_msg=what)
    if not _cuda(device):
        np.testing.assert_array_equal(qa, qb, err_msg=what)
        return
    va = qa.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vb = qb.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    off = va != vb
    assert off.mean() <= 1e-3 or off.sum() <= 1, f"{what}: {off.sum()} of {off.size} codes differ"
    assert (np.abs(qa.astype(np.int16) - qb.astype(np.int16))[off] <= 1).all(), what


def test_gelu_casts_check_their_arguments(device):
    h = flame.tensor(np.ones((2, 3)), dtype=flame.bfloat16, device=device)._data
    site = T.DelayedScaling()
    with pytest.raises(ValueError, match="approximate"):
        G.gelu_quantize_delayed(h, site, "exact")
    with pytest.raises(DTypeError, match="one dtype"):
        G.gelu_grad_quantize_delayed(h.astype(np.float32), h, site)
    with pytest.raises(ShapeError, match="differ"):
        G.gelu_grad_quantize_delayed(h[:1], h, site)
    with pytest.raises(DTypeError, match="float16/bfloat16/float32"):
        G.gelu_quantize_delayed(h.astype(np.float64), site)
    assert site.state is None   # nothing ran


def _linear2(device, n_in, n_out, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    lin = nn.Linear(n_in, n_out, bias=bias, device=device, dtype=flame.bfloat16)
    with flame.no_grad():
        lin.weight.copy_(flame.tensor(0.2 * rng.standard_normal((n_out, n_in)), dtype=flame.bfloat16, device=device))
        if bias:
            lin.bias.copy_(flame.tensor(rng.standard_normal(n_out), dtype=flame.bfloat16, device=device))
    lin.requires_grad_(False)
    quantize_linear_weights_(lin, compute="fp8")
    set_fp8_scaling_(lin, "delayed", history=3)
    return lin


@pytest.mark.parametrize("train_bias,approx", [(False, "tanh"), (True, "tanh"), (False, "none")])
def test_fused_cat2_gelu_matches_the_composed_ops_over_delayed_steps(device, monkeypatch, train_bias, approx):
    """linear2(cat(a, gelu(h))) with h a column block of a wider output (read in place), as Flux's single blocks
    run it: the fused node against forward_cat2 of (a, F.gelu(h)) -- outputs, da, dh, the bias gradient and the
    sites' histories over 4 steps (bit-equal on cpu)."""
    fused, composed = _linear2(device, 40, 24), _linear2(device, 40, 24)
    for lin in (fused, composed):
        lin.bias.requires_grad_(train_bias)
    rng = np.random.default_rng(8)
    for step in range(4):
        a0 = rng.standard_normal((2, 5, 16)) * (1 + step)
        w0 = rng.standard_normal((2, 5, 48)) * (1 + step)          # (.., 48): h is columns 16:40 of it
        results = []
        for lin, on in ((fused, True), (composed, False)):
            monkeypatch.setattr(FC, "FUSED_MLP", on)
            a = flame.tensor(a0, dtype=flame.bfloat16, device=device, requires_grad=True)
            wide = flame.tensor(w0, dtype=flame.bfloat16, device=device, requires_grad=True)
            h = wide[..., 16:40]
            lin.bias.grad = None
            y = lin.forward_cat2_gelu(a, h, approximate=approx)
            assert (y.grad_fn.name() == "Float8ComputeCat2GeluBackward") is on
            (y.float() * y.float()).sum().backward()
            results.append([npy(y), npy(a.grad), npy(wide.grad)] + ([npy(lin.bias.grad)] if train_bias else []))
        for i, (x1, x2) in enumerate(zip(*results)):
            if _cuda(device):
                assert np.linalg.norm(x1 - x2) <= 1e-3 * np.linalg.norm(x2), f"step {step} output {i}"
            else:
                np.testing.assert_array_equal(x1, x2, err_msg=f"step {step} output {i}")
        for x1, x2 in zip(_states(fused), _states(composed)):
            if _cuda(device):
                np.testing.assert_allclose(x1, x2, rtol=1e-2, err_msg=f"step {step}")
            else:
                np.testing.assert_array_equal(x1, x2, err_msg=f"step {step}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,ca,ch,ld", [(1, 8, 8, 8), (7, 16, 24, 40), (33, 5, 11, 19), (64, 32, 96, 160),
                                           (3, 8, 8, 12)])
def test_cat_gelu_casts_match_the_composed_ops(device, dtype, rows, ca, ch, ld):
    """cat_gelu_quantize_delayed / _with_scale against quantize_parts_delayed of [a, gelu(h)], h (rows, ch) read
    from a wider (rows, ld) array at column 1 or 0 (vector and element-wise paths)."""
    rng = np.random.default_rng(rows * 1000 + ca * 10 + ch)
    dt = DTYPES[dtype]
    a = flame.tensor(rng.standard_normal((rows, ca)), dtype=dt, device=device)._data
    wide = flame.tensor(rng.standard_normal((rows, ld)) * 3, dtype=dt, device=device)._data
    c0 = 0 if (ld - ch) % 8 else ld - ch          # a multiple-of-8 offset where the row length allows it
    h = wide[:, c0:c0 + ch]
    for approx in ("tanh", "none"):
        s1, s2 = T.DelayedScaling(4), T.DelayedScaling(4)
        for step in range(3):
            got = G.cat_gelu_quantize_delayed(a * (1 + step), h, s1, approx)
            want = T.quantize_parts_delayed([a * (1 + step), KA.gelu_forward(h, approx)], s2)
            _same_cast(got, want, device, f"{approx} step {step}")
            np.testing.assert_allclose(backend.to_numpy(s1.state), backend.to_numpy(s2.state), rtol=1e-2)
        pair = backend.xp_of(a).asarray(np.array([0.5, 2.0], np.float32))
        _same_cast(G.cat_gelu_quantize_with_scale(a, h, pair, approx),
                   T.quantize_parts_with_scale([a, KA.gelu_forward(h, approx)], pair), device, f"{approx} fixed pair")
    with pytest.raises(ShapeError, match="one row count"):
        G.cat_gelu_quantize_delayed(a, wide[None], T.DelayedScaling())


def test_the_fused_entry_points_call_a_hooked_layer(device):
    """forward_split / forward_cat2 / forward_cat2_gelu on a layer with a forward hook go through the layer's call
    (the fused nodes would bypass the hook), for plain and fp8-compute Linears alike."""
    x = flame.tensor(np.ones((2, 16)), dtype=flame.bfloat16, device=device)
    for make in (lambda n_in, n_out: nn.Linear(n_in, n_out, device=device, dtype=flame.bfloat16),
                 lambda n_in, n_out: _linear2(device, n_in, n_out)):
        seen = []
        lin = make(16, 12)
        lin.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
        assert [tuple(p.shape) for p in lin.forward_split(x, (4, 8))] == [(2, 4), (2, 8)] and seen == [(2, 12)]
        lin2 = make(32, 12)
        lin2.register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
        lin2.forward_cat2(x, x)
        lin2.forward_cat2_gelu(x, x, approximate="tanh")
        assert seen[1:] == [(2, 32), (2, 32)]
