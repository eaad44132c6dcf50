"""Lazy gradient buffers (grad_pool.register(params, lazy=True)): PyTorch's memory behaviour at the flat buffers'
speed -- no gradient storage before backward, storage of a chunk only from the first gradient written into it,
released by zero_grad(set_to_none=True); the same numbers as the eager buffers."""
import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
import flame_nn as nn
from flame_core import grad_pool

from .conftest import storage


def npa(t):
    return t.detach().double().numpy()


def chain(device, rng, n=4, width=16):
    """n float32 (width, width) weights used one after another: backward reaches the last one first."""
    return [flame.tensor(rng.standard_normal((width, width)) / width ** 0.5, dtype=flame.float32, device=device,
                         requires_grad=True) for _ in range(n)]


def forward(x, ws):
    h = x
    hs = []
    for w in ws:
        h = (h @ w).tanh()
        hs.append(h)
    return h.square().sum(), hs


def test_no_gradient_storage_before_backward_and_none_after_set_to_none(device, rng, no_gc):
    ws = chain(device, rng)
    x = flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device)
    warm = [w.detach().clone().requires_grad_(True) for w in ws]
    forward(x, warm)[0].backward()  # the library's one-time allocations (cuBLAS's workspace on cuda) happen here
    del warm
    a0 = M.memory_allocated(device)
    bufs = grad_pool.register(ws, lazy=True)
    assert M.memory_allocated(device) == a0  # registration allocates nothing
    assert bufs and not any(b.resident for b in bufs) and all(w.grad is None for w in ws)
    for step in range(2):
        forward(x, ws)[0].backward()  # the activations die with the graph
        assert all(b.resident for b in bufs)
        assert M.memory_allocated(device) == a0 + sum(storage(b.numel * 4, device) for b in bufs)
        grad_pool.zero_grad(ws, set_to_none=True)
        assert all(w.grad is None for w in ws) and not any(b.resident for b in bufs)
        assert M.memory_allocated(device) == a0  # the gradients are gone between steps, as PyTorch's


def test_same_gradients_as_eager_buffers_and_chunks_in_registration_order(device, rng, monkeypatch):
    monkeypatch.setattr(grad_pool, "LAZY_CHUNK_BYTES", 2 * 16 * 16 * 4)  # two weights per buffer
    ws = chain(device, rng, n=5)
    ref = [w.detach().clone().requires_grad_(True) for w in ws]
    x = flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device)
    bufs = grad_pool.register(ws, lazy=True)
    grad_pool.register(ref)
    assert [len(b.slots) for b in bufs] == [2, 2, 1]
    assert [grad_pool.buffer_of(w) for w in ws] == [bufs[0], bufs[0], bufs[1], bufs[1], bufs[2]]
    for _ in range(2):  # accumulation: the second backward adds into the resident buffers
        forward(x, ws)[0].backward()
        forward(x, ref)[0].backward()
    for w, r in zip(ws, ref):
        np.testing.assert_array_equal(npa(w.grad), npa(r.grad))
        assert w.grad.data_ptr() == grad_pool.pooled_grad(w).data_ptr()
    grad_pool.zero_grad(ws)  # set_to_none=False: zeroed in place, the storage stays
    assert all(b.resident for b in bufs) and not any(npa(w.grad).any() for w in ws)


def test_backward_makes_a_chunk_resident_only_when_it_reaches_its_parameters(device, rng, monkeypatch):
    monkeypatch.setattr(grad_pool, "LAZY_CHUNK_BYTES", 16 * 16 * 4)  # one weight per buffer
    ws = chain(device, rng)
    x = flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device)
    bufs = grad_pool.register(ws, lazy=True)
    loss, hs = forward(x, ws)
    seen = {}

    def at(i):
        def hook(g):  # the gradient of hs[i]: backward has passed ws[i + 1:], not yet ws[:i + 1]
            seen[i] = [b.resident for b in bufs]
        return hook
    for i in range(len(ws)):
        hs[i].register_hook(at(i))
    loss.backward()
    for i in range(len(ws)):  # hs[-1] first: no gradient storage at all when backward starts
        assert seen[i] == [False] * (i + 1) + [True] * (len(ws) - i - 1)
    assert all(b.resident for b in bufs)


def test_set_to_none_on_part_of_a_buffer_keeps_its_storage(device, rng, monkeypatch):
    ws = chain(device, rng, n=3)
    (buf,) = grad_pool.register(ws, lazy=True)
    x = flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device)
    forward(x, ws)[0].backward()
    keep = npa(ws[2].grad)
    grad_pool.zero_grad(ws[:2], set_to_none=True)
    assert buf.resident and ws[0].grad is None and ws[1].grad is None
    np.testing.assert_array_equal(npa(ws[2].grad), keep)
    grad_pool.zero_grad([ws[2]], set_to_none=True)
    assert not buf.resident
    flat = grad_pool.flat_buffer_of(ws[0])  # a consumer asking for the buffer gets it, zeroed
    assert buf.resident and flat.shape == (buf.numel,) and not npa(flat).any()


def test_an_existing_gradient_is_kept_at_registration(device, rng):
    (w,) = chain(device, rng, n=1)
    w.grad = flame.ones(16, 16, device=device)
    (buf,) = grad_pool.register([w], lazy=True)
    assert buf.resident and w.grad.data_ptr() == buf.tensor.data_ptr()
    np.testing.assert_array_equal(npa(w.grad), np.ones((16, 16)))


@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
def test_training_with_lazy_buffers_matches_eager_buffers(device, rng, opt_name):
    ws = chain(device, rng, n=3)
    ref = [w.detach().clone().requires_grad_(True) for w in ws]
    grad_pool.register(ws, lazy=True)
    make = getattr(nn.optim, opt_name)
    opts = [make(ws, lr=1e-2), make(ref, lr=1e-2)]
    xs = [flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device) for _ in range(3)]
    for x in xs:
        for params, opt in zip((ws, ref), opts):
            forward(x, params)[0].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for w, r in zip(ws, ref):
        np.testing.assert_array_equal(npa(w), npa(r))


def test_a_steps_peak_holds_only_the_gradients_backward_has_reached(device, rng, monkeypatch, no_gc):
    """The bench's question on the cpu accountant: a step whose peak comes early in backward (activations at their
    largest) holds every gradient with eager buffers, at most the chunks reached so far with lazy ones."""
    width, n = 64, 8
    monkeypatch.setattr(grad_pool, "LAZY_CHUNK_BYTES", width * width * 4)  # one weight per chunk
    x = flame.tensor(rng.standard_normal((512, width)), dtype=flame.float32, device=device)

    def peak(lazy):
        ws = chain(device, rng, n=n, width=width)
        base = M.memory_allocated(device)  # the weights (and x)
        grad_pool.register(ws, lazy=lazy)
        opt = nn.optim.SGD(ws, lr=1e-3)
        for _ in range(2):
            M.reset_peak_memory_stats(device)
            forward(x, ws)[0].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return M.max_memory_allocated(device) - base
    grads = n * width * width * 4
    eager, lazy = peak(False), peak(True)
    assert eager - lazy >= grads - 2 * width * width * 4


def test_a_buffer_kept_for_a_live_graph_is_released_by_the_next_set_to_none_after_the_graph_died(device, rng):
    """While a CUDA graph writes into a lazy buffer, set_to_none keeps its storage (the .grad become None); once the
    graph is gone, the optimizer's next zero_grad(set_to_none=True) -- every .grad already None -- releases it."""
    import weakref

    class FakeGraph:                        # what _release asks of the graph that allocated the storage
        is_live = True
    ws = chain(device, rng, n=2)
    bufs = grad_pool.register(ws, lazy=True)
    opt = nn.optim.SGD(ws, lr=0.1)
    forward(flame.tensor(rng.standard_normal((3, 16)), dtype=flame.float32, device=device), ws)[0].backward()
    graph = FakeGraph()
    for b in bufs:
        b._graph = weakref.ref(graph)
    opt.zero_grad(set_to_none=True)
    assert all(w.grad is None for w in ws) and all(b.resident for b in bufs)   # the graph lives: kept
    graph.is_live = False
    opt.zero_grad(set_to_none=True)
    assert not any(b.resident for b in bufs)
    grad_pool.unregister(ws)


def test_many_gradients_go_into_at_most_lazy_chunks_buffers(monkeypatch):
    """Beyond LAZY_CHUNKS x LAZY_CHUNK_BYTES of gradients (a full fine-tune) each buffer holds 1/LAZY_CHUNKS of them:
    a few dozen buffers, not one per chunk size -- and each parameter still gets its own gradient."""
    monkeypatch.setattr(grad_pool, "LAZY_CHUNK_BYTES", 4096)
    rng = np.random.default_rng(0)
    ws = chain("cpu", rng, n=300, width=32)   # 300 x 4 KiB of float32 gradients: 300 buffers at the bare chunk size
    made = grad_pool.register(ws, lazy=True)
    # a chunk of 300 * 1024 / 64 = 4800 elements takes 4 of these 1024-element weights: 75 buffers
    assert len(made) == 75
    x = flame.tensor(rng.standard_normal((2, 32)), dtype=flame.float32, device="cpu")
    forward(x, ws)[0].backward()
    want = [w.grad.detach().numpy().copy() for w in ws]
    assert all(grad_pool.flat_buffer_of(w) is not None for w in ws)
    ref = [flame.tensor(w.detach().numpy(), requires_grad=True, device="cpu") for w in ws]
    forward(x, ref)[0].backward()
    for a, b in zip(want, ref):
        np.testing.assert_array_equal(a, b.grad.detach().numpy())
