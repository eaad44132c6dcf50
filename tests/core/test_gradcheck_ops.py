"""Hypothesis gradient checks (float64 central differences) for every differentiable flame_core op:
random shapes including 0-d and size-1 dims, broadcasting, and non-contiguous inputs."""
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional
from flame_core.autograd import gradcheck, gradgradcheck

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
nonempty = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def _t(rng, shape, device, lo=-2.0, hi=2.0, noncontig=False, away_from=None):
    a = rng.uniform(lo, hi, size=shape)
    if away_from is not None:  # keep finite differences away from kinks
        a = np.where(np.abs(a - away_from) < 0.05, a + 0.1, a)
    if noncontig and len(shape) >= 2:
        t = flame.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2)), dtype=flame.float64, device=device)
        t = t.transpose(-1, -2)  # a non-contiguous view with the intended values
        t = t.detach().requires_grad_()
        if shape[-1] > 1 and shape[-2] > 1:
            assert not t.is_contiguous()
        return t
    return flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)


UNARY = {
    "neg": (lambda x: -x, None),
    "exp": (lambda x: x.exp(), None),
    "log": (lambda x: x.log(), (0.2, 2.0)),
    "log1p": (lambda x: x.log1p(), (-0.8, 2.0)),
    "sqrt": (lambda x: x.sqrt(), (0.2, 2.0)),
    "rsqrt": (lambda x: x.rsqrt(), (0.2, 2.0)),
    "sin": (lambda x: x.sin(), None),
    "cos": (lambda x: x.cos(), None),
    "tanh": (lambda x: x.tanh(), None),
    "sigmoid": (lambda x: x.sigmoid(), None),
    "relu": (lambda x: x.relu(), "kink"),
    "abs": (lambda x: x.abs(), "kink"),
    "gelu_erf": (lambda x: x.gelu(), None),
    "gelu_tanh": (lambda x: x.gelu(approximate="tanh"), None),
    "silu": (lambda x: x.silu(), None),
    "quick_gelu": (lambda x: flame_nn.functional.quick_gelu(x), None),
    "softplus": (lambda x: flame.softplus(x, beta=2.0), None),
    "erf": (lambda x: x.erf(), None),
    "clamp": (lambda x: x.clamp(-0.5, 0.7), "clamp"),
    "pow_scalar": (lambda x: x ** 3, None),
    "rpow": (lambda x: 2.0 ** x, None),
    "reciprocal": (lambda x: x.reciprocal(), (0.3, 2.0)),
    "square": (lambda x: x.square(), None),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=shapes, noncontig=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_unary_gradcheck(device, name, shape, noncontig, seed):
    fn, dom = UNARY[name]
    rng = np.random.default_rng(seed)
    lo, hi = dom if isinstance(dom, tuple) else (-2.0, 2.0)
    away = 0.0 if dom == "kink" else None
    x = _t(rng, shape, device, lo, hi, noncontig, away_from=away)
    if dom == "clamp":
        a = x.detach().numpy()
        a = np.where(np.abs(a + 0.5) < 0.05, a + 0.1, a)
        a = np.where(np.abs(a - 0.7) < 0.05, a + 0.1, a)
        x = flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)
    assert gradcheck(fn, (x,))


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a ** b,
    "maximum": lambda a, b: flame.maximum(a, b),
    "minimum": lambda a, b: flame.minimum(a, b),
    "lerp": lambda a, b: flame.lerp(a, b, 0.3),
    "where": lambda a, b: flame.where(a > 0.1, a, b),
    "atan_like": lambda a, b: (a * b).tanh() + a / (b * b + 1),
}


@st.composite
def broadcast_pair(draw):
    shape = draw(nonempty)
    other = list(shape)
    for i in range(len(other)):
        if draw(st.booleans()):
            other[i] = 1
    k = draw(st.integers(0, len(other)))
    return shape, tuple(other[k:])


@pytest.mark.parametrize("name", sorted(BINARY))
@given(shapes=broadcast_pair(), swap=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_binary_gradcheck_broadcast(device, name, shapes, swap, seed):
    rng = np.random.default_rng(seed)
    sa, sb = shapes if not swap else shapes[::-1]
    positive = name in ("pow", "div")
    a = _t(rng, sa, device, 0.5 if positive else -2, 2.0)
    b = _t(rng, sb, device, 0.5 if positive else -2, 2.0)
    if name in ("maximum", "minimum"):  # avoid ties where the derivative jumps
        b = flame.tensor(b.detach().numpy() + 0.37, dtype=flame.float64, device=device, requires_grad=True)
    assert gradcheck(BINARY[name], (a, b))


@given(shape=nonempty, seed=st.integers(0, 2 ** 16))
def test_scalar_operands_gradcheck(device, shape, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, shape, device, 0.5, 2.0)
    assert gradcheck(lambda x: (2.5 - x) * 3 / (1.5 + x) - 1 / x + x % 0.7, (x,))


REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "var": lambda x, d, k: x.var(d, keepdim=k) if x.numel() > 1 else x.var(d, keepdim=k, correction=0),
    "std": lambda x, d, k: x.std(d, keepdim=k, correction=0),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "prod": lambda x, d, k: x.prod(d if not isinstance(d, tuple) else None, keepdim=k),
    "norm": lambda x, d, k: x.norm(dim=d, keepdim=k),
    "logsumexp": lambda x, d, k: x.logsumexp(d if d is not None else tuple(range(x.ndim)), keepdim=k),
    "softmax": lambda x, d, k: x.softmax(d if isinstance(d, int) else -1),
    "log_softmax": lambda x, d, k: x.log_softmax(d if isinstance(d, int) else -1),
    "max_dim": lambda x, d, k: x.max(d if isinstance(d, int) else 0, keepdim=k).values,
    "cumsum": lambda x, d, k: x.cumsum(d if isinstance(d, int) else 0),
}


@st.composite
def shape_and_dim(draw):
    shape = draw(nonempty)
    kind = draw(st.sampled_from(["none", "int", "tuple"]))
    if kind == "none":
        return shape, None
    if kind == "int":
        return shape, draw(st.integers(-len(shape), len(shape) - 1))
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    return shape, tuple(dims)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@given(sd=shape_and_dim(), keepdim=st.booleans(), seed=st.integers(0, 2 ** 16), noncontig=st.booleans())
def test_reduction_gradcheck(device, name, sd, keepdim, seed, noncontig):
    shape, dim = sd
    axes = range(len(shape)) if dim is None else ([dim] if isinstance(dim, int) else dim)
    assume(name not in ("std", "var") or int(np.prod([shape[a] for a in axes])) > 1)  # 0 dof: nan
    if name in ("softmax", "log_softmax", "max_dim", "cumsum") and dim is None:
        dim = 0
    rng = np.random.default_rng(seed)
    # distinct values so max/min have a unique winner; prod away from zero
    n = int(np.prod(shape))
    vals = rng.permutation(n).reshape(shape) / max(n, 1) + 0.5 if name in ("amax", "amin", "max_dim", "prod") \
        else rng.uniform(-2, 2, size=shape)
    x = flame.tensor(vals, dtype=flame.float64, device=device, requires_grad=True)
    if noncontig and len(shape) >= 2:
        x = flame.tensor(np.ascontiguousarray(np.swapaxes(vals, -1, -2)), dtype=flame.float64,
                         device=device).transpose(-1, -2).detach().requires_grad_()
    assert gradcheck(lambda t: REDUCTIONS[name](t, dim, keepdim), (x,))


SHAPE_OPS = {
    "reshape": lambda x: x.reshape(-1),
    "flatten": lambda x: x.flatten(),
    "permute": lambda x: x.permute(*reversed(range(x.ndim))),
    "transpose": lambda x: x.transpose(0, -1),
    "unsqueeze_squeeze": lambda x: x.unsqueeze(1).squeeze(1) * x.unsqueeze(0).squeeze(0),
    "expand": lambda x: x.unsqueeze(0).expand(3, *x.shape),
    "repeat": lambda x: x.repeat(*([2] * x.ndim)),
    "chunk": lambda x: x.chunk(2, 0)[0] * 2,
    "split": lambda x: x.split(1, dim=-1)[-1],
    "unbind": lambda x: x.unbind(0)[0],
    "narrow": lambda x: x.narrow(0, 0, 1),
    "flip": lambda x: x.flip([0]),
    "roll": lambda x: x.roll(1, 0),
    "tril": lambda x: x.tril() if x.ndim >= 2 else x,
    "triu": lambda x: x.triu(1) if x.ndim >= 2 else x,
    "cat": lambda x: flame.cat([x, x * 2], 0),
    "stack": lambda x: flame.stack([x, x.exp()], -1),
    "getitem_slice": lambda x: x[::2],
    "getitem_int_none_ellipsis": lambda x: x[0, None, ...],
    "getitem_mask": lambda x: x[x > 0],
    "getitem_index_tensor": lambda x: x[flame.tensor([0, 0, x.shape[0] - 1], device=x.device)],
    "gather": lambda x: x.gather(0, flame.zeros(x.shape, dtype=flame.int64, device=x.device)),
    "index_select": lambda x: x.index_select(0, flame.tensor([0, 0], device=x.device)),
    "masked_fill": lambda x: x.masked_fill(x > 0.5, 0.25),
    "pad_constant": lambda x: flame.pad(x, (1, 2), value=0.5),
    "pad_replicate": lambda x: flame.pad(x, (2, 1), mode="replicate"),
    "pad_reflect": lambda x: flame.pad(x, (1, 1), mode="reflect") if x.shape[-1] > 1 else x,
    "contiguous_clone": lambda x: x.transpose(0, -1).contiguous().clone(),
    "movedim": lambda x: flame.movedim(x, 0, -1),
}


@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
@given(shape=nonempty, seed=st.integers(0, 2 ** 16))
def test_shape_op_gradcheck(device, name, shape, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, shape, device, away_from=0.0 if name == "getitem_mask" else None)
    if name == "masked_fill":
        a = x.detach().numpy()
        x = flame.tensor(np.where(np.abs(a - 0.5) < 0.05, a + 0.1, a), dtype=flame.float64, device=device,
                         requires_grad=True)
    assert gradcheck(SHAPE_OPS[name], (x,))


@given(m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), batch=st.sampled_from([(), (2,), (2, 1)]),
       seed=st.integers(0, 2 ** 16))
def test_matmul_gradcheck(device, m, k, n, batch, seed):
    rng = np.random.default_rng(seed)
    a = _t(rng, batch + (m, k), device)
    b = _t(rng, (k, n), device)
    v = _t(rng, (k,), device)
    assert gradcheck(lambda a, b: a @ b, (a, b))
    assert gradcheck(lambda a, v: a @ v, (a, v))
    assert gradcheck(lambda v, b: v @ b, (v, b))
    assert gradcheck(lambda v: v @ v, (v,))
    # the array backward's cases (equal batches; a gradient that is a transposed view) and the Tensor-op ones
    # (broadcast batches, 2-D @ batched)
    c = _t(rng, batch + (k, n), device)
    assert gradcheck(lambda a, c: a @ c, (a, c))
    assert gradcheck(lambda a, b: (a @ b).mT * 1.5, (a, b))
    assert gradcheck(lambda a, d: a @ d, (a, _t(rng, (1, k, n), device)))
    assert gradcheck(lambda e, c: e @ c, (_t(rng, (m, k), device), c))


@given(seed=st.integers(0, 2 ** 16))
def test_bmm_outer_einsum_gradcheck(device, seed):
    rng = np.random.default_rng(seed)
    a, b = _t(rng, (2, 3, 4), device), _t(rng, (2, 4, 2), device)
    assert gradcheck(flame.bmm, (a, b))
    u, v = _t(rng, (3,), device), _t(rng, (4,), device)
    assert gradcheck(flame.outer, (u, v))
    q, kk = _t(rng, (2, 3, 4), device), _t(rng, (2, 5, 4), device)
    assert gradcheck(lambda q, k: flame.einsum("bld,bmd->blm", q, k), (q, kk))
    assert gradcheck(lambda q: flame.einsum("bld->b", q), (q,))
    assert gradcheck(lambda q, k: flame.einsum("...d,...md->...m", q[:, 0], k), (q, kk))


@given(seed=st.integers(0, 2 ** 16))
def test_scatter_add_gradcheck(device, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (3, 4), device)
    src = _t(rng, (2, 4), device)
    idx = flame.tensor(rng.integers(0, 3, size=(2, 4)), device=device)
    assert gradcheck(lambda x, s: x.scatter_add(0, idx, s), (x, src))


# ---------------------------------------------------------------------------- double backward
DOUBLE = {
    "mul_exp": lambda x: (x * x.exp()).sum(),
    "tanh_sigmoid": lambda x: x.tanh() * x.sigmoid(),
    "silu_gelu": lambda x: x.silu() + x.gelu(approximate="tanh") + x.gelu(),
    "matmul": lambda x: x @ x.transpose(-1, -2),
    "sum_mean_var": lambda x: x.sum(0) + x.mean(-1, keepdim=True) + x.var(),
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(0),
    "div_sqrt": lambda x: x / (x * x + 1).sqrt(),
    "pow": lambda x: (x * x + 1) ** 1.5,
}


@pytest.mark.parametrize("name", sorted(DOUBLE))
@given(seed=st.integers(0, 2 ** 16))
def test_double_backward(device, name, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (2, 3), device)
    assert gradgradcheck(DOUBLE[name], (x,))


def test_gradcheck_detects_a_wrong_rule(device):
    class Wrong(flame.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x  # should be 2 * x

    x = flame.randn(3, dtype=flame.float64, device=device, requires_grad=True)
    assert not gradcheck(Wrong.apply, (x,), raise_exception=False)
    with pytest.raises(flame.AutogradError, match="Jacobian mismatch"):
        gradcheck(Wrong.apply, (x,))


@given(shape=nonempty, data=st.data(), noncontig=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_unfold_windows_gradcheck_and_double_backward(device, shape, data, noncontig, seed):
    """Tensor.unfold (sliding windows as a strided view): first and second derivatives in float64, any dim, window
    size and step (overlapping or not); the windows equal a copy made by slicing."""
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[dim]
    size = data.draw(st.integers(0, n))
    step = data.draw(st.integers(1, 3))
    x = _t(np.random.default_rng(seed), shape, device, noncontig=noncontig)
    y = x.unfold(dim, size, step)
    d = dim % len(shape)
    a = x.detach().numpy()
    count = (n - size) // step + 1
    want = np.stack([np.moveaxis(np.take(a, range(i * step, i * step + size), axis=d), d, -1) for i in range(count)],
                    axis=d)
    np.testing.assert_array_equal(y.detach().numpy(), want)
    assert gradcheck(lambda t: t.unfold(dim, size, step), (x,))
    assert gradgradcheck(lambda t: t.unfold(dim, size, step), (x,))


@given(n=st.integers(1, 4), seed=st.integers(0, 2 ** 16), data=st.data())
def test_repeat_interleave_by_counts_gradcheck(device, n, seed, data):
    """repeat_interleave with one count per element (index_select underneath): the values of np.repeat, and
    float64 first and second derivatives (a zero count drops the element and its gradient)."""
    reps = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    x = _t(np.random.default_rng(seed), (2, n), device)
    y = x.repeat_interleave(flame.tensor(reps), dim=1)
    np.testing.assert_array_equal(y.detach().numpy(), np.repeat(x.detach().numpy(), reps, axis=1))
    assert gradcheck(lambda t: t.repeat_interleave(reps, dim=1), (x,))
    assert gradgradcheck(lambda t: t.repeat_interleave(reps, dim=1), (x,))
