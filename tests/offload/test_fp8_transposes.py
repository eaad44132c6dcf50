"""Resident W^T for fp8-compute Linears (flame_nn.offload.cache_fp8_transposes_): outputs and gradients bit for bit
those of the per-call transpose, every backward transpose gone once cached (the plain, split / fused-LoRA and
forward_cat2 paths), a replaced / rebound / modified weight falling back to the scratch, enabled=False freeing the
caches, and blocks a BlockStreamer streams never cached. On cpu the GEMM is emulated."""
import gc
import sys
import weakref

import numpy as np
import pytest
from offload_helpers import flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
import flame_nn as nn
from flame_core.amp import autocast
from flame_nn import adapters as A
from flame_nn.offload import BlockStreamer, OffloadError, cache_fp8_transposes_, is_fp8_linear, quantize_linear_weights_
from flame_nn.offload import fp8 as F8
from flame_nn.offload import fp8_transposes as FT
from flame_nn.parameter import Parameter


@pytest.fixture
def scratch_calls(monkeypatch):
    """The number of transposes written into the scratch buffer (fp8.transposed_into_scratch calls), and which
    backward asked for a transpose, cached or not ({Function qualname: calls})."""
    calls = {"scratch": 0, "by": {}}
    real_scratch, real_wt = F8.transposed_into_scratch, FT.weight_transposed

    def scratch(q):
        calls["scratch"] += 1
        return real_scratch(q)

    def wt(q, cache):
        who = sys._getframe(1).f_code.co_qualname
        calls["by"][who] = calls["by"].get(who, 0) + 1
        return real_wt(q, cache)
    monkeypatch.setattr(F8, "transposed_into_scratch", scratch)
    monkeypatch.setattr(FT, "weight_transposed", wt)
    return calls


def _fp8_flux(device, ckpt):
    model = tiny_flux(device, lora=True)
    for stack in (model.double_blocks, model.single_blocks):
        quantize_linear_weights_(stack, compute="fp8")
    model.enable_gradient_checkpointing(ckpt)
    model.train()
    return model


def _step(model, device):
    args = flux_inputs(device, height=64, width=64, n_txt=8, seed=3)
    args["img"].requires_grad_(True)
    for p in A.adapter_parameters(model):
        p.grad = None
    with autocast(flame.device(device).type, dtype=flame.bfloat16):
        out = model(**args)
    (out.float() * out.float()).mean().backward()
    return npy(out), npy(args["img"].grad), [npy(p.grad) for p in A.adapter_parameters(model)]


@pytest.mark.parametrize("ckpt", [False, True])
def test_cached_transposes_give_the_same_bits_and_replace_every_scratch_transpose(device, scratch_calls, ckpt):
    plain, cached = _fp8_flux(device, ckpt), _fp8_flux(device, ckpt)
    fp8 = [m for m in cached.modules() if is_fp8_linear(m)]
    held = cache_fp8_transposes_(cached)
    assert held == sum(m.weight.numel() for m in fp8) > 0           # one byte per weight, every fp8 Linear
    assert sorted(FT.cached_transposes(cached)) == sorted(n for n, m in cached.named_modules() if is_fp8_linear(m))
    assert cache_fp8_transposes_(cached) == held                     # valid caches are kept, not made again

    out0, dimg0, g0 = _step(plain, device)
    uncached = scratch_calls["scratch"]
    assert uncached > 0
    scratch_calls["by"].clear()
    for _ in range(2):
        out1, dimg1, g1 = _step(cached, device)
        np.testing.assert_array_equal(out1, out0)
        np.testing.assert_array_equal(dimg1, dimg0)                  # the input gradient through every block
        assert len(g1) == len(g0) > 0
        for a, b in zip(g1, g0):
            np.testing.assert_array_equal(a, b)
    assert scratch_calls["scratch"] == uncached                       # no transpose in the cached model's steps
    assert set(scratch_calls["by"]) == {"Float8ComputeLinear.backward", "Float8ComputeLowRank.backward",
                                        "_cat2_backward"}  # plain, split / fused LoRA, forward_cat2 (its backward's)


def _fp8_linear(device, seed=0, n_in=32, n_out=48):
    rng = np.random.default_rng(seed)
    lin = nn.Linear(n_in, n_out, bias=False, device=device)   # (a replaced weight is the layer's only difference)
    with flame.no_grad():
        lin.weight.copy_(flame.tensor(rng.standard_normal((n_out, n_in)), device=device))
    lin.requires_grad_(False)
    quantize_linear_weights_(lin, compute="fp8")
    return lin


def _dx(lin, device, seed=1):
    x = flame.tensor(np.random.default_rng(seed).standard_normal((8, lin.in_features)), dtype=flame.float32,
                     device=device, requires_grad=True)
    (lin(x) ** 2).sum().backward()
    return npy(x.grad)


def test_a_replaced_rebound_or_modified_weight_falls_back_to_the_scratch(device, scratch_calls):
    lin, other = _fp8_linear(device), _fp8_linear(device, seed=7)
    assert cache_fp8_transposes_(lin) == 32 * 48
    ref = _dx(lin, device)
    assert scratch_calls["scratch"] == 0
    # replaced by another quantised weight (a new Parameter): the stale cache is not read
    lin.weight, lin.weight_scale = Parameter(other.weight.detach(), requires_grad=False), other.weight_scale
    np.testing.assert_array_equal(_dx(lin, device), _dx(other, device))
    assert scratch_calls["scratch"] == 2
    assert not np.array_equal(_dx(lin, device), ref)
    # made again for the new weight by a second call
    cache_fp8_transposes_(lin)
    n = scratch_calls["scratch"]
    np.testing.assert_array_equal(_dx(lin, device), _dx(other, device))
    assert scratch_calls["scratch"] == n + 1                           # only `other`'s backward transposed
    # the same bytes in a new array (as the streamer's bind does), or the version counter moved: not the source
    arr = lin.weight.array
    lin.weight.set_array_(arr.copy())
    _dx(lin, device)
    assert scratch_calls["scratch"] == n + 2
    cache_fp8_transposes_(lin)
    lin.weight._version[0] += 1
    _dx(lin, device)
    assert scratch_calls["scratch"] == n + 3


def test_disabled_drops_the_caches_and_frees_their_memory(device, scratch_calls):
    lin = _fp8_linear(device)
    assert cache_fp8_transposes_(lin) == 32 * 48
    tensor = FT.cached_transposes(lin)[""].tensor
    gone = weakref.ref(tensor)
    del tensor
    assert cache_fp8_transposes_(lin, enabled=False) == 0
    assert FT.cached_transposes(lin) == {} and "_fp8_wt" not in lin.__dict__
    gc.collect()
    assert gone() is None                                              # nothing else holds the transpose
    _dx(lin, device)
    assert scratch_calls["scratch"] == 1                               # back to the per-call transpose


def test_only_fp8_compute_linears_are_cached(device):
    lin = nn.Linear(16, 8, device=device)
    lin.requires_grad_(False)
    assert cache_fp8_transposes_(lin) == 0                            # not fp8
    quantize_linear_weights_(lin)                                      # fp8 storage, dequantising
    assert cache_fp8_transposes_(lin) == 0 and FT.cached_transposes(lin) == {}
    quantize_linear_weights_(lin, compute="fp8")
    assert cache_fp8_transposes_(lin) == 16 * 8
    meta = _fp8_linear(device)
    meta.weight._meta_device = flame.device(device)                    # as empty_init leaves it: no data yet
    assert meta.weight.is_meta
    with pytest.raises(OffloadError, match="weight has no data yet"):
        cache_fp8_transposes_(meta)


@pytest.mark.parametrize("resident", [(), (1, 3), (0, 1, 2, 3, 4)])
def test_streamed_blocks_are_not_cached_and_give_the_same_numbers(device, scratch_calls, resident):
    ref, net = stack_pair(device=device)
    for m in (ref, net):
        m.blocks.requires_grad_(False)
    BlockStreamer(ref.blocks, resident=resident, device=device, quantize="fp8", fp8_compute=True)
    st = BlockStreamer(net.blocks, resident=resident, device=device, quantize="fp8", fp8_compute=True)
    held = cache_fp8_transposes_(net)
    assert sorted(FT.cached_transposes(net)) == sorted(f"blocks.{i}.{fc}" for i in resident for fc in ("fc1", "fc2"))
    assert held == len(resident) * 2 * 16 * 32
    x = flame.randn(4, 16, device=device)

    def step(model):
        for p in model.parameters():
            p.grad = None
        y = model(x)
        (y * y).sum().backward()
        return npy(y), {k: npy(p.grad) for k, p in model.named_parameters() if p.requires_grad}
    y0, g0 = step(ref)
    n_ref = scratch_calls["scratch"]
    assert n_ref == 2 * 5                                               # every block's two Linears, uncached
    for _ in range(2):
        y1, g1 = step(net)
        np.testing.assert_array_equal(y1, y0)
        assert sorted(g1) == sorted(g0)
        for k in g0:
            np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    assert scratch_calls["scratch"] - n_ref == 2 * 2 * (5 - len(resident))   # two steps: the streamed ones only
    # a block demoted from resident (set_resident): its cache is freed (its weights now come through a slot)
    if resident:
        st.set_resident(resident[1:])
        assert not any(k.startswith(f"blocks.{resident[0]}.") for k in FT.cached_transposes(net))
        before = scratch_calls["scratch"]
        y2, _ = step(net)
        np.testing.assert_array_equal(y2, y0)
        assert scratch_calls["scratch"] - before == 2 * (5 - len(resident) + 1)
        cache_fp8_transposes_(net)
        assert sorted(FT.cached_transposes(net)) == sorted(f"blocks.{i}.{fc}" for i in resident[1:]
                                                           for fc in ("fc1", "fc2"))
        # auto_fit's demote (a failed capture, growth outside the pool) goes through set_resident too
        from flame_nn.offload.autofit import demote
        if len(resident) > 1:
            gone = demote(st, fraction=0.01)
            assert len(gone) == 1
            assert not any(k.startswith(f"blocks.{gone[0]}.") for k in FT.cached_transposes(net))
            assert len(FT.cached_transposes(net)) == 2 * (len(resident) - 2)
