"""BlockStreamer: streamed equals resident (forward and backward, MLP stack and tiny Flux with LoRA), the prefetch
schedule, slot reuse without new allocations, the budget, inference from memory-mapped files, close()."""
import numpy as np
import pytest
from offload_helpers import LazyCopyEngine, assert_same, flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
import flame_core.memory as M
import flame_nn as nn
from flame_core.amp import autocast
from flame_nn import adapters as A
from flame_nn.offload import BlockStreamer, OffloadError, safetensors_views
from flame_nn.offload import streamer as streamer_mod


def frozen_pair(device, d=16, n=5, trainable_gain=True):
    ref, net = stack_pair(d, n, device)
    for m in (ref, net):
        m.blocks.requires_grad_(False)
        for b in m.blocks:
            b.gain.requires_grad_(trainable_gain)  # a trainable tensor inside the blocks: it must stay on the GPU
    return ref, net


def loss_and_grads(model, x):
    for p in model.parameters():
        p.grad = None
    y = model(x)
    (y * y).sum().backward()
    return npy(y), {k: npy(p.grad) for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("resident", [(), (0, 3), (1, 2, 3, 4)])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_streamed_mlp_equals_resident_forward_and_backward(device, resident, slots):
    ref, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=resident, slots=slots, device=device)
    x = flame.randn(4, 16, device=device)
    for _ in range(2):  # the second step starts from the slots the first one left behind
        y0, g0 = loss_and_grads(ref, x)
        y1, g1 = loss_and_grads(net, x)
        assert_same(y1, y0, device)
        assert sorted(g1) == sorted(g0) and len(g0) == 4 + 5  # inp, out, and every block's gain
        for k in g0:
            assert_same(g1[k], g0[k], device, err_msg=k)
    with flame.no_grad():
        for _ in range(3):
            assert_same(npy(net(x)), npy(ref(x)), device)
    assert st.resident == sorted(resident)
    for b in net.blocks:  # the trainable gains never moved to the host
        assert b.gain.device == flame.device(device)


@pytest.mark.parametrize("resident", [(), (2,)])
def test_the_schedule_waits_for_every_copy_it_needs(device, resident):
    # copies run only when an event forces them: a missing wait would compute with another block's weights
    ref, net = frozen_pair(device, n=6)
    st = BlockStreamer(net.blocks, resident=resident, slots=2, device=device)
    st.engine = lazy = LazyCopyEngine(st.engine)
    x = flame.randn(4, 16, device=device)
    for _ in range(3):
        y0, g0 = loss_and_grads(ref, x)
        y1, g1 = loss_and_grads(net, x)
        assert_same(y1, y0, device)
        for k in g0:
            assert_same(g1[k], g0[k], device, err_msg=k)
    with flame.no_grad():
        assert_same(npy(net(x)), npy(ref(x)), device)
    assert lazy.done < len(lazy.queue)  # the last prefetch is still queued: nothing forced it early


def test_trainable_block_parameters_are_not_streamed(device):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, device=device)
    names = [e.name for e in st._host[0].entries]
    assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert st.block_bytes(0) == 2048 + 256 + 2048 + 256  # fp32 (32, 16), (32,), (16, 32), (16,) at 256-byte offsets
    assert st.slot_bytes == max(st.block_bytes(i) for i in range(5))


def test_streamed_weights_read_nan_outside_the_streamer(device):
    _, net = frozen_pair(device)
    BlockStreamer(net.blocks, resident=[1], device=device)
    w = npy(net.blocks[0].fc1.weight)
    assert w.shape == (32, 16) and np.isnan(w).all()        # a placeholder, no memory
    assert np.isfinite(npy(net.blocks[1].fc1.weight)).all()  # resident


def test_forward_schedule_prefetches_the_next_block_while_one_runs(device):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    st.trace = []
    x = flame.randn(2, 16, device=device)
    y = net(x)
    fwd = list(st.trace)
    # block i+1 is on its way before block i runs; the first block is loaded on demand
    assert fwd == [("run", 0), ("load", 0, 0), ("load", 1, 1), ("run", 1), ("load", 2, 0), ("run", 2),
                   ("load", 3, 1), ("run", 3), ("load", 4, 0), ("run", 4)]
    st.trace = []
    (y * y).sum().backward()
    # backward runs in reverse: blocks 4 and 3 are still in the slots, then i-1 is fetched while i runs
    assert st.trace == [("backward", 4), ("backward", 3), ("load", 2, 0), ("backward", 2), ("load", 1, 1),
                        ("backward", 1), ("load", 0, 0), ("backward", 0)]
    st.trace = []
    net(x)  # the next step finds blocks 0 and 1 where backward left them
    assert st.trace[:4] == [("run", 0), ("run", 1), ("load", 2, 0), ("run", 2)]


def test_schedule_skips_resident_blocks_and_prefetches_across_them(device):
    _, net = frozen_pair(device, n=6)
    st = BlockStreamer(net.blocks, resident=[1, 2], slots=2, device=device)
    st.trace = []
    net(flame.randn(2, 16, device=device))
    loads = [(e[1], k) for k, e in enumerate(st.trace) if e[0] == "load"]
    runs = {e[1]: k for k, e in enumerate(st.trace) if e[0] == "run"}
    assert [b for b, _ in loads] == [0, 3, 4, 5]
    assert dict(loads)[3] < runs[1]  # block 3 is fetched while the resident blocks 1 and 2 run
    assert runs[4] < dict(loads)[5] < runs[5]  # issued when block 4 starts, ahead of block 5


def test_inference_window_wraps_to_the_next_call(device):
    ref, net = frozen_pair(device, n=4)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    x = flame.randn(2, 16, device=device)
    with flame.no_grad():
        net(x)
        st.reset_stats()
        st.trace = []
        for _ in range(3):
            assert_same(npy(net(x)), npy(ref(x)), device)
    assert st.stats["loads"] == 3 * 4  # every block once per call: four blocks through two slots
    # block 0 came during the previous call (the window wrapped around): its run only fetches block 1
    assert st.trace[:2] == [("run", 0), ("load", 1, 1)]
    assert ("load", 0, 0) in st.trace[st.trace.index(("run", 3)):]
    # few enough streamed blocks for the slots: nothing moves after the first call
    st.set_resident([0, 1])
    with flame.no_grad():
        net(x)
        st.reset_stats()
        net(x)
        net(x)
    assert st.stats["loads"] == 0


def test_slots_are_reused_without_new_allocations(device, monkeypatch):
    ref, net = frozen_pair(device, n=6)
    st = BlockStreamer(net.blocks, resident=[2], slots=2, device=device)
    made = []
    real = streamer_mod.device_bytes
    monkeypatch.setattr(streamer_mod, "device_bytes", lambda *a: made.append(a) or real(*a))
    slot_ptrs = [s.array.__array_interface__["data"][0] if isinstance(s.array, np.ndarray) else s.array.data.ptr
                 for s in st._slots]
    x = flame.randn(4, 16, device=device)
    held = []
    for _ in range(4):
        loss_and_grads(net, x)
        held.append(M.memory_allocated(device))
    assert made == []  # no slot or buffer allocated while running
    assert [s.array.__array_interface__["data"][0] if isinstance(s.array, np.ndarray) else s.array.data.ptr
            for s in st._slots] == slot_ptrs
    assert held[1] == held[2] == held[3]  # steady state: nothing accumulates step after step
    assert st.stats["loads"] > 0


def test_streaming_frees_the_blocks_device_memory_and_fits_a_budget_the_resident_model_does_not(device):
    if device.type == "cuda":
        pytest.skip("byte-exact budget on the cpu accounting; test_gpu_streaming.py checks budgets on cuda")
    d, n = 64, 6
    ref, net = frozen_pair(device, d=d, n=n)
    x = flame.randn(8, d, device=device)
    before = M.memory_allocated(device)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    freed = before - M.memory_allocated(device)
    block = st.block_bytes(0)
    assert freed >= (n - 2) * block  # n blocks left the device, 2 slots came
    del ref
    import gc
    gc.collect()
    # the budget: what is held now (weights outside the blocks + 2 slots) plus room for the step's activations
    budget = M.memory_allocated(device) + 2 * block
    M.set_memory_limit(budget, device)
    M.reset_peak_memory_stats(device)
    for _ in range(2):
        loss_and_grads(net, x)
    assert M.max_memory_allocated(device) <= budget
    with pytest.raises(M.OutOfMemoryError):
        st.set_resident("all")  # the whole stack on the device does not fit that budget
    M.set_memory_limit(None, device)


def test_tiny_flux_with_lora_streamed_equals_resident(device):
    args = flux_inputs(device)
    results = []
    for stream in (False, True):
        model = tiny_flux(device)
        model.enable_gradient_checkpointing(not stream)  # streamed blocks checkpoint by themselves
        if stream:
            st = BlockStreamer.for_model(model, device=device, resident=[1])
            assert st.names[:3] == ["double_blocks.0", "double_blocks.1", "single_blocks.0"]
            assert st.streamed == [0, 2, 3]
        for p in model.parameters():
            assert not p.requires_grad  # LoRA leaves the base frozen; its parameters live outside the blocks
        params = A.named_adapter_parameters(model)
        steps = []
        for _ in range(2):
            for _, p in params:
                p.grad = None
            out = model(**args)
            (out * out).mean().backward()
            steps.append((npy(out), {k: npy(p.grad) for k, p in params}))
        with flame.no_grad():
            steps.append((npy(model(**args)), {}))
        results.append(steps)
    for (o0, g0), (o1, g1) in zip(*results):
        np.testing.assert_allclose(o1, o0, rtol=1e-6, atol=1e-6)
        assert sorted(g0) == sorted(g1)
        for k in g0:
            assert np.abs(g0[k]).max() > 0, k
            np.testing.assert_allclose(g1[k], g0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_tiny_flux_streams_under_bf16_autocast(device):
    args = flux_inputs(device)
    outs = []
    for stream in (False, True):
        model = tiny_flux(device, dtype=flame.bfloat16)
        model.enable_gradient_checkpointing(True)
        if stream:
            BlockStreamer.for_model(model, device=device)
        params = A.adapter_parameters(model)
        with autocast(flame.device(device).type, dtype=flame.bfloat16):
            out = model(**args)
        out.float().square().mean().backward()
        outs.append((npy(out), [npy(p.grad) for p in params]))
    assert_same(outs[1][0], outs[0][0], device, cuda_rtol=1e-2)  # bf16: one ulp if cuBLAS picks another kernel
    for a, b in zip(outs[0][1], outs[1][1]):
        assert_same(b, a, device, cuda_rtol=1e-2)


def test_inference_from_memory_mapped_safetensors(device, tmp_path):
    from flame_core import io
    src = tiny_flux("cpu", lora=False)
    path = tmp_path / "flux.safetensors"
    io.save_file(src.state_dict(), str(path))
    args = flux_inputs(device)
    with flame.no_grad():
        want = npy(src.to(device)(**args))
    from flame_models.flux import Flux
    with nn.empty_init(device=device, dtype=flame.float32):
        model = Flux("flux-tiny")  # placeholders: no weights allocated
    model.requires_grad_(False)
    nn.load_weights_(model, [str(path)], strict=False,
                     key_map=lambda k: None if k.startswith(("double_blocks.", "single_blocks.")) else k)
    views = safetensors_views([str(path)])
    assert isinstance(views["double_blocks.0.img_attn.qkv.weight"], np.memmap)
    st = BlockStreamer.for_model(model, device=device, sources=views)
    assert st._host[0].host is None  # nothing copied to pinned memory: the file's pages are the source
    assert st.host_pinned_bytes == 0
    assert st.host_mapped_bytes == sum(int(v.nbytes) for k, v in views.items()
                                       if k.startswith(("double_blocks.", "single_blocks.")))
    with flame.no_grad():
        for _ in range(2):
            assert_same(npy(model(**args)), want, device)


def test_errors_name_the_problem(device):
    from flame_models.flux import Flux
    with nn.empty_init(device=device):
        model = Flux("flux-tiny")
    with pytest.raises(OffloadError, match="freeze the base"):
        BlockStreamer.for_model(model, device=device)
    model.requires_grad_(False)
    with pytest.raises(OffloadError, match="empty_init"):
        BlockStreamer.for_model(model, device=device)
    assert "_flame_streamer" not in model.double_blocks.__dict__  # a failed construction leaves no hook behind
    _, net = frozen_pair(device)
    BlockStreamer(net.blocks, device=device)
    with pytest.raises(OffloadError, match="already has a BlockStreamer"):
        BlockStreamer(net.blocks, device=device)


def test_close_gives_every_block_its_weights_back(device):
    ref, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=[0], device=device, prefixes=["blocks"])
    x = flame.randn(3, 16, device=device)
    sd = st.state_dict()
    assert set(sd) == {f"blocks.{i}.{k}" for i in range(5) for k in ("fc1.weight", "fc1.bias", "fc2.weight",
                                                                       "fc2.bias")}
    for k, v in sd.items():
        np.testing.assert_array_equal(npy(v), npy(ref.get_parameter(k)))  # copies of the host weights
    st.close()
    assert "_flame_streamer" not in net.blocks.__dict__
    assert_same(npy(net(x)), npy(ref(x)), device)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(npy(net.state_dict()[k]), npy(v))
