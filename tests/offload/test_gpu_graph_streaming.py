"""GPU only: a streamed training step captured as one CUDA graph (flame_core.cuda.graphed) and replayed gives the
eager streamed run's losses and trainable parameters; the replays copy the streamed blocks themselves (no Python
runs for them); prime() keeps replays right after other work moved the slots. The CPU suite
(test_graph_streaming.py) checks the schedule's cyclicity and the capture rules on a model of stream capture."""
import numpy as np
import pytest
from offload_helpers import flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
import flame_nn
from flame_core.amp import autocast
from flame_nn.offload import BlockStreamer

pytestmark = pytest.mark.gpu


def stack_model(seed=0):
    _, net = stack_pair(256, 6, "cuda", seed=seed)
    net.blocks.requires_grad_(False)  # frozen, streamed; inp and out train
    return net


def run_steps(net, st, xs, graph, between=None):
    """Losses and trainable parameters after len(xs) steps of forward+backward (graphed or eager) + eager AdamW."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = flame_nn.optim.AdamW(params, lr=1e-3)

    def fwd_bwd(x):
        y = net(x)
        loss = (y.float() * y.float()).mean()
        loss.backward()
        st.join()
        return loss.detach()
    run = flame.cuda.graphed(fwd_bwd, warmup=2, enabled=graph)
    losses = []
    for k, x in enumerate(xs):
        if between is not None:
            between(k)
        st.prime()
        losses.append(float(run(x).item()))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return losses, [npy(p) for p in params], run


def test_a_replayed_streamed_step_equals_the_eager_streamed_step():
    xs = [flame.randn(512, 256, device="cuda", generator=flame.Generator("cuda").manual_seed(k)) for k in range(6)]
    out = {}
    for graph in (False, True):
        net = stack_model()
        st = BlockStreamer(net.blocks, resident=[2], slots=2, device="cuda")
        out[graph] = run_steps(net, st, xs, graph) + (st,)
    (l0, p0, _, _), (l1, p1, run, st) = out[False], out[True]
    assert run.graph is not None  # captured at the third call, replayed from then on
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for a, b in zip(p1, p0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    g = st.graph_stats
    assert g["start"] == g["end"] == st.start_state()
    assert g["loads"] == 2 * (5 - 2)  # 5 streamed blocks through 2 slots: 3 copies each way per step


def test_replays_copy_the_blocks_themselves():
    # after the capture, wipe the slots (NaN) and forget them: prime() reloads the first two blocks eagerly and the
    # replay must copy every other block itself, or the loss turns NaN
    xs = [flame.randn(512, 256, device="cuda", generator=flame.Generator("cuda").manual_seed(k)) for k in range(5)]
    ref_net = stack_model()
    ref_st = BlockStreamer(ref_net.blocks, resident=[2], slots=2, device="cuda")
    want, _, _ = run_steps(ref_net, ref_st, xs, False)
    net = stack_model()
    st = BlockStreamer(net.blocks, resident=[2], slots=2, device="cuda")
    loads = []

    def wipe(k):
        if k >= 3:  # the graph exists (captured at k == 2)
            loads.append(st.stats["loads"])
            st.invalidate_slots()
            for s in st._slots:
                s.array.view(np.uint8)[...] = 0xFF  # NaN in every float dtype
    got, _, run = run_steps(net, st, xs, True, between=wipe)
    assert run.graph is not None
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert all(np.isfinite(got))
    # the replays' copies never went through Python: only prime()'s two loads per replay are counted
    assert np.diff(loads).tolist() == [2] * (len(loads) - 1)


def test_prime_keeps_replays_right_after_an_inference_forward():
    xs = [flame.randn(512, 256, device="cuda", generator=flame.Generator("cuda").manual_seed(k)) for k in range(6)]
    out = {}
    for graph in (False, True):
        net = stack_model()
        st = BlockStreamer(net.blocks, resident=[2], slots=2, device="cuda")

        def infer(k, net=net):
            with flame.no_grad():
                net(xs[0])  # moves the slots (the inference window wraps)
        out[graph] = run_steps(net, st, xs, graph, between=infer)
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_tiny_flux_lora_streamed_and_replayed_equals_eager(quantize):
    args = flux_inputs("cuda", dtype=flame.bfloat16)
    out = {}
    for graph in (False, True):
        model = tiny_flux("cuda", dtype=flame.bfloat16)
        model.enable_gradient_checkpointing(True)
        st = BlockStreamer.for_model(model, resident=[1], slots=2, device="cuda", quantize=quantize)
        lora = flame_nn.adapters.adapter_parameters(model)
        opt = flame_nn.optim.AdamW(lora, lr=1e-3)

        def fwd_bwd(img):
            with autocast("cuda", dtype=flame.bfloat16):
                pred = model(**dict(args, img=img))
            loss = (pred.float() * pred.float()).mean()
            loss.backward()
            st.join()
            return loss.detach()
        run = flame.cuda.graphed(fwd_bwd, warmup=2, enabled=graph)
        losses = []
        for k in range(6):
            st.prime()
            losses.append(float(run(args["img"] * (1 + 0.1 * k)).item()))
            opt.step()
            opt.zero_grad(set_to_none=False)
        out[graph] = (losses, [npy(p) for p in lora], run, st)
    assert out[True][2].graph is not None and out[True][3].graph_stats["loads"] > 0
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-4)
    for a, b in zip(out[True][1], out[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
