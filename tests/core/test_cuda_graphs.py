"""CUDA graphs: capture once, replay with new inputs; forward + backward of a small model captured; random draws
refused while capturing; the graph's private memory survives empty_cache; eager fallback without a GPU."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_core import amp, backend
from flame_core.cuda import CUDAGraph, graph, graphed
from flame_core.cuda.graphs import GraphCaptureError


def test_graphed_function_is_eager_without_a_gpu_or_when_disabled():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    g = graphed(fn, warmup=1, enabled=False)
    for k in range(3):
        x = flame.full((3,), float(k), device="cpu")
        np.testing.assert_array_equal(g(x).numpy(), 2.0 * k)
    assert len(calls) == 3 and g.graph is None


def test_graphed_function_on_cpu_tensors_stays_eager_on_a_gpu_machine():
    """A CUDA graph records GPU work only: with cpu arguments (a cpu run on a machine that has a GPU) every call
    runs `fn` eagerly, never a capture whose replay would return the first result again."""
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    g = graphed(fn, warmup=1)
    for k in range(4):
        np.testing.assert_array_equal(g(flame.full((3,), float(k), device="cpu")).numpy(), 2.0 * k)
    assert len(calls) == 4 and g.graph is None


class _FakeGraph:
    """A stand-in CUDAGraph for the cpu: records that a capture ran and counts replays."""
    made = []

    def __init__(self):
        self.replays = self.resets = 0
        _FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1

    def reset(self):
        self.resets += 1


class _FakeCaptureBlock:
    def __init__(self, g):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cuda_like(t):
    """A cpu tensor that says it is on cuda (what GraphedFunction's choice looks at)."""
    class _Cuda(type(t)):
        is_cuda = True
    t.__class__ = _Cuda
    return t


@pytest.mark.parametrize("case", ["no_args_cuda_result", "no_args_cpu_result", "cpu_args", "cuda_args"])
def test_when_a_graphed_function_captures_and_when_it_stays_eager(monkeypatch, case):
    """The decision, on the cpu with a stand-in graph: a function of no tensor arguments is captured when it returns
    cuda tensors (f75eb73 ran it eagerly, and bench/streaming.py timed eager steps as graphs), stays eager when it
    returns only cpu tensors; cpu tensor arguments stay eager; cuda ones are captured."""
    from flame_core import backend
    from flame_core.cuda import graphs as G
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    monkeypatch.setattr(G, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(G, "graph", _FakeCaptureBlock)
    _FakeGraph.made.clear()
    calls = []

    def make(x=None):
        calls.append(1)
        out = flame.ones(2, device="cpu") * len(calls)
        return _cuda_like(out) if case in ("no_args_cuda_result", "cuda_args") else out

    g = graphed(make, warmup=1)
    args = {"cpu_args": (flame.ones(2, device="cpu"),),
            "cuda_args": (_cuda_like(flame.ones(2, device="cpu")),)}.get(case, ())
    outs = [g(*args) for _ in range(4)]
    captured = case in ("no_args_cuda_result", "cuda_args")
    assert (g.graph is not None) == captured and g.enabled == captured
    if captured:
        assert len(calls) == 2 and _FakeGraph.made[0].replays == 3  # warm-up + capture; replays do not call fn
        assert outs[1] is outs[2] is outs[3]                        # the static outputs
    else:
        assert len(calls) == 4 and [float(o.numpy()[0]) for o in outs] == [1.0, 2.0, 3.0, 4.0]
        assert case != "no_args_cpu_result" or _FakeGraph.made[0].resets == 1  # the empty capture was dropped


@pytest.mark.gpu
def test_graphed_function_of_no_arguments_is_captured_and_replays_its_closure():
    """A training step over its own model and batch takes no arguments: it is captured (not run eagerly for want of
    a cuda argument), and each replay reads the closed-over tensors' buffers as they are then."""
    w = flame.full((4, 3), 1.0, device="cuda")
    calls = []

    def fn():
        calls.append(1)
        return (w * 2).sum()

    g = graphed(fn, warmup=1)
    assert float(g().item()) == 24.0 and g.graph is None          # the warm-up call, eager
    assert float(g().item()) == 24.0 and g.graph is not None      # captured, then replayed
    for k in range(2, 5):
        w.copy_(flame.full((4, 3), float(k), device="cuda"))       # in place: the graph's input buffer
        assert float(g().item()) == 24.0 * k
    assert len(calls) == 2  # the warm-up and the capture; replays do not run fn


@pytest.mark.gpu
def test_graphed_function_of_no_arguments_doing_cpu_work_stays_eager():
    """No arguments and only cpu results: the capture recorded nothing, so that call's result is kept and every later
    call runs fn again (a replay would return the first result forever)."""
    w = flame.full((3,), 1.0, device="cpu")
    calls = []

    def fn():
        calls.append(1)
        return w * 2

    g = graphed(fn, warmup=1)
    for k in range(1, 5):
        w.copy_(flame.full((3,), float(k), device="cpu"))
        np.testing.assert_array_equal(g().numpy(), 2.0 * k)
    assert len(calls) == 4 and g.graph is None and not g.enabled


@pytest.mark.gpu
def test_capture_and_replay_elementwise_matmul_and_kernels():
    rng = np.random.default_rng(0)
    x = flame.tensor(rng.standard_normal((64, 96)), device="cuda").bfloat16()
    w = flame.tensor(rng.standard_normal((96, 32)), device="cuda").bfloat16()
    lw = flame.ones(32, device="cuda")

    def fn():
        h = F.layer_norm((x @ w), (32,), lw, None)          # cuBLAS + the fused norm kernel
        return (h.float().gelu() * 2 + 1).sum(-1)          # raw kernel + CuPy elementwise + reduction
    ref = fn().numpy()
    g = CUDAGraph()
    with graph(g):
        out = fn()
    g.replay()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-6)
    x.copy_(flame.tensor(rng.standard_normal((64, 96)), device="cuda").bfloat16())  # new input, same buffer
    ref2 = fn().numpy()
    g.replay()
    np.testing.assert_allclose(out.numpy(), ref2, rtol=1e-6, atol=1e-6)
    assert not np.allclose(ref, ref2)


def _mlp_on_cuda():
    flame.manual_seed(0)
    model = flame_nn.Sequential(flame_nn.Linear(32, 64), flame_nn.GELU("tanh"), flame_nn.Linear(64, 32))
    return model.to("cuda")


def _batches(seed, n=6):
    rng = np.random.default_rng(seed)
    return [(flame.tensor(rng.standard_normal((16, 32)), device="cuda", dtype=flame.float32),
             flame.tensor(rng.standard_normal((16, 32)), device="cuda", dtype=flame.float32)) for _ in range(n)]


def _mse_fwd_bwd(model):
    """forward under bf16 autocast, an MSE loss, backward: the function a graphed training step captures."""
    def fwd_bwd(x, y):
        with amp.autocast("cuda", dtype=flame.bfloat16):
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        loss.backward()
        return loss.detach()
    return fwd_bwd


@pytest.mark.gpu
def test_graphed_training_step_matches_eager_steps():
    """forward + loss + backward captured (autocast, bf16 weights, fp32 LoRA-like params); the optimizer runs eagerly
    between replays on the gradients the graph accumulated. Same numbers as the eager run."""
    data = _batches(1)

    def run(use_graph):
        model = _mlp_on_cuda()
        opt = flame_nn.optim.AdamW(model.parameters(), lr=1e-2)
        step = graphed(_mse_fwd_bwd(model), warmup=2, enabled=use_graph)
        losses = []
        for x, y in data:
            loss = step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=False)  # graph mode: the .grad views stay, the graph accumulates into them
            losses.append(loss.item())
        return losses, [p.detach().float().numpy() for p in model.parameters()], step
    eager_l, eager_p, _ = run(False)
    graph_l, graph_p, step = run(True)
    assert step.graph is not None
    np.testing.assert_allclose(graph_l, eager_l, rtol=1e-5)
    for a, b in zip(graph_p, eager_p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_graphed_step_allocates_lazy_gradient_buffers_inside_the_capture(monkeypatch):
    """grad_pool.register(..., lazy=True): no gradient storage before the capture (the warm-up's was released by
    zero_grad(set_to_none=True)); the capture allocates it from the graph's private memory, each replay rewrites it,
    set_to_none keeps it while the graph lives. Same numbers as eager steps with eager buffers."""
    from flame_core import grad_pool
    monkeypatch.setattr(grad_pool, "LAZY_CHUNK_BYTES", 4096)  # one buffer per weight, several per step
    data = _batches(2)

    def run(lazy):
        model = _mlp_on_cuda()
        bufs = grad_pool.register(model.parameters(), lazy=True) if lazy else []
        opt = flame_nn.optim.AdamW(model.parameters(), lr=1e-2)
        step = graphed(_mse_fwd_bwd(model), warmup=2, enabled=lazy)
        losses = []
        for i, (x, y) in enumerate(data):
            if lazy and i == 2:  # the capture step
                assert not any(b.resident for b in bufs)
            loss = step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=step.graph is None)
            losses.append(loss.item())
            if lazy and step.graph is not None:
                assert all(b.resident and b._graph() is step.graph for b in bufs)
        if lazy:
            opt.zero_grad(set_to_none=True)  # the graph lives: its gradient memory stays
            assert all(b.resident for b in bufs)
            step.reset()
            opt.zero_grad(set_to_none=True)
            assert not any(b.resident for b in bufs)
        return losses, [p.detach().float().numpy() for p in model.parameters()], len(bufs)
    eager_l, eager_p, _ = run(False)
    graph_l, graph_p, n_bufs = run(True)
    assert n_bufs >= 3
    np.testing.assert_allclose(graph_l, eager_l, rtol=1e-5)
    for a, b in zip(graph_p, eager_p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_failed_capture_leaves_lazy_gradients_none():
    """The capture's work never ran: lazy gradient storage it allocated (and the .grad set to its views) is dropped,
    and an eager backward after it gives the true gradient."""
    from flame_core import grad_pool
    w = flame_nn.Parameter(flame.randn(64, 64, device="cuda"))
    (buf,) = grad_pool.register([w], lazy=True)
    x = flame.randn(8, 64, device="cuda")

    def fwd_bwd(a):
        (a @ w).square().sum().backward()
        raise RuntimeError("after backward")
    g = CUDAGraph()
    with pytest.raises(RuntimeError, match="after backward"):
        with graph(g):
            fwd_bwd(x)
    assert w.grad is None and not buf.resident
    (x @ w).square().sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * x.numpy().T @ (x.numpy() @ w.detach().numpy()), rtol=1e-4,
                               atol=1e-3)


@pytest.mark.gpu
def test_graphed_alias_inputs_captures_on_the_callers_tensors():
    x = flame.randn(64, 64, device="cuda")
    w = flame.randn(64, 64, device="cuda")
    step = graphed(lambda a: (a @ w).relu().sum(0), warmup=1, alias_inputs=True)
    step(x)
    from flame_core import memory
    before = memory.memory_allocated("cuda")
    out = step(x)  # the capture: no copy of x
    assert step.static_args[0].data_ptr() == x.data_ptr()
    assert memory.memory_allocated("cuda") - before < x.numel() * 4
    np.testing.assert_allclose(out.numpy(), (x @ w).relu().sum(0).numpy(), rtol=1e-5, atol=1e-5)
    y = flame.randn(64, 64, device="cuda")
    out = step(y)  # copied into x's storage, then replayed
    np.testing.assert_allclose(out.numpy(), (y @ w).relu().sum(0).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x.numpy(), y.numpy())
    step.reset()


@pytest.mark.gpu
def test_random_draws_are_refused_while_capturing():
    g = CUDAGraph()
    with pytest.raises(GraphCaptureError, match="random numbers"):
        with graph(g):
            flame.randn(8, device="cuda")
    assert g._graph is None
    flame.randn(8, device="cuda")  # the stream is usable again


@pytest.mark.gpu
def test_graph_memory_survives_empty_cache():
    from flame_core import memory
    x = flame.randn(1024, 1024, device="cuda")
    g = CUDAGraph()
    with graph(g):
        y = (x * 3).sum(0)
    g.replay()
    want = y.numpy().copy()
    memory.empty_cache()
    junk = [flame.zeros(1024, 1024, device="cuda") + 7 for _ in range(4)]  # eager allocations may not land on y
    g.replay()
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)
    del junk
    g.reset()
    assert backend.cuda_available()


def test_conv_gemms_of_cuda_arrays_go_through_flame_cublas(monkeypatch):
    """conv2d's im2col GEMMs on CuPy arrays call flame_core.kernels.gemm (cuBLAS on the current stream); CuPy's own
    matmul refuses to run while a CUDA graph is captured, so a graphed SDXL step fell back to eager. Checked on the
    CPU with a stand-in array module for CUDA."""
    import types

    from flame_core.kernels import gemm
    from flame_core.ops.conv import matmul as conv
    calls = []

    def flame_matmul(a, b, out=None, beta=0.0):
        calls.append((a.dtype, out is not None))
        r = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
        if out is None:
            return r
        out[...] = r
        return out

    def cupy_matmul(a, b, out=None):
        raise RuntimeError("calling cuBLAS API during stream capture is currently unsupported")

    fake_xp = types.SimpleNamespace(matmul=cupy_matmul)
    monkeypatch.setattr(conv, "backend", types.SimpleNamespace(xp_of=lambda a: fake_xp))
    monkeypatch.setattr(conv, "_gemm", types.SimpleNamespace(supported=gemm.supported, matmul=flame_matmul))
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float16, flame.bfloat16.np):
        a, b = rng.standard_normal((2, 6, 5)).astype(dt), rng.standard_normal((2, 5, 7)).astype(dt)
        out = np.empty((2, 6, 7), dt)
        assert conv.mm(a, b, out) is out and conv.mm(a[0], b[0]).shape == (6, 7)
        np.testing.assert_allclose(out.astype(np.float32), np.matmul(a.astype(np.float32), b.astype(np.float32)),
                                   rtol=1e-2, atol=1e-2)
    assert [c[0] for c in calls] == [np.float32] * 2 + [np.float16] * 2 + [flame.bfloat16.np] * 2
    with pytest.raises(RuntimeError, match="cuBLAS"):  # float64: CuPy's matmul (training runs in float32 or lower)
        conv.mm(rng.standard_normal((3, 3)), rng.standard_normal((3, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convolutions_forward_and_backward_capture_with_the_eager_numbers(dtype):
    """A captured conv2d forward + backward (3x3, strided, 1x1, grouped; im2col + GEMM at these sizes) replays the
    eager numbers: its GEMMs go through flame_core.kernels.gemm, which works while capturing."""
    dt = getattr(flame, dtype)
    rng = np.random.default_rng(0)

    def leaf(*shape, scale=1.0):
        return flame.tensor(scale * rng.standard_normal(shape), dtype=dt, device="cuda", requires_grad=True)
    x = leaf(2, 8, 12, 12)
    convs = [(leaf(16, 8, 3, 3, scale=0.1), leaf(16, scale=0.1), dict(padding=1)),
             (leaf(16, 8, 3, 3, scale=0.1), None, dict(stride=2, padding=1)),
             (leaf(16, 8, 1, 1, scale=0.1), leaf(16, scale=0.1), {}),
             (leaf(16, 4, 3, 3, scale=0.1), None, dict(padding=1, groups=2))]
    leaves = [x] + [t for w, b, _ in convs for t in (w, b) if t is not None]

    def step():
        for t in leaves:
            t.grad = None
        loss = sum((F.conv2d(x, w, b, **kw).float() ** 2).mean() for w, b, kw in convs)
        loss.backward()
        return loss.detach()
    want = [step().numpy()] + [t.grad.float().numpy() for t in leaves]
    g = CUDAGraph()
    with graph(g):
        out = step()
    g.replay()
    got = [out.numpy()] + [t.grad.float().numpy() for t in leaves]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
