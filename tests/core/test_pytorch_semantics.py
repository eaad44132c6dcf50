"""PyTorch semantics that users lean on: view(dtype) reinterprets bits, norm's gradient at zero, NumPy interop
(__array__, axis=/keepdims= where PyTorch takes them), and matmul refusing mixed dtypes outside autocast."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
from flame_core import amp
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.errors import AutogradError, DTypeError, ShapeError


# ----------------------------------------------------------------------------- view(dtype)
def test_view_dtype_reinterprets_bits_with_equal_element_size(device):
    a = np.array([[1.0, -2.0, 0.5], [3.25, 0.0, -0.0]], dtype=np.float32)
    x = flame.tensor(a, device=device)
    v = x.view(flame.int32)
    assert v.dtype is flame.int32 and v.shape == (2, 3)
    np.testing.assert_array_equal(v.numpy(), a.view(np.int32))
    t = x.T.view(flame.int32)  # equal sizes: any strides, kept
    assert t.shape == (3, 2) and t.stride() == x.T.stride()
    np.testing.assert_array_equal(t.numpy(), a.T.view(np.int32))
    assert x.view(flame.float32) is x


def test_view_dtype_changes_the_last_size_and_shares_storage(device):
    a = np.arange(12, dtype=np.float32).reshape(2, 6) - 3.5
    x = flame.tensor(a, device=device)
    b = x.view(flame.bfloat16)
    assert b.shape == (2, 12) and b.dtype is flame.bfloat16
    np.testing.assert_array_equal(b.numpy().view(np.uint16), a.view(np.uint16))
    u = x.view(flame.uint8)
    assert u.shape == (2, 24)
    d = x.view(flame.float64)
    assert d.shape == (2, 3)
    np.testing.assert_array_equal(d.numpy(), a.view(np.float64))
    back = b.view(flame.float32)
    assert back.shape == (2, 6)
    np.testing.assert_array_equal(back.numpy(), a)
    # the same storage: a write through the view shows in the base, and bumps the shared version counter
    v0 = x._version[0]
    x.view(flame.int32)[0, 0] = int(np.float32(7.0).view(np.int32))
    assert x[0, 0].item() == 7.0 and x._version[0] > v0
    # rows of a larger tensor: strides scale by the ratio
    r = x[::2].view(flame.float16)
    assert r.shape == (1, 12)
    np.testing.assert_array_equal(r.numpy().view(np.uint16), x.numpy()[::2].view(np.uint16))


def test_view_dtype_fp8_bytes(device):
    vals = np.array([0.5, -1.0, 448.0, 0.0], dtype=np.float32)
    q = flame.tensor(vals, device=device).to(flame.float8_e4m3fn)
    raw = q.view(flame.uint8)
    assert raw.dtype is flame.uint8
    np.testing.assert_array_equal(raw.numpy(), vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    again = raw.view(flame.float8_e4m3fn)
    assert again.dtype is flame.float8_e4m3fn
    np.testing.assert_array_equal(again.float().numpy(), vals)


def test_view_dtype_follows_pytorch_size_rules(device):
    with pytest.raises(ShapeError, match=r"self.dim\(\) cannot be 0 to view float32 as float16"):
        flame.tensor(1.0, device=device).view(flame.float16)
    with pytest.raises(ShapeError, match=r"self.stride\(-1\) must be 1 to view float32 as bfloat16 .* got 6"):
        flame.zeros(4, 6, device=device).T.view(flame.bfloat16)
    with pytest.raises(ShapeError, match=r"self.size\(-1\) must be divisible by 2 to view float16 as float32"):
        flame.zeros(2, 3, dtype=flame.float16, device=device).view(flame.float32)
    with pytest.raises(ShapeError, match=r"self.storage_offset\(\) must be divisible by 2 .* got 1"):
        flame.zeros(8, dtype=flame.float16, device=device)[1:7].view(flame.float32)
    with pytest.raises(ShapeError, match=r"self.stride\(0\) must be divisible by 2 .* got 3"):
        flame.zeros(3, 3, dtype=flame.float16, device=device)[:, :2].view(flame.float32)
    ok = flame.zeros(4, 4, dtype=flame.float16, device=device)[:, 2:].view(flame.float32)  # offset 2, stride 4
    assert ok.shape == (4, 1)


def test_view_dtype_is_not_differentiable(device):
    x = flame.ones(4, device=device, requires_grad=True)
    v = x.view(flame.int32)
    assert not v.requires_grad and v.grad_fn is None


# ----------------------------------------------------------------------------- norm at zero
@pytest.mark.parametrize("p", ["fro", 2, 1, 3, 1.5, 0.5, float("inf"), float("-inf")])
def test_norm_gradient_at_zero_is_zero(device, p):
    x = flame.zeros(2, 3, dtype=flame.float64, device=device, requires_grad=True)
    n = x.norm(p)
    assert n.item() == 0.0
    n.backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((2, 3)))


def test_norm_gradient_of_a_zero_row_among_others(device):
    x = flame.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=flame.float64, device=device, requires_grad=True)
    x.norm(dim=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0.0, 0.0], [0.6, 0.8]])


@pytest.mark.parametrize("p", [3, 1.5, 0.5])
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), keepdim=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_p_norm_gradcheck(device, p, shape, keepdim, seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.2, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)  # away from |x| = 0
    x = flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)
    dim = int(rng.integers(0, len(shape)))
    assert gradcheck(lambda t: t.norm(p, dim=dim, keepdim=keepdim), (x,))
    assert abs(x.norm(p).item() - np.sum(np.abs(a) ** p) ** (1 / p)) < 1e-12 * max(1.0, x.norm(p).item())


def test_two_norm_gradgradcheck(device, rng):
    x = flame.tensor(rng.uniform(0.5, 2.0, size=(3, 4)), dtype=flame.float64, device=device, requires_grad=True)
    assert gradgradcheck(lambda t: t.norm(dim=1), (x,))


# ----------------------------------------------------------------------------- NumPy interop
def test_numpy_asarray_gives_the_values(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    x = flame.tensor(a, device="cpu")
    got = np.asarray(x)
    assert got.dtype == np.float32 and got.shape == (3, 4)
    np.testing.assert_array_equal(got, a)
    assert np.asarray(x, dtype=np.float64).dtype == np.float64
    assert np.shares_memory(np.asarray(x), x.numpy()) and not np.shares_memory(np.array(x, copy=True), x.numpy())
    with pytest.raises(ValueError, match="without a copy"):
        x.__array__(np.float64, copy=False)
    np.testing.assert_array_equal(np.array(x.to(flame.bfloat16)).astype(np.float32),
                                  a.astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(AutogradError, match="requires grad"):
        np.asarray(flame.tensor(a, device="cpu", requires_grad=True))
    if flame.cuda_is_available():  # as PyTorch: device memory is not a NumPy array; .cpu() first
        with pytest.raises(TypeError, match=r"cuda:0 tensor to a NumPy array: copy it to host memory first"):
            np.asarray(flame.tensor(a, device="cuda"))


def test_numpy_scalars_on_the_left_defer_to_the_tensor(rng):
    a = rng.standard_normal(3).astype(np.float32)
    x = flame.tensor(a)
    for r in (np.float32(2.0) * x, np.float64(1.5) + x, np.int64(3) - x):  # __array_priority__, with __array__
        assert isinstance(r, flame.Tensor) and r.dtype is flame.float32
    np.testing.assert_allclose((np.float32(2.0) * x).numpy(), 2 * a)


@pytest.mark.gpu
def test_numpy_asarray_of_a_cuda_tensor_says_to_copy_first():
    with pytest.raises(TypeError, match=r"\.cpu\(\)"):
        np.asarray(flame.ones(3, device="cuda"))


def test_axis_and_keepdims_where_pytorch_takes_them(device, rng):
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    x = flame.tensor(a, device=device)
    np.testing.assert_allclose(x.sum(axis=1).numpy(), a.sum(1), rtol=1e-6)
    np.testing.assert_allclose(flame.mean(x, axis=(0, 2), keepdims=True).numpy(), a.mean((0, 2), keepdims=True),
                               rtol=1e-6)
    np.testing.assert_array_equal(x.amax(axis=-1).numpy(), a.max(-1))
    np.testing.assert_array_equal(x.argmax(axis=2).numpy(), a.argmax(2))
    np.testing.assert_array_equal(x.max(axis=0).values.numpy(), a.max(0))
    np.testing.assert_allclose(x.softmax(axis=-1).numpy().sum(-1), np.ones((2, 3)), rtol=1e-6)
    np.testing.assert_array_equal(flame.cat([x, x], axis=2).numpy(), np.concatenate([a, a], 2))
    np.testing.assert_array_equal(flame.stack([x, x], axis=1).numpy(), np.stack([a, a], 1))
    assert x.unsqueeze(axis=0).shape == (1, 2, 3, 4)
    assert x.chunk(2, axis=2)[1].shape == (2, 3, 2)
    np.testing.assert_array_equal(x.cumsum(axis=1).numpy(), np.cumsum(a, 1))
    with pytest.raises(TypeError, match="both 'dim' and its NumPy alias 'axis'"):
        x.sum(dim=0, axis=1)


def test_no_axis_where_pytorch_has_none(device):
    x = flame.ones(2, 4, device=device)
    # torch.norm / Tensor.norm, torch.split / Tensor.split, Tensor.unflatten are written in Python: no axis=
    for call in (lambda: x.norm(axis=1), lambda: x.split(2, axis=1), lambda: flame.split(x, 2, axis=1),
                 lambda: x.unflatten(axis=1, sizes=(2, 2)), lambda: x.flip(axis=0)):
        with pytest.raises(TypeError, match="axis"):
            call()


# ----------------------------------------------------------------------------- matmul dtypes
def test_matmul_of_mixed_dtypes_raises_naming_both(device):
    x = flame.ones(2, 3, dtype=flame.bfloat16, device=device)
    w = flame.ones(3, 4, device=device)
    for a, b in ((x, w), (w.T, x.T)):
        with pytest.raises(DTypeError, match=r"matmul: .*same dtype, got (bfloat16 and float32|float32 and bfloat16)"):
            a @ b
    with pytest.raises(DTypeError, match="float32 and float64"):
        flame.mm(w, flame.ones(4, 2, dtype=flame.float64, device=device))
    with pytest.raises(DTypeError, match="int64 and float32"):
        flame.ones(2, 3, dtype=flame.int64, device=device) @ w


def test_matmul_under_autocast_casts_both(device):
    x = flame.ones(2, 3, dtype=flame.bfloat16, device=device)
    w = flame.ones(3, 4, device=device, requires_grad=True)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        y = x @ w
    assert y.dtype is flame.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype is flame.float32
    np.testing.assert_array_equal(w.grad.numpy(), np.full((3, 4), 2.0))


def test_reductions_of_a_0d_tensor_over_dim_0_or_minus_1():
    """PyTorch lets a 0-d tensor name dim 0 / -1 in a reduction: all of it, the result 0-d with or without keepdim
    (sum, mean, amax / amin, logsumexp, all / any, count_nonzero, var, norm, max / min with their index, argmax)."""
    x = flame.tensor(2.5, requires_grad=True)
    outs = [x.sum(0), x.sum(-1, keepdim=True), x.mean(0), x.mean(-1, keepdim=True), x.sum((0,)), x.amax(0),
            x.amin(-1, keepdim=True), x.logsumexp(0), x.max(0).values, x.min(-1, keepdim=True).values,
            x.norm(dim=0, keepdim=True).abs()]
    for y in outs:
        assert y.shape == () and y.item() == 2.5
    sum(outs[1:], outs[0]).backward()
    assert x.grad.item() == 11.0
    assert x.max(0).indices.item() == 0 and x.argmax(-1, keepdim=True).shape == ()
    assert x.all(0).item() and x.any(-1).item() and x.count_nonzero(0).item() == 1
    assert np.isnan(x.var(0).item())


def test_empty_and_0d_edges_as_pytorch():
    """chunk of an empty dim gives `chunks` empty pieces and split one; nonzero of a 0-d tensor names one (or no)
    position of zero coordinates; softmax / log_softmax of empty tensors are empty (and their gradients)."""
    shapes = lambda ts: [tuple(t.shape) for t in ts]  # noqa: E731
    assert shapes(flame.zeros(0).chunk(2)) == [(0,), (0,)]
    assert shapes(flame.zeros(0, 3).chunk(3, 0)) == [(0, 3)] * 3
    assert shapes(flame.zeros(0).split(3)) == [(0,)] and shapes(flame.zeros(2, 0).split(1, 1)) == [(2, 0)]
    assert shapes(flame.zeros(0).tensor_split(2)) == [(0,), (0,)]
    assert tuple(flame.tensor(2.5).nonzero().shape) == (1, 0) and tuple(flame.tensor(0.0).nonzero().shape) == (0, 0)
    (idx,) = flame.tensor(2.5).nonzero(as_tuple=True)
    assert idx.tolist() == [0] and idx.dtype == flame.int64
    assert flame.tensor(0.0).nonzero(as_tuple=True)[0].tolist() == []
    for shape, dim in (((3, 0), -1), ((0, 3), 0), ((0,), 0)):
        x = flame.zeros(*shape, requires_grad=True)
        y = x.softmax(dim) + x.log_softmax(dim)
        assert tuple(y.shape) == shape
        y.sum().backward()
        assert tuple(x.grad.shape) == shape


def test_integer_tensors_keep_their_dtype_and_the_bit_operators_are_bitwise():
    """-x, abs and square of integer tensors stay integers (int64 / uint8 wrap as PyTorch's do); & | ^ are bitwise on
    integers (logical on bool, both operand orders); sign of bool is itself; -bool is refused."""
    i = flame.tensor([[1, -2, 3], [4, 5, -6]])
    for y, want in ((-i, -i.numpy()), (i.abs(), np.abs(i.numpy())), (i.square(), i.numpy() ** 2), (abs(i), None)):
        assert y.dtype == flame.int64
        if want is not None:
            np.testing.assert_array_equal(y.numpy(), want)
    u = flame.tensor([1, 200, 3]).to(flame.uint8)
    assert (-u).tolist() == [255, 56, 253] and u.square().tolist() == [1, 64, 9] and (-u).dtype == flame.uint8
    x = flame.tensor([1, 2, 6])
    assert (x & 3).tolist() == [1, 2, 2] and (x | 1).tolist() == [1, 3, 7] and (x ^ 3).tolist() == [2, 1, 5]
    assert (3 & x).tolist() == [1, 2, 2] and (1 | x).tolist() == [1, 3, 7] and (3 ^ x).tolist() == [2, 1, 5]
    assert flame.bitwise_and(x, x).dtype == flame.int64
    m = flame.tensor([True, False, True])
    assert ((m & ~m).tolist(), (m | ~m).tolist(), (m ^ m).tolist()) == ([False] * 3, [True] * 3, [False] * 3)
    assert (m & m).dtype == flame.bool_ and m.sign().tolist() == [True, False, True]
    with pytest.raises(TypeError, match="bool"):
        -m


def test_unfold_windows_edges():
    """Tensor.unfold: a 0-d tensor's one window, size 0, a size past the dimension and a bad step refused; the CPU
    view is read-only (windows overlap: an in-place write would be ambiguous)."""
    assert tuple(flame.tensor(2.5).unfold(0, 1, 1).shape) == (1,)
    assert tuple(flame.zeros(2, 5).unfold(1, 0, 2).shape) == (2, 3, 0)
    with pytest.raises(ShapeError, match="size 6 exceeds dimension 1 of size 5"):
        flame.zeros(2, 5).unfold(1, 6, 1)
    with pytest.raises(ValueError, match="step > 0"):
        flame.zeros(2, 5).unfold(1, 2, 0)
    w = flame.arange(6.0).unfold(0, 3, 1)
    assert w.tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    if w.device.type == "cpu":
        with pytest.raises(ValueError, match="read-only"):
            w.add_(1)


def test_repeat_interleave_counts_and_adaptive_max_pool1d():
    x = flame.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert x.repeat_interleave(flame.tensor([1, 0, 2]), dim=1).tolist() == [[1, 3, 3], [4, 6, 6]]
    assert x.repeat_interleave(flame.tensor([2]), dim=0).tolist() == [[1, 2, 3]] * 2 + [[4, 5, 6]] * 2
    assert x.repeat_interleave(2).tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    with pytest.raises(ShapeError, match="repeats must be 3 integers"):
        x.repeat_interleave([1, 2], dim=1)
    with pytest.raises(ValueError, match="negative"):
        x.repeat_interleave([1, -1, 2], dim=1)
    with pytest.raises(ValueError, match="output_size 5"):
        x.repeat_interleave([1, 1, 2], dim=1, output_size=5)
    import flame_nn.functional as F
    s = flame.tensor([[[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]]], requires_grad=True)
    out, idx = F.adaptive_max_pool1d(s, 3, return_indices=True)
    assert out.tolist() == [[[4.0, 5.0, 9.0]]] and idx.tolist() == [[[2, 4, 5]]]   # windows [0,3) [2,5) [4,7)
    out.sum().backward()
    assert s.grad.tolist() == [[[0, 0, 1, 0, 1, 1, 0]]]
