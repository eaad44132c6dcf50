"""The fp8 dequantisation scratch lives as long as fp8 Linears need it: released with the last one, trimmed to the
largest live one (free_model does it), and a captured CUDA graph keeps the buffer it was captured with."""
import gc

import numpy as np
import pytest
from offload_helpers import npy

import flame_core as flame
import flame_nn as nn
from flame_nn.offload import fp8 as F8
from flame_nn.offload import quantize_linear_weights_, stack_fp8_weights_


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """A registry of its own (fp8 Linears of earlier tests still alive in this process size nothing here) and no
    scratch, before and after."""
    gc.collect()
    F8.release_scratch()
    monkeypatch.setattr(F8, "registry", F8.Registry())
    yield
    gc.collect()
    F8.release_scratch()


def _layer(n_in, n_out, device):
    m = nn.Linear(n_in, n_out, bias=False, device=device)
    m.requires_grad_(False)
    quantize_linear_weights_(m)
    return m


def _bytes(device):
    key = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    return {d: b for (k, d), b in F8.scratch_buffers().items() if k == key}


def test_the_scratch_goes_with_the_last_fp8_linear_and_shrinks_to_the_largest_live_one(device):
    big, small = _layer(64, 96, device), _layer(16, 24, device)
    x = flame.randn(3, 64, device=device)
    ref_small = npy(small(flame.randn(2, 16, device=device)))
    big(x)
    assert _bytes(device) == {"float32": 4 * 64 * 96}  # sized for the largest layer
    del big
    gc.collect()
    assert _bytes(device) == {}  # trimmed to what the live layer needs: nothing until its next call
    out = small(flame.randn(2, 16, device=device))
    assert _bytes(device) == {"float32": 4 * 16 * 24}  # made again, for the live layer only
    assert out.shape == (2, 24) and np.isfinite(npy(out)).all() and ref_small.shape == (2, 24)
    assert F8.trim_scratch() == 0  # already the right size
    del small, out
    gc.collect()
    assert F8.scratch_buffers() == {} and F8.registry.n == 0  # the last one: released without asking


def test_trimming_keeps_the_stacked_size_of_stacked_layers(device):
    """Layers re-pointed at one stacked weight (q, k, v) need the stacked weight's size: trimming keeps it."""
    qkv = [_layer(32, 40, device) for _ in range(3)]
    q, scales = stack_fp8_weights_(qkv)
    x = flame.randn(2, 32, device=device)
    want = npy(F8.fp8_linear(x, q, scales, None, flame.float32))
    other = _layer(128, 8, device)  # larger than one block, smaller than the stack
    del other
    gc.collect()
    F8.trim_scratch()
    assert F8._largest[F8._device_key(q.array)] == 3 * 32 * 40
    got = npy(F8.fp8_linear(x, q, scales, None, flame.float32))
    np.testing.assert_array_equal(got, want)
    assert _bytes(device) == {"float32": 4 * 3 * 32 * 40}


def test_freeing_a_model_trims_the_scratch_to_the_fp8_layers_left(device):
    """The pipelines' `free_model(net); del net` while another model keeps fp8 Linears (an fp8 text encoder)."""
    from flame_models.pipeline.placement import free_model
    keep = _layer(8, 8, device)
    model = nn.Sequential(_layer(48, 64, device), nn.ReLU(), _layer(64, 48, device))
    model(flame.randn(2, 48, device=device))
    keep(flame.randn(1, 8, device=device))
    assert _bytes(device) == {"float32": 4 * 48 * 64}
    free_model(model)
    del model
    gc.collect()
    assert _bytes(device) == {}  # the live layer's next call makes a buffer of its own size
    keep(flame.randn(1, 8, device=device))
    assert _bytes(device) == {"float32": 4 * 8 * 8}
    assert F8.registry.n == 1 and F8._largest == {F8._device_key(keep.weight.array): 8 * 8}


@pytest.mark.gpu
def test_a_captured_graph_keeps_the_scratch_it_was_captured_with():
    """Release the scratch after capturing an fp8 layer, fill the freed memory with other data, replay: the graph's
    output is still the layer's (the graph holds the buffer its kernels write; before, only a list that
    release_scratch also cleared did)."""
    from flame_core.cuda import CUDAGraph, graph
    device = flame.device("cuda")
    lin = _layer(256, 384, device)
    x = flame.randn(8, 256, device=device)
    want = npy(lin(x))
    g = CUDAGraph()
    with graph(g):
        static = lin(x)
    F8.release_scratch()
    assert F8.scratch_buffers() == {}
    junk = [flame.full((256 * 384,), float("nan"), device=device) for _ in range(4)]  # reuses freed blocks
    g.replay()
    flame.cuda.synchronize()
    np.testing.assert_array_equal(npy(static), want)
    lin(flame.randn(8, 256, device=device))  # eager work gets a buffer of its own again
    g.replay()
    flame.cuda.synchronize()
    np.testing.assert_array_equal(npy(static), want)
    del junk
