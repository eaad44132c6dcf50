"""Streaming under CUDA graph capture, tested on the CPU: what a replay needs from the schedule.

A captured step is replayed without Python, so the streamer's decisions (which block goes to which slot, the tensors'
views) are made once, at capture. Replays are right only if (1) every step makes the same decisions -- the loads of
step n+1 are those of step n -- and (2) a step leaves the slots as it found them (cyclic). On the GPU the copies and
events must also follow stream capture's rules (fork the copy stream from the capturing stream, join it back, no
event crossing the capture boundary); CaptureCheckEngine models those rules on the CPU. The GPU tests
(test_gpu_graph_streaming.py) replay real graphs."""
import numpy as np
import pytest
from offload_helpers import CaptureCheckEngine, CaptureViolation, assert_same, flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
import flame_nn
from flame_nn.offload import BlockStreamer, OffloadError


def frozen_pair(device, d=16, n=6):
    ref, net = stack_pair(d, n, device)
    for m in (ref, net):
        m.blocks.requires_grad_(False)
    return ref, net


def train_step(model, x):
    for p in model.parameters():
        p.grad = None
    y = model(x)
    loss = (y * y).mean()
    loss.backward()
    return float(npy(loss))


def step_loads(st, fn):
    """(loads of one call of fn as [(block, slot)], slot state before, slot state after)."""
    before = st.slot_state()
    st.trace = []
    fn()
    loads = [(e[1], e[2]) for e in st.trace if e[0] == "load"]
    st.trace = None
    return loads, before, st.slot_state()


@pytest.mark.parametrize("resident", [(), (1, 2), (0, 5), (0, 1, 2, 3, 4)])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_training_step_makes_the_same_loads_every_step_and_ends_where_it_started(device, resident, slots):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, resident=resident, slots=slots, device=device)
    x = flame.randn(4, 16, device=device)
    train_step(net, x)  # warm-up: the first step starts from empty slots
    rng = flame.get_rng_state("cpu")
    steps = [step_loads(st, lambda: train_step(net, x)) for _ in range(3)]
    for loads, before, after in steps:
        assert loads == steps[0][0]                      # the same (block, slot) loads, in the same order
        assert before == after == st.start_state()       # cyclic: the state a replay starts from is where it ends
    streamed = [i for i in range(6) if i not in resident]
    # forward finds the first K streamed blocks where the last backward left them, backward the last K where
    # forward left them: every other block comes once each way
    assert len(steps[0][0]) == 2 * max(0, len(streamed) - slots)
    assert all(s == streamed.index(b) % slots for b, s in steps[0][0])  # every block in its home slot
    assert flame.get_rng_state("cpu") == rng  # the streamer draws no random numbers


def test_tiny_flux_with_lora_schedule_is_cyclic(device):
    model = tiny_flux(device)
    model.enable_gradient_checkpointing(True)
    st = BlockStreamer.for_model(model, resident=[1], device=device)
    args = flux_inputs(device)

    def step():
        model.zero_grad()
        out = model(**args)
        (out * out).mean().backward()
    step()
    first = step_loads(st, step)
    second = step_loads(st, step)
    assert first[0] == second[0] and len(first[0]) > 0
    assert first[1] == first[2] == second[1] == second[2] == st.start_state()


def test_prime_restores_the_start_state_after_an_inference_forward(device):
    ref, net = frozen_pair(device, n=5)  # odd: the wrapped inference window puts block 0 outside its home slot
    st = BlockStreamer(net.blocks, slots=2, device=device)
    x = flame.randn(4, 16, device=device)
    train_step(net, x)
    steady = step_loads(st, lambda: train_step(net, x))[0]
    with flame.no_grad():
        assert_same(npy(net(x)), npy(ref(x)), device)
    assert st.slot_state() != st.start_state()
    st.prime()
    assert st.slot_state() == st.start_state()
    loads, before, after = step_loads(st, lambda: train_step(net, x))
    assert loads == steady and after == before
    assert train_step(net, x) == train_step(ref, x)
    st.stats["loads"] = 0
    st.prime()  # nothing to do when the state is right
    assert st.stats["loads"] == 0


def captured_run(device, n=6, resident=(2,), slots=2, steps=4, capture_at=2, flux=False):
    """Losses of eager steps on a reference and of a streamed model whose step `capture_at` runs 'captured' under
    CaptureCheckEngine (which raises on any violation of the capture rules)."""
    if flux:
        models = [tiny_flux(device), tiny_flux(device)]
        for m in models:
            m.enable_gradient_checkpointing(True)
        ref, net = models
        st = BlockStreamer.for_model(net, resident=resident, slots=slots, device=device)
        args = flux_inputs(device)

        def run(m):
            m.zero_grad()
            out = m(**args)
            loss = (out * out).mean()
            loss.backward()
            return float(npy(loss))
    else:
        ref, net = frozen_pair(device, n=n)
        st = BlockStreamer(net.blocks, resident=resident, slots=slots, device=device)
        x = flame.randn(4, 16, device=device)

        def run(m):
            return train_step(m, x)
    eng = st.engine = CaptureCheckEngine(st.engine)
    got, want = [], []
    for k in range(steps):
        st.prime()
        if k == capture_at:
            with eng.capture():
                got.append(run(net))
                st.join()
        else:
            got.append(run(net))
        want.append(run(ref))
    return got, want, st, eng


@pytest.mark.parametrize("resident", [(), (2,), (0, 5)])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_captured_step_follows_the_capture_rules(device, resident, slots):
    got, want, st, eng = captured_run(device, resident=resident, slots=slots)
    # exact on the cpu: the captured step and the eager ones around it compute the same (cuda: within 1e-6)
    assert_same(np.array(got), np.array(want), device)
    stats = st.graph_stats
    assert stats["start"] == stats["end"] == st.start_state()
    streamed = 6 - len(resident)
    assert stats["loads"] == eng.copies_in_capture > 0 or streamed <= slots
    if streamed > slots:
        # the fork: inside the capture the copy stream's first operation is a wait on the capturing stream
        inside = eng.log[[i for i, e in enumerate(eng.log) if e[0] == "record" and e[2] is not None][0]:]
        first_copy_side = next(e for e in inside if e[0] == "copy_waits" or e[:2] == ("record", "copy"))
        assert first_copy_side[0] == "copy_waits" and first_copy_side[1][0] == "compute"


def test_tiny_flux_captured_step_follows_the_capture_rules(device):
    got, want, st, eng = captured_run(device, resident=[1], flux=True)
    np.testing.assert_array_equal(got, want) if device.type == "cpu" else np.testing.assert_allclose(got, want,
                                                                                                     rtol=1e-5)
    assert st.graph_stats["loads"] > 0 and st.graph_stats["start"] == st.graph_stats["end"]


def test_the_schedule_joins_every_copy_even_without_join(device):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    eng = st.engine = CaptureCheckEngine(st.engine)
    x = flame.randn(4, 16, device=device)
    train_step(net, x)
    with eng.capture():  # no join(): each block's use waits on its copy, the last one included
        train_step(net, x)
    train_step(net, x)  # after the capture: no wait on a captured event
    assert st.graph_stats["end"] == st.graph_stats["start"]  # checked when the streamer next ran


def test_the_checker_catches_a_wait_across_the_capture_boundary(device):
    # the rules bite: an event kept from before the capture and waited on inside it is refused
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    eng = st.engine = CaptureCheckEngine(st.engine)
    x = flame.randn(4, 16, device=device)
    train_step(net, x)
    stale = eng.record_copy()
    with pytest.raises(CaptureViolation, match="outside"):
        with eng.capture():
            eng.compute_waits(stale)


def test_capturing_an_inference_forward_is_refused_as_not_cyclic(device):
    _, net = frozen_pair(device, n=4)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    eng = st.engine = CaptureCheckEngine(st.engine)
    x = flame.randn(4, 16, device=device)
    st.prime()
    with pytest.raises(OffloadError, match="not cyclic"):
        with eng.capture(), flame.no_grad():
            net(x)
            st.join()
    st.invalidate_slots().prime()  # after a failed capture: forget the loads it recorded, start again
    assert st.slot_state() == st.start_state()
    with flame.no_grad():
        net(x)


def test_set_resident_and_prime_are_refused_inside_a_capture(device):
    _, net = frozen_pair(device)
    st = BlockStreamer(net.blocks, slots=2, device=device)
    eng = st.engine = CaptureCheckEngine(st.engine)
    with eng.capture():
        with pytest.raises(OffloadError, match="capture"):
            st.set_resident([1])
        with pytest.raises(OffloadError, match="capture"):
            st.prime()


def test_graphed_streamed_training_equals_eager(device):
    # flame_core.cuda.graphed runs eagerly on the cpu: the wrapper, join() and prime() leave the numbers unchanged
    ref, net = frozen_pair(device)
    for m in (ref, net):
        m.blocks[0].gain.requires_grad_(True)
    st = BlockStreamer(net.blocks, resident=[3], slots=2, device=device)
    xs = [flame.randn(4, 16, device=device) for _ in range(5)]

    def fwd_bwd(model, x):
        y = model(x)
        loss = (y * y).mean()
        loss.backward()
        if model is net:
            st.join()
        return loss.detach()
    run = flame.cuda.graphed(lambda x: fwd_bwd(net, x), warmup=2)
    o_ref = flame_nn.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    o_net = flame_nn.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for x in xs:
        st.prime()
        got = npy(run(x))
        want = npy(fwd_bwd(ref, x))
        assert_same(got, want, device)
        for o in (o_ref, o_net):
            o.step()
            o.zero_grad(set_to_none=False)
    for (k, a), (_, b) in zip(ref.named_parameters(), net.named_parameters()):
        if a.requires_grad:
            assert_same(npy(b), npy(a), device, err_msg=k)
