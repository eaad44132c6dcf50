"""Activation offload (BlockStreamer(offload_activations=True)): the checkpointed inputs carried from block to block
wait in host memory between forward and backward. On the CPU the copies are host-to-host and the numbers must be
bitwise those of the inputs kept in place; the copy engines of the helpers check the ordering (LazyCopyEngine: a
copy runs only once the compute side waits for it) and the CUDA graph capture rules (CaptureCheckEngine)."""
import gc

import numpy as np
import pytest
from offload_helpers import CaptureCheckEngine, LazyCopyEngine, assert_same, flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
from flame_nn.offload import BlockStreamer, OffloadError, auto_fit
from flame_nn.offload import outside as O
from flame_nn.offload.plan import plan_budget

MiB = 2 ** 20


def frozen_pair(device, d=16, n=6):
    ref, net = stack_pair(d, n, device)
    for m in (ref, net):
        m.blocks.requires_grad_(False)
        for b in m.blocks:
            b.gradient_checkpointing = True
    return ref, net


def grads_of(model, x):
    for p in model.parameters():
        p.grad = None
    y = model(x)
    loss = (y * y).mean()
    loss.backward()
    return [npy(loss)] + [npy(p.grad) for p in model.parameters() if p.requires_grad]


def flux_grads(model, args):
    for p in model.parameters():
        p.grad = None
    out = model(**args)
    loss = (out * out).mean()
    loss.backward()
    return [npy(loss)] + [npy(p.grad) for p in model.parameters() if p.requires_grad]


def same(a, b, device):
    assert len(a) == len(b)
    for k, (u, v) in enumerate(zip(a, b)):
        assert_same(u, v, device, err_msg=f"value {k}")


@pytest.mark.parametrize("resident", [(), (1, 3), (0, 1, 2, 3, 4, 5)])
def test_offloaded_inputs_give_the_gradients_of_kept_ones(device, resident):
    ref, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=resident, slots=2, device=device, offload_activations=True)
    x = flame.randn(4, 16, device=device)
    for _ in range(3):  # the pinned buffers are reused from step to step
        same(grads_of(net, x), grads_of(ref, x), device)
    acts = st.activations
    assert acts.stats["tensors"] == 3 * 5  # blocks 1..5 carry their input from the block before; block 0 keeps its
    assert acts.stats["bytes_d2h"] == acts.stats["bytes_h2d"] == 3 * 5 * 4 * 16 * 4
    assert acts.host_bytes == 5 * 4 * 16 * 4


def test_flux_offloads_the_carried_activations_and_keeps_the_shared_ones(device):
    ref, net = tiny_flux(device), tiny_flux(device)
    for m in (ref, net):
        m.requires_grad_(False)
        from flame_nn import adapters as A
        for p in A.adapter_parameters(m):
            p.requires_grad_(True)
        m.enable_gradient_checkpointing(True)
    st = BlockStreamer.for_model(net, device=device, resident=[1], offload_activations=True)
    st.activations.trace = trace = []
    args = flux_inputs(device)
    for _ in range(2):
        same(flux_grads(net, args), flux_grads(ref, args), device)
    n_double, n_single = len(net.double_blocks), len(net.single_blocks)
    # img and txt from double block 1 on, x from the first single block on (the concatenation is new); vec and pe
    # are every block's: they stay
    assert st.activations.stats["tensors"] == 2 * (2 * (n_double - 1) + n_single)
    offloaded = [i for what, i in trace if what == "offload"]
    assert offloaded == 2 * list(range(1, n_double + n_single))


def test_backward_brings_back_the_next_blocks_inputs_while_a_block_runs(device):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device, offload_activations=True)
    x = flame.randn(4, 16, device=device)
    grads_of(net, x)
    st.trace = st.activations.trace = trace = []
    grads_of(net, x)
    back = trace[next(k for k, e in enumerate(trace) if e[0] == "backward"):]
    events = [e for e in back if e[0] in ("backward", "fetch")]
    # block 5's backward fetches its own inputs and block 4's; each later backward fetches the one after it
    assert events[:3] == [("backward", 5), ("fetch", 5), ("fetch", 4)]
    for i in range(4, 0, -1):
        k = events.index(("backward", i))
        assert events[k + 1] == ("fetch", i - 1) or i == 1
    assert ("fetch", 0) not in events  # block 0 kept its input


def test_copies_run_only_when_waited_for_and_the_numbers_hold(device):
    # LazyCopyEngine runs a copy only when the compute side waits on an event after it: a missing wait would leave
    # a restored input unwritten (or read a source after it changed), and the gradients would differ
    ref, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=(2,), slots=2, device=device, offload_activations=True)
    st.engine = LazyCopyEngine(st.engine)
    st.activations.engine = lazy = LazyCopyEngine(st.activations.engine)
    x = flame.randn(4, 16, device=device)
    for _ in range(2):
        same(grads_of(net, x), grads_of(ref, x), device)
    assert lazy.done == len(lazy.queue) > 0


def _step_peak(net, st, x, device):
    """The allocated peak of one step, after two warm-up steps."""
    import flame_core.memory as M
    for _ in range(2):
        grads_of(net, x)
        st.join()
    M.reset_peak_memory_stats(device)
    grads_of(net, x)
    st.join()
    return M.max_memory_allocated(device)


def test_offload_keeps_two_blocks_of_carried_inputs_at_the_peak_as_the_plan_says(device):
    # the H200 run saved 4 of the 7 blocks' carried inputs where the plan counts 5 (all but the one being restored
    # and the one fetched ahead): the last forward block's inputs were held by the shared-input check (`_prev`)
    # through the whole backward, beside their restored copy
    if device.type == "cuda":
        pytest.skip("exact byte counts need the cpu accounting; test_gpu_activation_offload.py has the cuda run")
    D, N, ROWS = 64, 8, 32
    act = ROWS * D * 4
    x = flame.randn(ROWS, D, device=device)
    peaks, counted = {}, None
    for offload in (False, True):
        gc.collect()   # the garbage of earlier tests in this process would count in the first peak only
        _, net = frozen_pair(device, d=D, n=N)
        st = BlockStreamer(net.blocks, slots=2, device=device, offload_activations=offload)
        peaks[offload] = _step_peak(net, st, x, device)
        if offload:
            counted = dict(st.activations.stats)
        st.close()
        del net, st
        gc.collect()
    assert counted["bytes_step"] == (N - 1) * act and counted["block_max"] == act
    plan = plan_budget("1GiB", held=0, slots=0, activations=0, offloadable=counted["bytes_step"],
                       offload_block=counted["block_max"], offload_activations=True)
    assert peaks[False] - peaks[True] == plan.offload_saving == (N - 3) * act


def test_offload_holds_no_device_input_once_the_backward_started(device):
    import weakref
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device, offload_activations=True)
    x = flame.randn(4, 16, device=device)
    y = net(x)
    last = list(st.activations._prev.values())  # the inputs of the last block, copied out
    assert last
    refs = [weakref.ref(t) for t in last]
    del last
    seen = []
    before = st._before_backward

    def probe(i):
        before(i)
        seen.append([r() is not None for r in refs])
    st._before_backward = probe
    (y * y).mean().backward()
    st.join()
    assert seen and not any(any(s) for s in seen), seen


def test_a_second_forward_before_the_backward_is_refused(device):
    _, net = frozen_pair(device)
    BlockStreamer(net.blocks, slots=2, device=device, offload_activations=True)
    x = flame.randn(4, 16, device=device)
    y1 = net(x)
    net(x)
    with pytest.raises(OffloadError, match="overwritten by a later forward"):
        (y1 * y1).mean().backward()


def test_a_captured_step_with_offloaded_activations_follows_the_capture_rules(device):
    ref, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=(1,), slots=2, device=device, offload_activations=True)
    eng = st.engine = CaptureCheckEngine(st.engine)
    aeng = st.activations.engine = CaptureCheckEngine(st.activations.engine)
    x = flame.randn(4, 16, device=device)
    for k in range(4):
        st.prime()
        if k == 2:
            with eng.capture(), aeng.capture():
                got = grads_of(net, x)
                st.join()
            assert aeng.copies_in_capture > 0 and aeng.forked
        else:
            got = grads_of(net, x)
        same(got, grads_of(ref, x), device)


def test_auto_fit_offloads_only_when_the_budget_needs_it(device):
    if device.type == "cuda":
        pytest.skip("exact byte counts need the cpu accounting; test_gpu_activation_offload.py has the cuda run")
    D, N = 256, 8
    ref, net = frozen_pair(device, d=D, n=N)
    st = BlockStreamer(net.blocks, device=device)
    x = flame.randn(64, D, device=device)

    def step():
        y = net(x)
        (y * y).mean().backward()
        net.zero_grad()
    kw = dict(headroom=0, count_driver_overhead=False, enforce=False)
    plain = auto_fit(st, "64GiB", step, **kw)
    assert not plain.offload_activations and st.activations is None  # it fits: nothing changes
    assert plain.plan.offloadable == (N - 1) * 64 * D * 4  # the measured step counted what could go
    budget = plain.minimum - 64 * 1024  # below the minimum with the inputs kept, above it with them offloaded
    rep = auto_fit(st, budget, step, **kw)
    assert rep.offload_activations and st.offload_activations
    assert rep.minimum < budget and rep.measured_peak <= budget
    assert rep.offloaded_bytes == (N - 1) * 64 * D * 4 and rep.activation_host_bytes == rep.offloaded_bytes
    assert "offloaded to pinned host memory" in str(rep)
    want = grads_of(ref, x)
    same(grads_of(net, x), want, device)
    again = auto_fit(st, "64GiB", step, **kw)  # a larger budget decides again: the fit had turned it on
    assert not again.offload_activations and st.activations is None
    st.offload_activations = True  # the owner's choice stays
    assert auto_fit(st, "64GiB", step, **kw).offload_activations
    st.offload_activations = False
    # forced off, the same budget is refused, naming the minimum
    with pytest.raises(Exception, match="below the minimum"):
        auto_fit(st, budget, step, offload_activations=False, **kw)
    assert st.activations is None


def test_outside_weights_go_fp8_only_when_the_blocks_are_fp8_and_the_budget_needs_it(device, monkeypatch):
    if device.type == "cuda":
        pytest.skip("exact byte counts need the cpu accounting")
    monkeypatch.setattr(O, "MIN_ELEMENTS", 8192)  # tiny Flux: time_in/guidance_in in_layer, the final adaLN
    net = tiny_flux(device)
    net.requires_grad_(False)
    from flame_nn import adapters as A
    for p in A.adapter_parameters(net):
        p.requires_grad_(True)
    net.enable_gradient_checkpointing(True)
    st = BlockStreamer.for_model(net, device=device, quantize="fp8")
    names = [n for n, _, _ in O.outside_fp8_candidates(st.outside_modules)]
    assert names == ["time_in.in_layer", "guidance_in.in_layer", "final_layer.adaLN_modulation.1"]
    args = flux_inputs(device)

    def step():
        out = net(**args)
        (out * out).mean().backward()
        net.zero_grad()
    kw = dict(headroom=0, count_driver_overhead=False, enforce=False)
    plain = auto_fit(st, "64GiB", step, **kw)
    assert plain.outside_fp8 == [] and not plain.offload_activations
    saving = plain.plan.offloadable - 2 * plain.plan.offload_block
    budget = plain.minimum - saving - 1024  # offloading alone is not enough
    rep = auto_fit(st, budget, step, **kw)
    assert rep.offload_activations and rep.outside_fp8 == names and rep.outside_fp8_bytes > 1024
    assert net.img_in.weight.dtype == flame.float32  # the compute dtype Flux reads stays
    assert "stored in fp8" in str(rep)
    assert np.isfinite(npy(net(**args))).all()


def test_when_offload_saves_less_than_planned_the_outside_fp8_is_tried_next(device, monkeypatch):
    if device.type == "cuda":
        pytest.skip("exact byte counts need the cpu accounting")
    import flame_nn.offload.autofit as AF
    monkeypatch.setattr(O, "MIN_ELEMENTS", 8192)
    net = tiny_flux(device)
    net.requires_grad_(False)
    from flame_nn import adapters as A
    for p in A.adapter_parameters(net):
        p.requires_grad_(True)
    net.enable_gradient_checkpointing(True)
    st = BlockStreamer.for_model(net, device=device, quantize="fp8")
    args = flux_inputs(device)

    def step():
        out = net(**args)
        (out * out).mean().backward()
        net.zero_grad()
    kw = dict(headroom=0, count_driver_overhead=False, enforce=False)
    real = auto_fit(st, "64GiB", step, offload_activations=True, **kw).minimum  # measured with offload
    st.offload_activations = False
    optimistic = AF.plan_budget
    monkeypatch.setattr(AF, "plan_budget", lambda *a, **k: optimistic(*a, **{**k, "offload_block": 0,
                                                                            "offloadable": 4 * k["offloadable"]}))
    rep = auto_fit(st, real - 1024, step, **kw)  # the plan expects the offload to be enough; it is not
    assert rep.offload_activations and rep.outside_fp8 and rep.minimum <= real - 1024
    assert any(w == "measured with the block inputs offloaded" for w, _ in rep.plan.steps)


def test_the_flux_dev_4gib_plan_is_feasible_on_paper():
    # the parts measured on the H200 (bench/streaming.py --graph, fp8, everything streamed): 839 MiB held outside
    # the blocks (with the optimizer state), 2 slots of 325 MiB, 2.73 GiB of activations at the peak, 683 MiB
    # outside the pool; activation offload moves the inputs of double blocks 1-18 (img 4096x3072 + txt 512x3072,
    # bf16) and of the 38 single blocks (x 4608x3072)
    img, txt, x = 4096 * 3072 * 2, 512 * 3072 * 2, 4608 * 3072 * 2
    parts = dict(held=839 * MiB, slots=2 * 325 * MiB, activations=int(2.73 * 1024) * MiB, overhead=683 * MiB,
                 offloadable=18 * (img + txt) + 38 * x, offload_block=x)
    plan6 = plan_budget("6GiB", **parts)
    assert plan6.feasible and not plan6.offload_activations  # fits today: nothing changes
    plan4 = plan_budget("4GiB", **parts)
    assert not plan_budget("4GiB", offload_activations=False, **parts).feasible
    assert plan4.feasible and plan4.offload_activations and not plan4.quantize_outside
    assert 3.4 * 1024 * MiB < plan4.minimum < 3.5 * 1024 * MiB
    assert "fits" in str(plan4) and "offloaded to pinned host memory" in str(plan4)


def test_the_plan_turns_the_savers_on_in_order_and_only_while_needed():
    parts = dict(held=100 * MiB, slots=200 * MiB, activations=500 * MiB, overhead=0, headroom=0,
                 offloadable=300 * MiB, offload_block=50 * MiB, outside_fp8=60 * MiB)
    base = 800 * MiB
    fits = plan_budget(base, **parts)
    assert fits.feasible and not fits.offload_activations and not fits.quantize_outside and fits.minimum == base
    # short of 100 MiB: the offload saves 300 - 2 x 50 = 200 MiB, the outside stays as it is
    p = plan_budget(base - 100 * MiB, **parts)
    assert p.offload_activations and not p.quantize_outside and p.minimum == base - 200 * MiB and p.spare == 100 * MiB
    # short of 230 MiB: the offload is not enough, the fp8 outside the blocks comes next
    p = plan_budget(base - 230 * MiB, **parts)
    assert p.offload_activations and p.quantize_outside and p.minimum == base - 260 * MiB and p.feasible
    assert [w for w, _ in p.steps] == ["everything streamed, nothing offloaded", "with the block inputs offloaded",
                                       "with the weights outside the blocks in fp8"]
    # the fp8 outside the blocks is not offered (bf16 blocks: None): the plan says it does not fit
    p = plan_budget(base - 230 * MiB, **{**parts, "outside_fp8": None})
    assert not p.feasible and not p.quantize_outside and "does NOT fit" in str(p)
    # an offload that keeps as much as it moves (two blocks' worth) is not turned on
    p = plan_budget(base - 10 * MiB, **{**parts, "offloadable": 100 * MiB})
    assert not p.offload_activations and p.quantize_outside
    # measured with the inputs offloaded already: nothing is subtracted twice
    p = plan_budget(base, **parts, measured_offloaded=True)
    assert p.offload_activations and p.offload_saving == 0 and p.minimum == base
