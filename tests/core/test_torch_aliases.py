"""PyTorch's other names and small helpers (finfo / iinfo, ravel, take, std_mean, logspace, diagflat, the Tensor
aliases, the Upsampling modules): values against NumPy / closed forms, in PyTorch's dtypes."""
import math

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core.errors import DTypeError, ShapeError


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
def test_finfo_is_the_dtypes_limits_under_pytorchs_names(name):
    fi, ref = flame.finfo(getattr(flame, name)), ml_dtypes.finfo(getattr(flame, name).np)
    assert (fi.bits, fi.eps, fi.max, fi.min, fi.tiny) == (ref.bits, float(ref.eps), float(ref.max), float(ref.min),
                                                          float(ref.smallest_normal))
    assert fi.smallest_normal == fi.tiny and fi.dtype == name
    assert fi.resolution == 10.0 ** -math.floor(ref.nmant * math.log10(2))   # float32: 1e-06, bfloat16: 0.01
    assert flame.finfo().dtype == flame.get_default_dtype().name


def test_iinfo_and_refusals():
    assert (flame.iinfo(flame.int64).max, flame.iinfo(flame.uint8).min, flame.iinfo(flame.int8).bits) == \
        (2 ** 63 - 1, 0, 8)
    with pytest.raises(DTypeError, match="not a floating point"):
        flame.finfo(flame.int32)
    with pytest.raises(DTypeError, match="not an integer"):
        flame.iinfo(flame.float32)


def test_tensor_aliases():
    a = np.array([[1.5, -2.5, np.inf], [-np.inf, 0.5, 3.0]], np.float32)
    x = flame.tensor(a)
    np.testing.assert_array_equal(x.absolute().numpy(), np.abs(a))
    np.testing.assert_array_equal(x.fix().numpy(), np.trunc(a))
    np.testing.assert_array_equal(x.ravel().numpy(), a.reshape(-1))
    np.testing.assert_array_equal(flame.ravel(x).numpy(), a.reshape(-1))
    assert x.isposinf().tolist() == [[False, False, True], [False, False, False]]
    assert x.isneginf().tolist() == [[False, False, False], [True, False, False]]
    assert (x.ndimension(), x.nelement(), x.is_complex()) == (2, 6, False)
    assert x.get_device() == (-1 if x.device.type == "cpu" else x.device.index)
    i = flame.tensor([1, 2, 300])
    assert (i.byte().dtype, i.char().dtype, i.short().dtype) == (flame.uint8, flame.int8, flame.int16)
    assert i.short().tolist() == [1, 2, 300]
    np.testing.assert_array_equal(x.moveaxis(0, 1).numpy(), np.moveaxis(a, 0, 1))
    np.testing.assert_array_equal(x.H.numpy(), a.T)
    np.testing.assert_array_equal(x.mH.numpy(), a.T)
    m, v = np.arange(6.0).reshape(2, 3), np.arange(3.0)
    np.testing.assert_allclose(flame.tensor(m).mv(flame.tensor(v)).numpy(), m @ v)
    np.testing.assert_allclose(flame.mv(flame.tensor(m), flame.tensor(v)).numpy(), m @ v)
    np.testing.assert_allclose(flame.tensor(v).ger(flame.tensor(v)).numpy(), np.outer(v, v))
    assert flame.tensor(v).vdot(flame.tensor(v)).item() == 5.0
    with pytest.raises(ShapeError, match="mv"):
        flame.tensor(m).mv(flame.tensor(m))
    with pytest.raises(ShapeError, match=r"\.H"):
        flame.tensor(v).H


def test_take_std_mean_logspace_diagflat():
    a = np.arange(12.0).reshape(3, 4)
    x = flame.tensor(a, requires_grad=True)
    idx = np.array([[0, 11], [-1, 5]])
    y = flame.take(x, flame.tensor(idx))
    np.testing.assert_array_equal(y.detach().numpy(), np.take(a, idx))
    y.sum().backward()
    want = np.zeros(12)
    np.add.at(want, idx.reshape(-1) % 12, 1)
    np.testing.assert_array_equal(x.grad.numpy(), want.reshape(3, 4))
    with pytest.raises(IndexError, match="out of range"):
        flame.take(x, flame.tensor([12]))
    s, m = flame.std_mean(x.detach(), 1)
    np.testing.assert_allclose(s.numpy(), a.std(1, ddof=1))
    np.testing.assert_allclose(m.numpy(), a.mean(1))
    np.testing.assert_allclose(flame.logspace(0, 2, 5).numpy(), np.logspace(0, 2, 5).astype(np.float32))
    np.testing.assert_allclose(flame.logspace(0, 3, 4, base=2.0, dtype=flame.float64).numpy(), [1, 2, 4, 8])
    np.testing.assert_array_equal(flame.diagflat(flame.tensor([[1.0, 2.0], [3.0, 4.0]]), 1).numpy(),
                                  np.diagflat([1.0, 2.0, 3.0, 4.0], 1))
    assert flame.is_floating_point(x) and not flame.is_floating_point(flame.tensor([1]))


def test_upsampling_modules_are_upsample_with_their_modes():
    img = flame.tensor(np.random.default_rng(0).random((1, 2, 3, 4)).astype(np.float32))
    near, bil = nn.UpsamplingNearest2d(scale_factor=2), nn.UpsamplingBilinear2d(scale_factor=2)
    assert (near.mode, bil.mode, bil.align_corners) == ("nearest", "bilinear", True)
    np.testing.assert_array_equal(near(img).numpy(), np.repeat(np.repeat(img.numpy(), 2, 2), 2, 3))
    out = bil(img).numpy()
    assert out.shape == (1, 2, 6, 8)
    np.testing.assert_allclose(out[..., 0, 0], img.numpy()[..., 0, 0])     # align_corners: the corners kept
    np.testing.assert_allclose(out[..., -1, -1], img.numpy()[..., -1, -1], rtol=1e-6)


def test_index_fill_and_index_copy_values_gradients_and_in_place():
    a = np.arange(12.0).reshape(3, 4)
    x = flame.tensor(a, requires_grad=True)
    y = x.index_fill(1, flame.tensor([0, 2]), -1.0)
    want = a.copy()
    want[:, [0, 2]] = -1
    np.testing.assert_array_equal(y.detach().numpy(), want)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), (want != -1).astype(float))
    src = flame.tensor(np.full((2, 4), 9.0), requires_grad=True)
    x.grad = None
    z = flame.index_copy(x, 0, flame.tensor([2, 0]), src)
    want = a.copy()
    want[[2, 0]] = 9
    np.testing.assert_array_equal(z.detach().numpy(), want)
    (z * flame.tensor(np.arange(12.0).reshape(3, 4))).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0] * 4, [4, 5, 6, 7], [0] * 4])
    np.testing.assert_array_equal(src.grad.numpy(), [[8, 9, 10, 11], [0, 1, 2, 3]])
    w = flame.tensor(a.copy())
    w.index_fill_(0, flame.tensor(1), 0.5).index_copy_(1, flame.tensor([3]), flame.tensor(np.zeros((3, 1))))
    want = a.copy()
    want[1] = 0.5
    want[:, 3] = 0
    np.testing.assert_array_equal(w.numpy(), want)
    with pytest.raises(IndexError, match="out of range"):
        x.index_fill(1, flame.tensor([4]), 0)
    with pytest.raises(ShapeError, match="does not fit"):
        x.index_copy(0, flame.tensor([0]), flame.tensor(np.zeros((2, 4))))
    from flame_core.autograd import gradcheck, gradgradcheck
    xx = flame.tensor(np.random.default_rng(0).standard_normal((3, 4)), requires_grad=True)
    ss = flame.tensor(np.random.default_rng(1).standard_normal((3, 2)), requires_grad=True)
    assert gradcheck(lambda t, s: t.index_copy(1, flame.tensor([3, 1]), s).index_fill(0, flame.tensor([1]), 2.0),
                     (xx, ss))
    assert gradgradcheck(lambda t, s: t.index_copy(1, flame.tensor([3, 1]), s) ** 2, (xx, ss))


def test_tril_triu_in_place_dist_sum_to_size():
    a = np.arange(1.0, 17.0).reshape(4, 4)
    t = flame.tensor(a.copy())
    assert t.tril_(-1) is t
    np.testing.assert_array_equal(t.numpy(), np.tril(a, -1))
    np.testing.assert_array_equal(flame.tensor(a.copy()).triu_(1).numpy(), np.triu(a, 1))
    x = flame.tensor(a)
    assert x.dist(x * 0.5, 3).item() == pytest.approx(np.sum(np.abs(a * 0.5) ** 3) ** (1 / 3))
    np.testing.assert_array_equal(x.sum_to_size(1, 4).numpy(), a.sum(0, keepdims=True))
    np.testing.assert_array_equal(x.sum_to_size((4, 1)).numpy(), a.sum(1, keepdims=True))
    with pytest.raises(ShapeError, match="not expandable"):
        x.sum_to_size(3, 4)
