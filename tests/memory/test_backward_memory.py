"""Backward releases memory as it goes (32-layer MLP): afterwards allocated is back at the pre-forward level plus
the gradients, and backward's peak stays within forward's peak plus one layer's activations."""
import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
from flame_core import grad_pool

from .conftest import storage

L, B, D = 32, 64, 32


def make_mlp(device, pooled):
    rng = np.random.default_rng(0)
    ws = [flame.tensor(rng.standard_normal((D, D)) / np.sqrt(D), dtype=flame.float32, device=device,
                       requires_grad=True) for _ in range(L)]
    if pooled:
        grad_pool.register(ws)
    x = flame.tensor(rng.standard_normal((B, D)), dtype=flame.float32, device=device)
    return ws, x


def forward(x, ws, trace=None):
    h = x
    for w in ws:
        h = (h @ w).relu()  # one layer: a matmul output and a relu output, (B, D) each
        if trace is not None:
            trace.append(M.memory_allocated(x.device))
    return h.sum()


def clear(ws, pooled):
    if pooled:
        grad_pool.zero_grad(ws, set_to_none=True)
    for w in ws:
        w.grad = None


@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "grad_pool"])
def test_allocated_returns_to_pre_forward_plus_gradients(device, pooled, no_gc):
    ws, x = make_mlp(device, pooled)
    forward(x, ws).backward()  # warm-up (lazy library workspaces)
    clear(ws, pooled)
    a0 = M.memory_allocated(device)
    loss = forward(x, ws)
    assert M.memory_allocated(device) > a0 + L * B * D * 4  # the saved activations
    loss.backward()
    del loss
    grads = 0 if pooled else sum(storage(w.nbytes, device) for w in ws)  # pooled: already in a0
    assert M.memory_allocated(device) == a0 + grads
    assert all(w.grad is not None for w in ws)


@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "grad_pool"])
def test_backward_peak_within_forward_peak_plus_one_layer(device, pooled, no_gc):
    ws, x = make_mlp(device, pooled)
    forward(x, ws).backward()
    clear(ws, pooled)
    one_layer = 2 * storage(B * D * 4, device)  # the two (B, D) float32 activations one layer produces
    M.reset_peak_memory_stats(device)
    trace = []
    loss = forward(x, ws, trace)
    fwd_peak = M.max_memory_allocated(device)
    kept = np.diff(trace)  # per layer, forward keeps one activation (the relu output backward needs)
    assert kept.min() >= storage(B * D * 4, device)
    M.reset_peak_memory_stats(device)
    loss.backward()
    bwd_peak = M.max_memory_allocated(device)
    assert bwd_peak <= fwd_peak + one_layer, (bwd_peak - fwd_peak, one_layer)
    del loss
