"""Linear.forward_split: a fused projection's output parts as views of one GEMM (linear_low_rank with `splits`),
whose backward takes the parts' gradients without concatenating them. Same numbers and gradients as
`self(x).split(...)` (float64 central differences; parts without a gradient count as zero), adapters inside a part
fused, an adapter across parts or a subclass falls back to the module's own forward, and Flux's single block records
no Split node for linear1."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_core.autograd.gradcheck import gradcheck
from flame_core.ops import linear as core_linear
from flame_core.ops.linear import linear_low_rank


def _t(rng, *shape, grad=True):
    return flame.tensor(rng.standard_normal(shape), dtype=flame.float64, requires_grad=grad)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.lists(st.integers(1, 4), min_size=1, max_size=4), st.booleans(),
       st.data())
def test_split_outputs_gradcheck(n, n_in, sizes, bias, data):
    rng = np.random.default_rng(n * 97 + n_in * 7 + len(sizes))
    n_out = sum(sizes)
    x, w = _t(rng, n, n_in), _t(rng, n_out, n_in)
    b = _t(rng, n_out) if bias else None
    p = data.draw(st.integers(0, len(sizes) - 1))           # one LoRA on rows inside part p
    lo = sum(sizes[:p])
    a1, b1 = _t(rng, 2, n_in), _t(rng, sizes[p], 2)
    used = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    used[data.draw(st.integers(0, len(sizes) - 1))] = True   # at least one part feeds the loss
    r = [flame.tensor(rng.standard_normal((n, m)), dtype=flame.float64) for m in sizes]

    def fn(x, w, a1, b1, *bb):
        parts = linear_low_rank(x, w, bb[0] if bb else None, [(a1, b1, lo, lo + sizes[p], 0.7)], splits=sizes)
        return sum((q * rr).sum() for q, rr, u in zip(parts, r, used) if u)
    assert gradcheck(fn, (x, w, a1, b1) + ((b,) if bias else ()))


def _pair(rng, sizes, rows, bias=True):
    lin = flame_nn.Linear(5, sum(sizes), bias=bias, dtype=flame.float64)
    if rows is not None:
        A.adapt(lin)
        ad = A.LoRA(5, rows[1] - rows[0], rank=2, alpha=2, dtype=flame.float64)
        with flame.no_grad():
            ad.lora_B.copy_(flame.tensor(rng.standard_normal((rows[1] - rows[0], 2)), dtype=flame.float64))
        lin.add_adapter("default", ad, rows=rows)
    return lin


def _grads(lin, x, split):
    for q in lin.parameters():
        q.grad = None
    x = x.detach().requires_grad_(True)
    sizes = (3, 2, 4)
    parts = lin.forward_split(x, sizes) if split else lin(x).split(list(sizes), dim=-1)
    assert [tuple(q.shape) for q in parts] == [(2, 3, m) for m in sizes]
    loss = sum((q * (i + 1.5)).sin().sum() for i, q in enumerate(parts))
    loss.backward()
    return [q.detach().numpy() for q in parts], x.grad.numpy(), [q.grad.numpy() for q in lin.parameters()]


@pytest.mark.parametrize("rows", [None, (3, 5), (0, 9), (2, 4)])
def test_forward_split_equals_split_of_the_output(rows, rng):
    lin = _pair(rng, (3, 2, 4), rows)
    x = flame.tensor(rng.standard_normal((2, 3, 5)), dtype=flame.float64)
    calls = []
    orig = core_linear.LinearLowRank.apply
    core_linear.LinearLowRank.apply = lambda *a: calls.append(a[4]) or orig(*a)
    try:
        got = _grads(lin, x, True)
    finally:
        core_linear.LinearLowRank.apply = orig
    want = _grads(lin, x, False)
    for g, w_ in zip(got[0] + [got[1]] + got[2], want[0] + [want[1]] + want[2]):
        np.testing.assert_allclose(g, w_, rtol=1e-12, atol=1e-12)
    inside = rows is None or rows in ((3, 5),)             # (0, 9) and (2, 4) cross parts: the general path
    assert (calls == [(3, 2, 4)]) == inside, calls


def test_forward_split_of_a_subclass_uses_its_own_forward(rng):
    class Doubled(flame_nn.Linear):
        def forward(self, input):
            return super().forward(input) * 2

    lin = Doubled(4, 5, dtype=flame.float64)
    x = flame.tensor(rng.standard_normal((3, 4)), dtype=flame.float64)
    a, b = lin.forward_split(x, (2, 3))
    np.testing.assert_allclose(flame.cat((a, b), dim=-1).detach().numpy(), lin(x).detach().numpy())


def test_forward_split_rejects_sizes_that_do_not_sum(rng):
    lin = flame_nn.Linear(4, 5, dtype=flame.float64)
    with pytest.raises(flame.errors.ShapeError, match="sum to the 5 output"):
        lin.forward_split(flame.zeros(2, 4, dtype=flame.float64), (2, 2))


def test_flux_single_block_records_no_split_of_linear1(rng):
    from flame_models.bfl.layers import SingleStreamBlock
    blk = SingleStreamBlock(16, 2, 2.0, dtype=flame.float64)
    blk.modulation.requires_grad_(False)      # its chunks would be a Split too; vec needs no gradient either
    x = flame.tensor(rng.standard_normal((1, 6, 16)), dtype=flame.float64, requires_grad=True)
    vec = flame.tensor(rng.standard_normal((1, 16)), dtype=flame.float64)
    pe = flame.zeros(1, 1, 6, 4, 2, 2, dtype=flame.float64)
    pe[..., 0, 0] = 1
    pe[..., 1, 1] = 1
    y = blk(x, vec, pe)
    seen, stack, names = set(), [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(node.name())
        stack.extend(e[0] for e in node.next_functions if e is not None)
    assert "LinearLowRankBackward" in names, names
    assert "SplitBackward" not in names and "UnbindBackward" not in names, names
    y.sum().backward()
    assert x.grad is not None and np.isfinite(x.grad.numpy()).all()
