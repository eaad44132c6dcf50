"""GPU only: activation offload (BlockStreamer(offload_activations=True)) on real streams -- the gradients of the
inputs kept on the device, eagerly and replayed as a CUDA graph; the pool's peak lower by about the offloaded bytes;
auto_fit turning it on for a budget that needs it. The CPU suite (test_activation_offload.py) checks the ordering and
the capture rules on models of the streams."""
import numpy as np
import pytest
from offload_helpers import flux_inputs, npy, stack_pair, tiny_flux

import flame_core as flame
import flame_core.memory as M
import flame_nn
from flame_nn.offload import BlockStreamer, auto_fit

pytestmark = pytest.mark.gpu
D, N, ROWS = 1024, 8, 4096  # carried activations of 16 MiB (fp32) per block
ACT = ROWS * D * 4


def model(seed=0):
    _, net = stack_pair(D, N, "cuda", seed=seed)
    net.blocks.requires_grad_(False)
    for b in net.blocks:
        b.gradient_checkpointing = True
    return net


def fwd_bwd(net, st, x):
    y = net(x)
    loss = (y.float() * y.float()).mean()
    loss.backward()
    st.join()
    return loss.detach()


def train(net, st, xs, graph):
    params = [p for p in net.parameters() if p.requires_grad]
    opt = flame_nn.optim.AdamW(params, lr=1e-3)
    run = flame.cuda.graphed(lambda x: fwd_bwd(net, st, x), warmup=2, enabled=graph)
    losses = []
    for x in xs:
        st.prime()
        losses.append(float(run(x).item()))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return losses, [npy(p) for p in params], run


@pytest.mark.parametrize("graph", [False, True])
def test_offloaded_steps_equal_kept_ones(graph):
    xs = [flame.randn(ROWS, D, device="cuda", generator=flame.Generator("cuda").manual_seed(k)) for k in range(5)]
    out = {}
    for offload in (False, True):
        net = model()
        st = BlockStreamer(net.blocks, resident=[2], slots=2, device="cuda", offload_activations=offload)
        out[offload] = train(net, st, xs, graph) + (st,)
    (l0, p0, _, _), (l1, p1, run, st) = out[False], out[True]
    assert (run.graph is not None) == graph
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for a, b in zip(p1, p0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert st.activations.stats["bytes_d2h"] > 0
    assert st.activations.host_bytes == (N - 1) * ACT


def test_offload_lowers_the_pool_peak_by_about_the_offloaded_bytes():
    x = flame.randn(ROWS, D, device="cuda")
    peaks = {}
    for offload in (False, True):
        net = model()
        st = BlockStreamer(net.blocks, slots=2, device="cuda", offload_activations=offload)
        for _ in range(2):
            fwd_bwd(net, st, x)
        flame.cuda.synchronize()
        M.reset_peak_memory_stats()
        fwd_bwd(net, st, x)
        peaks[offload] = M.max_memory_allocated()
        st.close()
        del net, st
    carried = (N - 1) * ACT
    saved = peaks[False] - peaks[True]
    # two blocks' inputs stay on the device at the peak (the one being restored, the one fetched ahead), as the plan
    # counts (plan.offload_saving); the H200 run at 2048 rows saved 32 of 56 MiB while the last forward block's
    # inputs were also held through the backward (fixed; test_activation_offload.py checks it on the cpu)
    assert saved >= carried - 2 * ACT - ACT // 4, (peaks, carried)


def test_tiny_flux_offloaded_gradients_on_the_gpu():
    args = flux_inputs("cuda")
    grads = {}
    for offload in (False, True):
        net = tiny_flux("cuda")
        net.requires_grad_(False)
        for p in flame_nn.adapters.adapter_parameters(net):
            p.requires_grad_(True)
        net.enable_gradient_checkpointing(True)
        st = BlockStreamer.for_model(net, device="cuda", offload_activations=offload)
        out = net(**args)
        (out * out).mean().backward()
        st.join()
        grads[offload] = [npy(p.grad) for p in flame_nn.adapters.adapter_parameters(net)]
    for a, b in zip(grads[True], grads[False]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu_exclusive
def test_auto_fit_turns_offload_on_for_a_budget_that_needs_it():
    net = model()
    st = BlockStreamer(net.blocks, slots=2, device="cuda")
    x = flame.randn(ROWS, D, device="cuda")

    def step():
        fwd_bwd(net, st, x)
        net.zero_grad()
    # the pool's bytes only: the driver's memory outside the pool moves with what earlier tests left behind (the
    # H200 run: 1.99 GiB counted by the first fit, 1.35 GiB by the second, so a budget made from the first fitted
    # without offload in the second -- the test's arithmetic was wrong, not the plan). And from steady steps: the
    # next H200 run measured the model's first step 28 MiB above the later ones
    kw = dict(headroom=0, count_driver_overhead=False)
    for _ in range(2):
        step()
    fits = [auto_fit(st, "64GiB", step, enforce=False, **kw) for _ in range(2)]
    assert not any(f.offload_activations for f in fits)
    # the budget lies halfway between the measured minima without and with the offload: the plan's estimate of the
    # saving (offloadable - 2 blocks) is an upper bound, not a measurement (H200, 94a4071: 398 MiB plain, 368 with
    # 112 MiB offloaded -- the prefetched and staged blocks stay on the device -- where the estimate said 318)
    off = auto_fit(st, "64GiB", step, enforce=False, offload_activations=True, **kw)
    assert off.offload_activations and off.offloaded_bytes > 0
    plain_min = min(f.minimum for f in fits)
    assert off.minimum < plain_min, (off.minimum, plain_min)
    budget = (off.minimum + plain_min) // 2
    st.offload_activations = False  # as before: the last fit decides to turn it on itself
    rep = auto_fit(st, budget, step, **kw)
    print(rep)
    assert rep.offload_activations and rep.measured_peak <= budget
    for _ in range(3):
        step()
    M.set_memory_limit(None)
