"""fp8 compute with delayed scaling (flame_nn.offload.set_fp8_scaling_): its checks, the first step equal to current
scaling, later steps close to it, and a checkpointed recompute repeating its forward's scale (the gradients and the
histories equal those of the same model run without checkpointing). On cpu the GEMM is emulated."""
import numpy as np
import pytest
from offload_helpers import flux_inputs, npy, tiny_flux

import flame_core as flame
import flame_nn as nn
from flame_core.amp import autocast
from flame_nn import adapters as A
from flame_nn.offload import OffloadError, quantize_linear_weights_, set_fp8_scaling_
from flame_nn.offload import fp8_compute as FC


def _model(device, scaling, ckpt=False):
    model = tiny_flux(device, lora=True)
    for stack in (model.double_blocks, model.single_blocks):
        quantize_linear_weights_(stack, compute="fp8")
    if scaling == "delayed":
        set_fp8_scaling_(model, "delayed", history=4)
    model.enable_gradient_checkpointing(ckpt)
    model.train()
    return model


def _step(model, device, seed):
    args = flux_inputs(device, height=64, width=64, n_txt=8, seed=seed)
    for p in A.adapter_parameters(model):
        p.grad = None
    with autocast(flame.device(device).type, dtype=flame.bfloat16):
        out = model(**args)
    (out.float() * out.float()).mean().backward()
    return npy(out), [npy(p.grad) for p in A.adapter_parameters(model)]


def _sites(model):
    return [m.__dict__["_fp8_sites"] for _, m in model.named_modules() if m.__dict__.get("_fp8_sites")]


def test_set_fp8_scaling_checks_its_arguments_and_refuses_a_model_without_fp8_compute(device):
    lin = nn.Linear(16, 8, device=device)
    lin.requires_grad_(False)
    with pytest.raises(OffloadError, match="no fp8-compute Linear"):
        set_fp8_scaling_(lin)
    quantize_linear_weights_(lin)                                # fp8 storage, dequantising: still not fp8 compute
    with pytest.raises(OffloadError, match="no fp8-compute Linear"):
        set_fp8_scaling_(lin)
    quantize_linear_weights_(lin, compute="fp8")
    with pytest.raises(OffloadError, match="scaling must be one of"):
        set_fp8_scaling_(lin, "sometimes")
    with pytest.raises(OffloadError, match="history"):
        set_fp8_scaling_(lin, history=0)
    assert set_fp8_scaling_(lin, "delayed") == [""] and "delayed scaling" in repr(lin)
    assert set_fp8_scaling_(lin, "current") == [""] and "delayed" not in repr(lin)
    assert FC.SCALINGS == ("current", "delayed")


def test_delayed_equals_current_while_the_range_holds_and_stays_close_when_it_moves(device):
    """The first call of every site scales by its own amax (current scaling); the same batch again finds the same
    amax in the history, so three steps on one batch equal current scaling bit for bit. A batch of another range
    then casts with the old factor: close to current scaling, finite."""
    cur, dly = _model(device, "current"), _model(device, "delayed")
    sites = _sites(dly)
    assert sites and all(s.x.state is None for s in sites)
    exact = flame.device(device).type == "cpu"
    for _ in range(3):
        out_c, g_c = _step(cur, device, 1)
        out_d, g_d = _step(dly, device, 1)
        if exact:
            np.testing.assert_array_equal(out_d, out_c)
            for a, b in zip(g_d, g_c):
                np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(out_d, out_c, rtol=2e-2, atol=1e-3)
    assert all(s.x.state is not None for s in sites)     # forward_cat2's two inputs too: one site
    assert any(s.dy.state is not None for s in sites)   # output gradients of single-tensor layers use it too
    out_c, g_c = _step(cur, device, 2)
    out_d, g_d = _step(dly, device, 2)
    assert np.isfinite(out_d).all() and all(np.isfinite(g).all() for g in g_d)
    assert np.linalg.norm(out_d - out_c) / np.linalg.norm(out_c) < 0.15
    cos = [float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(g_d, g_c)]
    assert np.median(cos) > 0.9, cos


def test_a_checkpointed_recompute_repeats_its_forwards_scale(device):
    """The same model with and without checkpointing, delayed scaling, three steps of different inputs: the recompute
    casts with the forward's pair and moves no history, so outputs, gradients and every site's history agree (bit for
    bit on cpu)."""
    plain, ckpt = _model(device, "delayed"), _model(device, "delayed", ckpt=True)
    for seed in (1, 2, 3):
        out_p, g_p = _step(plain, device, seed)
        out_c, g_c = _step(ckpt, device, seed)
        tol = dict(rtol=0, atol=0) if flame.device(device).type == "cpu" else dict(rtol=2e-2, atol=1e-3)
        np.testing.assert_allclose(out_c, out_p, **tol)
        for a, b in zip(g_c, g_p):
            np.testing.assert_allclose(a, b, **tol)
    compared = 0
    for sp, sc in zip(_sites(plain), _sites(ckpt)):
        assert (sp.x.state is None) == (sc.x.state is None)
        if sp.x.state is not None:   # one history entry per forward: the recompute added none
            np.testing.assert_allclose(npy(flame.tensor(sc.x.state)), npy(flame.tensor(sp.x.state)), **tol)
            assert int((npy(flame.tensor(sp.x.state))[3:] > 0).sum()) == 3
            compared += 1
    assert compared > 0
