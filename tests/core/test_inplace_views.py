"""In-place ops on views reach the base's autograd graph (PyTorch's CopySlices semantics): backward through the base,
and through any view of it taken before or after the op, sees the modification. Exact repros plus hypothesis gradient
checks (float64 central differences) over random view chains (slices with steps, reversed slices, integer indices,
transposes, reshapes) of contiguous and non-contiguous bases."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.errors import AutogradError, ShapeError


def npa(t):
    return t.detach().numpy()


# ----------------------------------------------------------------------------- PyTorch's answers
def test_mul_on_slice_reaches_the_base(device):
    a = flame.ones(4, device=device, requires_grad=True)
    b = a * 1
    b[1:3].mul_(3)
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [1, 3, 3, 1])
    np.testing.assert_array_equal(npa(b), [1, 3, 3, 1])


def test_mul_on_a_row_of_a_transpose(device):
    a = flame.ones(2, 2, device=device, requires_grad=True)
    b = a.clone()
    b.t()[0].mul_(5)
    (b * flame.tensor([[1., 2], [3, 4]], device=device)).sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [[5, 2], [15, 4]])


def test_zero_on_a_row(device):
    a = flame.ones(2, 2, device=device, requires_grad=True)
    b = a * 1
    b[0].zero_()
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [[0, 0], [1, 1]])


def test_setitem_through_a_chain_of_views(device):
    a = flame.ones(4, device=device, requires_grad=True)
    b = a * 1
    b[1:3][0] = 5.
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [1, 0, 1, 1])
    np.testing.assert_array_equal(npa(b), [1, 5, 1, 1])


def test_view_taken_before_an_in_place_op_on_the_base(device):
    a = flame.ones(3, device=device, requires_grad=True)
    b = a * 2
    c = b[0:2]
    b.mul_(3)
    c.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [6, 6, 0])


def test_views_before_and_after_an_in_place_op_on_another_view(device):
    a = flame.ones(4, device=device, requires_grad=True)
    b = a * 1
    before = b[0:2]
    b[1:3].mul_(3)
    after = b[0:2]
    (before * 1).sum().backward(retain_graph=True)
    np.testing.assert_array_equal(npa(a.grad), [1, 3, 0, 0])
    a.grad = None
    after.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [1, 3, 0, 0])


def test_copy_into_a_view_gives_the_source_a_gradient(device):
    a = flame.ones(4, device=device, requires_grad=True)
    w = flame.ones(2, device=device, requires_grad=True)
    b = a * 1
    b[1:3].copy_(w * 3)
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [1, 0, 0, 1])
    np.testing.assert_array_equal(npa(w.grad), [3, 3])


def test_a_base_that_needed_no_grad_joins_the_graph(device):
    w = flame.ones(2, device=device, requires_grad=True)
    b = flame.zeros(4, device=device)
    c = b[0:3]  # taken before b joined the graph
    b[1:3].copy_(w * 3)
    assert b.requires_grad and not b.is_leaf and c.requires_grad
    (c * flame.tensor([1., 2., 3.], device=device)).sum().backward()
    np.testing.assert_array_equal(npa(w.grad), [6, 9])


def test_whole_view_and_zero_dim_view(device):
    a = flame.ones(4, device=device, requires_grad=True)
    b = a * 1
    b.view(2, 2).mul_(2)
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [2, 2, 2, 2])
    a = flame.ones(2, 3, device=device, requires_grad=True)
    b = a * 1
    b[1, 2].mul_(7)  # a full integer index is a 0-d view (it writes into b)
    assert b[1, 2].item() == 7
    b.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [[1, 1, 1], [1, 1, 7]])


def test_expanded_view_taken_before_an_in_place_op_on_the_base(device):
    a = flame.ones(1, 4, device=device, requires_grad=True)
    b = a * 1
    e = b.expand(3, 4)
    b.mul_(2)
    e.sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [[6, 6, 6, 6]])


def test_reversed_slice(device):
    a = flame.tensor([1., 2., 3., 4.], device=device, requires_grad=True)
    b = a * 1
    b[::-1][0:2].mul_(flame.tensor([10., 100.], device=device))  # elements 3 and 2
    np.testing.assert_array_equal(npa(b), [1, 2, 300, 40])
    (b * flame.tensor([1., 2., 3., 4.], device=device)).sum().backward()
    np.testing.assert_array_equal(npa(a.grad), [1, 2, 300, 40])


def test_non_contiguous_reshape_that_numpy_makes_a_view_shares_the_version(device):
    a = flame.zeros(3, 4, device=device)
    r = a.t().reshape(4, 1, 3)  # only adds a unit dim: a view of a's storage
    r.add_(1)
    assert float(a.sum()) == 12 and r._version is a._version


def test_double_backward_through_copy_slices(device):
    a = flame.tensor([1., 2., 3.], dtype=flame.float64, device=device, requires_grad=True)
    b = a * a
    b[1:].mul_(a[:2])  # b = [a0^2, a1^2 a0, a2^2 a1]
    (g,) = flame.autograd.grad(b.sum(), [a], create_graph=True)
    np.testing.assert_allclose(npa(g), [2 * 1 + 4, 2 * 2 * 1 + 9, 2 * 3 * 2])
    (gg,) = flame.autograd.grad(g.sum(), [a])
    np.testing.assert_allclose(npa(gg), [2 + 2 * 2, 2 * 2 + 2 * 1 + 2 * 3, 2 * 3 + 2 * 2])


# ----------------------------------------------------------------------------- errors
def test_in_place_on_a_view_of_a_leaf_that_requires_grad_raises(device):
    a = flame.ones(3, device=device, requires_grad=True)
    for op in (lambda v: v.add_(1), lambda v: v.zero_(), lambda v: v.__setitem__(0, 2.), lambda v: v.mul_(a[1:])):
        with pytest.raises(AutogradError, match="view of a leaf"):
            op(a[0:2])
    np.testing.assert_array_equal(npa(a), [1, 1, 1])
    with flame.no_grad():
        a[0:2].add_(1)  # allowed without grad recording, as in PyTorch
    np.testing.assert_array_equal(npa(a), [2, 2, 1])


def test_in_place_on_a_view_made_under_no_grad_raises_when_the_base_needs_grad(device):
    a = flame.ones(4, device=device, requires_grad=True)
    b = a * 1
    with flame.no_grad():
        v = b[0:2]
    with pytest.raises(AutogradError, match="no_grad"):
        v.mul_(2)
    with pytest.raises(AutogradError, match="no_grad"):
        v[0] = 3.


def test_in_place_on_an_expanded_view_raises(device):
    b = flame.ones(1, 3, device=device) * flame.ones(1, 3, device=device, requires_grad=True)
    with pytest.raises(ShapeError, match="expanded"):
        b.expand(2, 3).mul_(2)


def test_detach_in_place_of_a_view_with_history_raises(device):
    b = flame.ones(3, device=device, requires_grad=True) * 2
    with pytest.raises(AutogradError, match="detach views in-place"):
        b[0:2].detach_()
    c = b[0:2]
    b.detach_()  # the base loses its history, and so do its views
    assert not b.requires_grad and not c.requires_grad
    with flame.no_grad():
        v = b[0:2]
    assert v.detach_() is v and not v.requires_grad


def test_saved_tensor_check_still_fires_for_views(device):
    a = flame.ones(3, device=device, requires_grad=True)
    b = a.clone()
    c = b[0:2]
    d = c * c
    b.add_(1)
    with pytest.raises(AutogradError, match="modified by an in-place operation"):
        d.sum().backward()


# ----------------------------------------------------------------------------- hypothesis gradient checks
def _tensor(rng, shape, device, noncontig=False, requires_grad=True):
    a = rng.uniform(-2, 2, size=shape)
    if noncontig and len(shape) >= 2:  # a transposed layout: ops on it produce non-C-contiguous (root) arrays
        t = flame.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2)), dtype=flame.float64, device=device)
        return t.transpose(-1, -2).detach().requires_grad_(requires_grad)
    return flame.tensor(a, dtype=flame.float64, device=device, requires_grad=requires_grad)


@st.composite
def view_chains(draw, shape):
    """A list of view steps valid for `shape`, and the view's shape."""
    cur = np.zeros(shape)
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["index", "transpose", "flatten", "reverse"]))
        if cur.ndim == 0:
            break
        if kind == "transpose" and cur.ndim >= 2:
            i, j = draw(st.permutations(range(cur.ndim)))[:2]
            steps.append(("transpose", i, j))
            cur = cur.swapaxes(i, j)
        elif kind == "flatten":
            steps.append(("flatten",))
            cur = cur.reshape(-1)
        elif kind == "reverse":
            steps.append(("index", (slice(None, None, -1),)))
            cur = cur[::-1]
        else:
            idx = []
            for n in cur.shape:
                if draw(st.booleans()) and n > 1:
                    start = draw(st.integers(0, n - 1))
                    stop = draw(st.integers(start + 1, n))
                    idx.append(slice(start, stop, draw(st.sampled_from([1, 2]))))
                elif draw(st.integers(0, 3)) == 0:
                    idx.append(draw(st.integers(-n, n - 1)))
                else:
                    idx.append(slice(None))
            steps.append(("index", tuple(idx)))
            cur = cur[tuple(idx)]
    return steps, cur.shape


def _replay(t, steps):
    for s in steps:
        if s[0] == "transpose":
            t = t.transpose(s[1], s[2])
        elif s[0] == "flatten":
            t = t.reshape(-1)
        else:
            t = t[s[1]]
    return t


OPS = {
    "mul_": lambda v, w: v.mul_(w),
    "add_alpha": lambda v, w: v.add_(w, alpha=0.5),
    "div_": lambda v, w: v.div_(w * w + 1),
    "copy_": lambda v, w: v.copy_(w * 2),
    "setitem": lambda v, w: v.__setitem__(Ellipsis, w.tanh()),
    "zero_then_add": lambda v, w: v.zero_().add_(w),
    "sigmoid_then_mul": lambda v, w: v.sigmoid_().mul_(w),
    "clamp_then_mul": lambda v, w: v.clamp_(-1.5, 1.5).mul_(w),
}


@pytest.mark.parametrize("op", sorted(OPS))
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), data=st.data(),
       noncontig=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_in_place_on_a_view_gradcheck(device, op, shape, data, noncontig, seed):
    steps, vshape = data.draw(view_chains(shape))
    rng = np.random.default_rng(seed)
    a = _tensor(rng, shape, device, noncontig)
    w = _tensor(rng, vshape, device)
    coef = flame.tensor(rng.uniform(0.5, 1.5, size=shape), dtype=flame.float64, device=device)

    def f(a, w):
        b = a * 1.3
        before = _replay(b, steps)  # taken before the op: must see it
        first = b.reshape(-1)[0:1]
        OPS[op](_replay(b, steps), w)
        after = _replay(b, steps)
        return b * coef, before * 2.0, (after * after).sum(), first * 3.0

    assert gradcheck(f, (a, w))


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), data=st.data(),
       noncontig=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_in_place_on_the_base_seen_by_earlier_views_gradcheck(device, shape, data, noncontig, seed):
    steps, _ = data.draw(view_chains(shape))
    rng = np.random.default_rng(seed)
    a = _tensor(rng, shape, device, noncontig)
    w = _tensor(rng, shape, device)

    def f(a, w):
        b = a.sin()  # saves its input, not b
        v = _replay(b, steps)
        b.mul_(w)
        return v * 1.0, b

    assert gradcheck(f, (a, w))


@pytest.mark.parametrize("op", ["mul_", "setitem", "div_"])
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), data=st.data(),
       seed=st.integers(0, 2 ** 16))
def test_in_place_on_a_view_gradgradcheck(device, op, shape, data, seed):
    steps, vshape = data.draw(view_chains(shape))
    rng = np.random.default_rng(seed)
    a = _tensor(rng, shape, device)
    w = _tensor(rng, vshape, device)

    def f(a, w):
        b = a * a
        before = _replay(b, steps)
        OPS[op](_replay(b, steps), w)
        return b * b, before * w

    assert gradgradcheck(f, (a, w))
