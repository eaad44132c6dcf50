"""The fused ops models build on: split / unbind as views in one autograd node, GELU(tanh) read in place from a
strided view, GEGLU in one op, and linear_cat2 (linear over a concatenation without building it)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.ops.linear import linear_cat2


def test_split_and_unbind_are_views_in_one_node(device):
    x = flame.randn(2, 7, 3, device=device, requires_grad=True)
    a, b, c = x.split([2, 4, 1], dim=1)
    assert a.grad_fn is b.grad_fn is c.grad_fn and a.grad_fn.name() == "SplitBackward"
    assert (a._base is x) and (c._base is x)  # views: no copy
    p, q = x.unbind(0)
    assert p.grad_fn is q.grad_fn and p.grad_fn.name() == "UnbindBackward"
    # an unused piece gets a zero gradient; used ones their own
    (b.sum() * 2 + q[0].sum()).backward()
    want = np.zeros((2, 7, 3))
    want[:, 2:6] = 2
    want[1, 0] += 1
    np.testing.assert_array_equal(x.grad.numpy(), want)


def test_unbind_of_a_vector_gives_zero_dim_views(device):
    x = flame.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    parts = x.unbind(0)
    assert [p.shape for p in parts] == [(), (), ()]
    (parts[0] * 3 + parts[2]).backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 0.0, 1.0])


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(0, 3))
def test_gelu_tanh_of_a_strided_view_matches_the_contiguous_op(b, l, m, start):
    rng = np.random.default_rng(b * 100 + l * 10 + m)
    h = flame.tensor(rng.standard_normal((b, l, start + m + 2)), dtype=flame.float64, requires_grad=True)

    def strided(h):
        return F.gelu(h[..., start:start + m], approximate="tanh")   # a view whose rows are strided

    def contiguous(h):
        return F.gelu(h[..., start:start + m].contiguous(), approximate="tanh")
    np.testing.assert_allclose(strided(h).detach().numpy(), contiguous(h).detach().numpy(), rtol=1e-15, atol=1e-15)
    assert gradcheck(strided, (h,))


def test_gelu_tanh_strided_rows_in_float32_and_bfloat16(device):
    """On cuda the strided view takes the rows kernel (kernels.gelu_rows), the contiguous copy the plain one: the
    same values and gradients up to the last bit of the dtype."""
    rng = np.random.default_rng(0)
    for dt, tol in ((flame.float32, 1e-6), (flame.bfloat16, 1e-2)):
        h = flame.tensor(rng.standard_normal((2, 33, 3 * 40 + 96)), device=device).to(dt)
        views = [h[..., 120:].detach().requires_grad_(), None]
        views[1] = views[0].detach().contiguous().requires_grad_()
        ys = [F.gelu(v, approximate="tanh") for v in views]
        for y in ys:
            (y.float() * 0.5).sum().backward()
        for a, b_ in ((ys[0], ys[1]), (views[0].grad, views[1].grad)):
            np.testing.assert_allclose(a.float().detach().numpy(), b_.float().detach().numpy(), rtol=tol, atol=tol)


def test_linear_cat2_matches_linear_over_the_concatenation(device):
    """linear_cat2 with the MLP half a strided view (as in Flux's single block) gives the composed ops' values, and
    its gradients pass a float64 gradcheck."""
    rng = np.random.default_rng(3)
    h = flame.tensor(rng.standard_normal((2, 5, 14)), dtype=flame.float64, device=device, requires_grad=True)
    w = flame.tensor(rng.standard_normal((6, 4 + 8)), dtype=flame.float64, device=device, requires_grad=True)
    b = flame.tensor(rng.standard_normal(6), dtype=flame.float64, device=device, requires_grad=True)

    def fused(h, w, b):
        attn, mlp = h[..., :4], h[..., 6:]
        return linear_cat2(attn, F.gelu(mlp, approximate="tanh"), w, b)

    def composed(h, w, b):
        attn, mlp = h[..., :4], h[..., 6:]
        return flame_nn.functional.linear(flame.cat((attn, F.gelu(mlp.contiguous(), approximate="tanh")), dim=-1),
                                          w, b)
    np.testing.assert_allclose(fused(h, w, b).detach().numpy(), composed(h, w, b).detach().numpy(), rtol=1e-12,
                               atol=1e-12)
    assert gradcheck(fused, (h, w, b))


@pytest.mark.parametrize("dtype", [flame.float32, flame.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_cat2_in_low_precision_matches_the_float64_composition(device, dtype, with_bias):
    """The cuda path puts the bias in the first GEMM's epilogue and accumulates the second GEMM onto it (beta = 1):
    the forward against float64 within the dtype's rounding, on a strided MLP half as in Flux's single block."""
    rng = np.random.default_rng(11)
    h64 = rng.standard_normal((2, 37, 96 + 8 + 160))
    w64, b64 = rng.standard_normal((72, 96 + 160)) / 16, rng.standard_normal(72)
    h = flame.tensor(h64, dtype=dtype, device=device)
    w = flame.tensor(w64, dtype=dtype, device=device)
    b = flame.tensor(b64, dtype=dtype, device=device) if with_bias else None
    y = linear_cat2(h[..., :96], h[..., 104:], w, b).float().numpy()
    r = lambda a: a.astype(dtype.np).astype(np.float64)  # noqa: E731 -- the inputs as the dtype holds them
    want = np.concatenate([r(h64)[..., :96], r(h64)[..., 104:]], -1) @ r(w64).T + (r(b64) if with_bias else 0)
    tol = 1e-5 if dtype == flame.float32 else 3e-2
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol * np.abs(want).max())


def _geglu_composed(x, approximate, gate_first=False):
    a, gate = x.chunk(2, dim=-1)
    if gate_first:
        a, gate = gate, a
    return a * F.gelu(gate, approximate=approximate)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.sampled_from(["none", "tanh"]), st.booleans())
def test_geglu_matches_the_composed_ops_and_passes_gradcheck(b, l, c, approximate, gate_first):
    rng = np.random.default_rng(b * 100 + l * 10 + c)
    x = flame.tensor(rng.standard_normal((b, l, 2 * c)) * 2, dtype=flame.float64, requires_grad=True)
    np.testing.assert_allclose(F.geglu(x, approximate, gate_first).detach().numpy(),
                               _geglu_composed(x, approximate, gate_first).detach().numpy(), rtol=1e-13, atol=1e-13)
    assert gradcheck(lambda x: F.geglu(x, approximate, gate_first), (x,))
    assert gradgradcheck(lambda x: F.geglu(x, approximate, gate_first), (x,))   # the create_graph backward


def test_geglu_in_low_precision_matches_float64_and_refuses_odd_widths(device):
    rng = np.random.default_rng(5)
    x64 = rng.standard_normal((3, 17, 2 * 40)) * 2
    g64 = rng.standard_normal((3, 17, 40))
    want = F.geglu(flame.tensor(x64, dtype=flame.float64)).numpy()
    xr = flame.tensor(x64, dtype=flame.float64, requires_grad=True)
    _geglu_composed(xr, "none").backward(flame.tensor(g64, dtype=flame.float64))
    for dt, tol in ((flame.float32, 1e-5), (flame.bfloat16, 2e-2), (flame.float16, 3e-3)):
        x = flame.tensor(x64, device=device).to(dt).detach().requires_grad_()
        y = F.geglu(x)
        assert y.dtype == dt and tuple(y.shape) == (3, 17, 40)
        y.backward(flame.tensor(g64, device=device).to(dt))
        np.testing.assert_allclose(y.detach().float().numpy(), want, rtol=tol, atol=tol * np.abs(want).max())
        np.testing.assert_allclose(x.grad.float().numpy(), xr.grad.numpy(), rtol=tol,
                                   atol=tol * np.abs(xr.grad.numpy()).max())
    import pytest
    with pytest.raises(ValueError, match="must be even"):
        F.geglu(flame.randn(2, 5, device=device))
    with pytest.raises(ValueError, match="approximate"):
        F.geglu(flame.randn(2, 4, device=device), approximate="fast")


def test_geglu_of_a_temporary_reuses_its_input_for_the_gradient_unless_the_graph_is_kept(device):
    from flame_core.ops.activation import geglu_of_temporary
    rng = np.random.default_rng(9)
    w = flame.tensor(rng.standard_normal((6, 10)), device=device, requires_grad=True)
    x = flame.tensor(rng.standard_normal((2, 7, 6)), device=device)
    g = flame.tensor(rng.standard_normal((2, 7, 5)), device=device)

    def run(fn, retain=False):
        w.grad = None
        h = x @ w                       # the temporary
        y = fn(h)
        y.backward(g, retain_graph=retain)
        return y.detach().numpy(), w.grad.numpy().copy(), h, y
    y0, gw0, h0, _ = run(F.geglu)
    kept = h0.detach().numpy().copy()
    y1, gw1, h1, _ = run(geglu_of_temporary)
    np.testing.assert_allclose(y1, y0, rtol=1e-6)
    np.testing.assert_allclose(gw1, gw0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(h0.detach().numpy(), kept)            # the plain op leaves its input alone
    assert not np.allclose(h1.detach().numpy(), kept)                   # the temporary now holds the gradient
    y2, gw2, h2, y2t = run(geglu_of_temporary, retain=True)             # a kept graph: the input stays
    np.testing.assert_allclose(h2.detach().numpy(), kept, rtol=1e-6)
    w.grad = None
    y2t.backward(g)                                                     # and a second backward is still right
    np.testing.assert_allclose(w.grad.numpy(), gw0, rtol=1e-5, atol=1e-6)
