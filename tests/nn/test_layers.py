"""Every layer against a direct NumPy float64 reference, plus float64 gradient checks."""
import json
import math
import os

import nn_reference as ref
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F
from flame_core.autograd import gradcheck


def npa(t):
    return t.detach().numpy().astype(np.float64)


def T(a, device, grad=False, dtype=flame.float64):
    return flame.tensor(np.asarray(a), dtype=dtype, device=device, requires_grad=grad)


def params64(module):
    return module.to(flame.float64)


# ----------------------------------------------------------------------------- Linear / Identity / Flatten
def test_linear_matches_reference_and_gradcheck(device, rng):
    lin = params64(nn.Linear(5, 3, device=device))
    x = rng.standard_normal((2, 4, 5))
    y = lin(T(x, device))
    assert tuple(y.shape) == (2, 4, 3)
    np.testing.assert_allclose(npa(y), x @ npa(lin.weight).T + npa(lin.bias), rtol=1e-12)
    xs = T(rng.standard_normal((3, 5)), device, grad=True)
    assert gradcheck(lambda a, w, b: F.linear(a, w, b), (xs, lin.weight, lin.bias))
    nob = params64(nn.Linear(5, 2, bias=False, device=device))
    assert nob.bias is None and len(list(nob.parameters())) == 1
    with pytest.raises(flame.ShapeError, match=r"input \(3, 4\) and weight \(2, 5\)"):
        nob(T(np.zeros((3, 4)), device))
    with pytest.raises(flame.DTypeError, match="same dtype"):
        nob(flame.zeros(3, 5, device=device))


def test_linear_default_init_bounds(device):
    flame.manual_seed(0)
    lin = nn.Linear(400, 300, device=device)
    w, b = npa(lin.weight), npa(lin.bias)
    bound = 1 / math.sqrt(400)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert np.abs(b).max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound  # uniform(-a, a) has std a/sqrt(3)


def test_identity_flatten_unflatten(device, rng):
    x = T(rng.standard_normal((2, 3, 4, 5)), device)
    assert nn.Identity(7, k=1)(x) is x
    assert tuple(nn.Flatten()(x).shape) == (2, 60)
    assert tuple(nn.Flatten(0, 2)(x).shape) == (24, 5)
    assert tuple(nn.Unflatten(1, (3, 4))(x.flatten(1, 2)).shape) == (2, 3, 4, 5)


# ----------------------------------------------------------------------------- Conv2d
@pytest.mark.parametrize("cfg", [
    dict(cin=3, cout=4, k=3, stride=1, padding=1, dilation=1, groups=1, hw=(6, 5)),
    dict(cin=4, cout=6, k=3, stride=2, padding=1, dilation=1, groups=2, hw=(7, 8)),
    dict(cin=2, cout=3, k=2, stride=1, padding=0, dilation=2, groups=1, hw=(6, 6)),
    dict(cin=4, cout=4, k=1, stride=1, padding=0, dilation=1, groups=1, hw=(5, 3)),
    dict(cin=6, cout=6, k=3, stride=(2, 1), padding=(0, 2), dilation=1, groups=6, hw=(7, 5)),
])
def test_conv2d_matches_direct_reference(device, rng, cfg):
    conv = params64(nn.Conv2d(cfg["cin"], cfg["cout"], cfg["k"], stride=cfg["stride"], padding=cfg["padding"],
                              dilation=cfg["dilation"], groups=cfg["groups"], device=device))
    x = rng.standard_normal((2, cfg["cin"]) + cfg["hw"])
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    want = ref.conv2d(x, npa(conv.weight), npa(conv.bias), pair(cfg["stride"]), pair(cfg["padding"]),
                      pair(cfg["dilation"]), cfg["groups"])
    np.testing.assert_allclose(npa(conv(T(x, device))), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 1, 1, 1), (2, 1, 1, 2), (1, 0, 2, 1)])
def test_conv2d_gradcheck(device, rng, stride, padding, dilation, groups):
    x = T(rng.standard_normal((2, 2, 5, 6)), device, grad=True)
    w = T(rng.standard_normal((2, 2 // groups, 2, 3)), device, grad=True)
    b = T(rng.standard_normal(2), device, grad=True)
    assert gradcheck(lambda a, ww, bb: F.conv2d(a, ww, bb, stride, padding, dilation, groups), (x, w, b))


def test_conv2d_chunked_paths_agree(device, rng, monkeypatch):
    """Whole-batch, per-image and row-band chunking give the same forward and backward."""
    x = rng.standard_normal((3, 4, 9, 7))
    w = rng.standard_normal((5, 4, 3, 3))
    g = rng.standard_normal((3, 5, 9, 7))
    results = []
    for mb in (None, "0.0004", "0.00001"):  # default, one image per chunk, bands of rows
        if mb is None:
            monkeypatch.delenv("FLAME_CONV_WORKSPACE_MB", raising=False)
        else:
            monkeypatch.setenv("FLAME_CONV_WORKSPACE_MB", mb)
        xt, wt = T(x, device, grad=True), T(w, device, grad=True)
        y = F.conv2d(xt, wt, padding=1)
        y.backward(T(g, device))
        results.append((npa(y), npa(xt.grad), npa(wt.grad)))
    want = ref.conv2d(x, w, padding=(1, 1))
    for y, gx, gw in results:
        np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gx, results[0][1], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gw, results[0][2], rtol=1e-10, atol=1e-12)


def test_conv2d_same_padding_unbatched_and_padding_modes(device, rng):
    x = rng.standard_normal((2, 6, 6))
    w = rng.standard_normal((3, 2, 4, 4))  # even kernel: PyTorch puts the extra pixel right/bottom
    y = F.conv2d(T(x, device), T(w, device), padding="same")
    xp = np.pad(x[None], ((0, 0), (0, 0), (1, 2), (1, 2)))
    np.testing.assert_allclose(npa(y), ref.conv2d(xp, w)[0], rtol=1e-10)
    conv = params64(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect", device=device))
    xr = np.pad(x[None], ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect")
    np.testing.assert_allclose(npa(conv(T(x[None], device))), ref.conv2d(xr, npa(conv.weight), npa(conv.bias)),
                               rtol=1e-10)
    with pytest.raises(flame.ShapeError, match=r"weight \(2, 2, 3, 3\) expects 2 input channels .* has 3"):
        F.conv2d(T(np.zeros((1, 3, 5, 5)), device), T(np.zeros((2, 2, 3, 3)), device))
    with pytest.raises(flame.ShapeError, match="groups=2 must divide input channels 3"):
        F.conv2d(T(np.zeros((1, 3, 5, 5)), device), T(np.zeros((2, 2, 3, 3)), device), groups=2)
    with pytest.raises(flame.ShapeError, match="smaller than the dilated kernel"):
        F.conv2d(T(np.zeros((1, 1, 2, 2)), device), T(np.zeros((1, 1, 3, 3)), device))


def test_conv2d_default_init_and_repr(device):
    conv = nn.Conv2d(8, 16, 3, stride=2, groups=2, bias=False, device=device)
    bound = 1 / math.sqrt(4 * 9)
    assert np.abs(npa(conv.weight)).max() <= bound
    assert repr(conv) == "Conv2d(8, 16, kernel_size=(3, 3), stride=(2, 2), groups=2, bias=False)"


# ----------------------------------------------------------------------------- Embedding
def test_embedding_lookup_padding_and_grad(device, rng):
    emb = params64(nn.Embedding(7, 3, padding_idx=2, device=device))
    np.testing.assert_array_equal(npa(emb.weight)[2], 0.0)
    idx = flame.tensor([[1, 2, 1], [6, 0, 2]], device=device)
    y = emb(idx)
    np.testing.assert_array_equal(npa(y), npa(emb.weight)[np.array([[1, 2, 1], [6, 0, 2]])])
    g = rng.standard_normal((2, 3, 3))
    y.backward(T(g, device))
    want = np.zeros((7, 3))
    np.add.at(want, np.array([1, 2, 1, 6, 0, 2]), g.reshape(-1, 3))
    want[2] = 0
    np.testing.assert_allclose(npa(emb.weight.grad), want, rtol=1e-12)
    with pytest.raises(IndexError, match=r"out of range: indices span \[0, 7\] for 7 rows"):
        emb(flame.tensor([0, 7], device=device))
    with pytest.raises(IndexError, match=r"out of range: indices span \[-1, 3\]"):
        emb(flame.tensor([[3, -1]], device=device, dtype=flame.int32))
    np.testing.assert_array_equal(npa(emb(flame.tensor([6, 0], device=device, dtype=flame.int32))),
                                  npa(emb.weight)[[6, 0]])
    w = T(rng.standard_normal((5, 2)), device, grad=True)
    assert gradcheck(lambda ww: F.embedding(flame.tensor([0, 3, 3], device=device), ww), (w,))


# ----------------------------------------------------------------------------- norms
def test_layer_norm(device, rng):
    ln = params64(nn.LayerNorm((3, 4), eps=1e-5, device=device))
    with flame.no_grad():
        ln.weight.copy_(T(rng.standard_normal((3, 4)), device))
        ln.bias.copy_(T(rng.standard_normal((3, 4)), device))
    x = rng.standard_normal((2, 3, 4)) * 3 + 1
    np.testing.assert_allclose(npa(ln(T(x, device))), ref.layer_norm(x, 2, npa(ln.weight), npa(ln.bias)),
                               rtol=1e-10, atol=1e-12)
    xs = T(rng.standard_normal((2, 4)), device, grad=True)
    w, b = T(rng.standard_normal(4), device, grad=True), T(rng.standard_normal(4), device, grad=True)
    assert gradcheck(lambda a, ww, bb: F.layer_norm(a, (4,), ww, bb), (xs, w, b))
    assert nn.LayerNorm(4, elementwise_affine=False).weight is None


def test_group_norm(device, rng):
    gn = params64(nn.GroupNorm(2, 6, device=device))
    with flame.no_grad():
        gn.weight.copy_(T(rng.standard_normal(6), device))
        gn.bias.copy_(T(rng.standard_normal(6), device))
    x = rng.standard_normal((2, 6, 3, 2)) * 2 - 1
    np.testing.assert_allclose(npa(gn(T(x, device))), ref.group_norm(x, 2, npa(gn.weight), npa(gn.bias)),
                               rtol=1e-10, atol=1e-12)
    xs = T(rng.standard_normal((2, 4, 3)), device, grad=True)
    w, b = T(rng.standard_normal(4), device, grad=True), T(rng.standard_normal(4), device, grad=True)
    assert gradcheck(lambda a, ww, bb: F.group_norm(a, 2, ww, bb), (xs, w, b))
    with pytest.raises(ValueError, match="divisible"):
        nn.GroupNorm(4, 6)


def test_rms_norm(device, rng):
    rn = params64(nn.RMSNorm(5, eps=1e-6, device=device))
    with flame.no_grad():
        rn.weight.copy_(T(rng.standard_normal(5), device))
    x = rng.standard_normal((3, 5))
    np.testing.assert_allclose(npa(rn(T(x, device))), ref.rms_norm(x, 1, npa(rn.weight), 1e-6), rtol=1e-10)
    # default eps is the dtype's machine epsilon (PyTorch)
    x32 = flame.tensor(np.full((1, 4), 1e-4, np.float32), device=device)
    want = 1e-4 / math.sqrt(1e-8 + float(np.finfo(np.float32).eps))
    np.testing.assert_allclose(npa(F.rms_norm(x32, (4,))), want, rtol=1e-5)
    xs = T(rng.standard_normal((2, 4)), device, grad=True)
    w = T(rng.standard_normal(4), device, grad=True)
    assert gradcheck(lambda a, ww: F.rms_norm(a, (4,), ww, 1e-6), (xs, w))


# ----------------------------------------------------------------------------- activations, softmax, dropout
@pytest.mark.parametrize("layer, fn", [
    (nn.ReLU(), lambda x: np.maximum(x, 0)),
    (nn.GELU(), lambda x: ref.gelu(x)),
    (nn.GELU("tanh"), lambda x: ref.gelu(x, "tanh")),
    (nn.SiLU(), lambda x: x * ref.sigmoid(x)),
    (nn.Tanh(), np.tanh),
    (nn.Sigmoid(), ref.sigmoid),
    (nn.Softmax(dim=1), lambda x: ref.softmax(x, 1)),
])
def test_activations(device, rng, layer, fn):
    x = rng.standard_normal((3, 4)) * 2 + 0.01
    np.testing.assert_allclose(npa(layer(T(x, device))), fn(x), rtol=1e-10, atol=1e-12)
    xs = T(rng.standard_normal((2, 3)) + 0.05, device, grad=True)
    assert gradcheck(layer, (xs,))


def test_dropout_statistics_scaling_and_eval(device):
    flame.manual_seed(0)
    d = nn.Dropout(0.3)
    x = flame.ones(200, 500, device=device)
    y = npa(d(x))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    xg = flame.ones(50, 40, device=device, requires_grad=True)
    out = d(xg)
    out.sum().backward()
    np.testing.assert_allclose(npa(xg.grad), npa(out))  # gradient flows through the same mask
    d.eval()
    assert d(x) is x
    assert float(nn.Dropout(1.0)(x).abs().sum()) == 0.0
    with pytest.raises(ValueError):
        nn.Dropout(1.5)


# ----------------------------------------------------------------------------- pooling / upsampling
@pytest.mark.parametrize("k, s, p, d, ceil_mode", [(2, 2, 0, 1, False), (3, 2, 1, 1, True), (3, 1, 1, 2, False),
                                                   (2, 3, 1, 1, True)])
def test_max_pool2d(device, rng, k, s, p, d, ceil_mode):
    x = rng.standard_normal((2, 3, 7, 6))
    y = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil_mode)(T(x, device))
    np.testing.assert_array_equal(npa(y), ref.max_pool2d(x, k, s, p, d, ceil_mode))
    xs = T(rng.permutation(60).reshape(1, 2, 6, 5) * 0.1, device, grad=True)  # distinct values: no ties
    assert gradcheck(lambda a: F.max_pool2d(a, k, s, p, d, ceil_mode), (xs,))


_POOL_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "max_pool2d.safetensors")
_POOL_CASES = ["rand_k3s2p1_ceil", "rand_k3s1p1_d2", "rand_k2s3p1_ceil", "rand_k2s2", "ties_k3s2p1", "ties_k2s1",
               "special_k3s2p1_ceil", "special_k3s2p1_d2", "chw_k3s2p1"]


@pytest.mark.parametrize("name", _POOL_CASES)
def test_max_pool2d_indices_and_gradient_match_pytorch(device, name):
    """F.max_pool2d(return_indices=True) and nn.MaxPool2d(return_indices=True) against PyTorch's outputs
    (tests/fixtures/make_pooling_fixtures.py): values, int64 indices (first maximum in row-major order; a window of
    -inf names its first position inside the input; a NaN window its last NaN) and the input gradient."""
    from safetensors.numpy import load_file
    fx = {k[len(name) + 1:]: v for k, v in load_file(_POOL_FIXTURE).items() if k.startswith(name + ".")}
    k, s, p, d, ceil = (int(v) for v in fx["geometry"])
    x = T(fx["x"], device, grad=True)
    y, idx = F.max_pool2d(x, k, s, p, d, ceil_mode=bool(ceil), return_indices=True)
    np.testing.assert_array_equal(npa(y), fx["out"])
    assert idx.dtype == flame.int64 and not idx.requires_grad
    np.testing.assert_array_equal(idx.numpy(), fx["indices"])
    y.backward(T(fx["go"], device))
    np.testing.assert_allclose(npa(x.grad), fx["grad"], rtol=1e-12, atol=1e-15)  # (overlapping windows' sums)
    y2, idx2 = nn.MaxPool2d(k, s, p, d, return_indices=True, ceil_mode=bool(ceil))(T(fx["x"], device))
    np.testing.assert_array_equal(npa(y2), fx["out"])
    np.testing.assert_array_equal(idx2.numpy(), fx["indices"])
    np.testing.assert_array_equal(npa(F.max_pool2d(T(fx["x"], device), k, s, p, d, ceil_mode=bool(ceil))), fx["out"])


@pytest.mark.parametrize("name", ["unpool_k2s2_default", "unpool_k2s2_sized", "unpool_k3s2p1_sized",
                                  "unpool_chw_sized"])
def test_max_unpool2d_matches_pytorch(device, name):
    """F.max_unpool2d / nn.MaxUnpool2d of a pooled output with its indices (default size and output_size) against
    PyTorch's output and input gradient."""
    from safetensors.numpy import load_file
    fx = {k[len(name) + 1:]: v for k, v in load_file(_POOL_FIXTURE).items() if k.startswith(name + ".")}
    k, s, p = (int(v) for v in fx["geometry"])
    size = None if fx["output_size"][0] < 0 else tuple(int(v) for v in fx["output_size"])
    x = T(fx["x"], device, grad=True)
    idx = flame.tensor(fx["indices"], device=device)
    u = F.max_unpool2d(x, idx, k, s, p, output_size=size)
    np.testing.assert_array_equal(npa(u), fx["out"])
    u.backward(T(fx["go"], device))
    np.testing.assert_array_equal(npa(x.grad), fx["grad"])
    np.testing.assert_array_equal(npa(nn.MaxUnpool2d(k, s, p)(T(fx["x"], device), idx, size)), fx["out"])


_POOL_MORE = {
    "maxpool1d_k3s2p1": ("max_pool1d", nn.MaxPool1d, dict(kernel_size=3, stride=2, padding=1, return_indices=True)),
    "maxpool1d_k2d2_ceil": ("max_pool1d", nn.MaxPool1d, dict(kernel_size=2, stride=2, dilation=2, ceil_mode=True,
                                                             return_indices=True)),
    "avgpool1d_k3s2p1": ("avg_pool1d", nn.AvgPool1d, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                                                          count_include_pad=False)),
    "adaptive_avg1d": ("adaptive_avg_pool1d", nn.AdaptiveAvgPool1d, dict(output_size=4)),
    "adaptive_max2d": ("adaptive_max_pool2d", nn.AdaptiveMaxPool2d, dict(output_size=(3, 4), return_indices=True)),
    "adaptive_max2d_up": ("adaptive_max_pool2d", nn.AdaptiveMaxPool2d, dict(output_size=(9, 10),
                                                                            return_indices=True)),
    "adaptive_max2d_ties": ("adaptive_max_pool2d", nn.AdaptiveMaxPool2d, dict(output_size=(4, 3),
                                                                              return_indices=True)),
}


@pytest.mark.parametrize("name", sorted(_POOL_MORE))
def test_1d_and_adaptive_pools_match_pytorch(device, name):
    """max_pool1d / avg_pool1d / adaptive_avg_pool1d / adaptive_max_pool2d and their modules against PyTorch
    (tests/fixtures/make_pooling_fixtures.py): values (NaNs where PyTorch has them), indices (first maximum; a NaN
    window's last NaN) and the input gradient."""
    from safetensors.numpy import load_file
    fx = {k[len(name) + 1:]: v for k, v in load_file(_POOL_FIXTURE).items() if k.startswith(name + ".")}
    fname, cls, kw = _POOL_MORE[name]
    x = T(fx["x"], device, grad=True)
    res = getattr(F, fname)(x, **kw)
    out, idx = res if isinstance(res, tuple) else (res, None)
    np.testing.assert_allclose(npa(out), fx["out"], rtol=1e-14, atol=1e-15)  # (NaNs compare equal)
    if idx is not None:
        assert idx.dtype == flame.int64
        np.testing.assert_array_equal(idx.numpy(), fx["indices"])
    out.backward(T(fx["go"], device))
    np.testing.assert_allclose(npa(x.grad), fx["grad"], rtol=1e-14, atol=1e-15)
    mod_kw = {k: v for k, v in kw.items()}
    res2 = cls(**mod_kw)(T(fx["x"], device))
    np.testing.assert_allclose(npa(res2[0] if isinstance(res2, tuple) else res2), fx["out"], rtol=1e-14, atol=1e-15)


def test_max_unpool2d_refuses_bad_indices_and_sizes(device):
    x = T(np.ones((1, 1, 2, 2)), device)
    ok = flame.tensor(np.array([[[[0, 3], [8, 15]]]], np.int64), device=device)
    assert F.max_unpool2d(x, ok, 2).shape == (1, 1, 4, 4)
    with pytest.raises(IndexError, match=r"indices range over \[0, 16\], outside the \(4, 4\) output plane"):
        F.max_unpool2d(x, flame.tensor(np.array([[[[0, 3], [8, 16]]]], np.int64), device=device), 2)
    with pytest.raises(IndexError, match="outside"):
        F.max_unpool2d(x, flame.tensor(np.array([[[[-1, 3], [8, 15]]]], np.int64), device=device), 2)
    with pytest.raises(flame.errors.ShapeError, match="indices of shape"):
        F.max_unpool2d(x, flame.tensor(np.zeros((1, 1, 2, 1), np.int64), device=device), 2)
    with pytest.raises(TypeError, match="int64"):
        F.max_unpool2d(x, T(np.zeros((1, 1, 2, 2)), device), 2)
    with pytest.raises(ValueError, match="within a stride"):
        F.max_unpool2d(x, ok, 2, output_size=(7, 4))
    assert F.max_unpool2d(x, ok, 2, output_size=(1, 1, 5, 5)).shape == (1, 1, 5, 5)


@pytest.mark.parametrize("k, s, p, ceil_mode, include_pad, div", [(2, 2, 0, False, True, None),
                                                                   (3, 2, 1, True, True, None),
                                                                   (3, 2, 1, True, False, None),
                                                                   (3, 1, 1, False, True, 4)])
def test_avg_pool2d(device, rng, k, s, p, ceil_mode, include_pad, div):
    x = rng.standard_normal((2, 2, 7, 6))
    layer = nn.AvgPool2d(k, s, p, ceil_mode=ceil_mode, count_include_pad=include_pad, divisor_override=div)
    np.testing.assert_allclose(npa(layer(T(x, device))), ref.avg_pool2d(x, k, s, p, ceil_mode, include_pad, div),
                               rtol=1e-12)
    xs = T(rng.standard_normal((1, 2, 5, 4)), device, grad=True)
    assert gradcheck(layer, (xs,))


@pytest.mark.parametrize("out", [1, (3, 2), (5, 4)])
def test_adaptive_avg_pool2d(device, rng, out):
    x = rng.standard_normal((2, 3, 7, 5))
    oh, ow = (out, out) if isinstance(out, int) else out
    np.testing.assert_allclose(npa(nn.AdaptiveAvgPool2d(out)(T(x, device))), ref.adaptive_avg_pool2d(x, oh, ow),
                               rtol=1e-12)
    xs = T(rng.standard_normal((1, 1, 5, 4)), device, grad=True)
    assert gradcheck(lambda a: F.adaptive_avg_pool2d(a, out), (xs,))


@pytest.mark.parametrize("kwargs, oh, ow", [(dict(scale_factor=2), 8, 10), (dict(size=(6, 7)), 6, 7),
                                            (dict(size=(3, 2)), 3, 2)])
def test_upsample_nearest(device, rng, kwargs, oh, ow):
    x = rng.standard_normal((2, 3, 4, 5))
    y = nn.Upsample(mode="nearest", **kwargs)(T(x, device))
    np.testing.assert_array_equal(npa(y), ref.upsample_nearest(x, oh, ow))
    xs = T(rng.standard_normal((1, 1, 3, 2)), device, grad=True)
    assert gradcheck(lambda a: F.interpolate(a, **kwargs), (xs,))


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("oh, ow", [(8, 10), (3, 7)])
def test_upsample_bilinear(device, rng, align, oh, ow):
    x = rng.standard_normal((2, 2, 4, 5))
    y = nn.Upsample(size=(oh, ow), mode="bilinear", align_corners=align)(T(x, device))
    np.testing.assert_allclose(npa(y), ref.upsample_bilinear(x, oh, ow, align), rtol=1e-12, atol=1e-14)
    xs = T(rng.standard_normal((1, 1, 3, 3)), device, grad=True)
    assert gradcheck(lambda a: F.interpolate(a, size=(4, 5), mode="bilinear", align_corners=align), (xs,))


_INTERP_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn")
with open(os.path.join(_INTERP_DIR, "interpolate.json")) as _f:
    _INTERP = json.load(_f)


@pytest.mark.parametrize("name", sorted(_INTERP))
def test_interpolate_matches_pytorch(device, name):
    """Every mode against PyTorch's outputs and input gradients (tests/fixtures/make_interpolate_fixtures.py): nearest
    and nearest-exact on 1-3 spatial dims, linear / bilinear / trilinear with and without align_corners, bicubic,
    area, antialiased bilinear / bicubic, sizes and scale factors (recomputed or not), up and down."""
    from safetensors.numpy import load_file
    fx = load_file(os.path.join(_INTERP_DIR, "interpolate.safetensors"))
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in _INTERP[name].items()}
    x = T(fx[f"{name}.x"], device, grad=True)
    y = F.interpolate(x, **kw)
    np.testing.assert_allclose(npa(y), fx[f"{name}.out"], rtol=1e-12, atol=1e-13)
    y.backward(T(fx[f"{name}.go"], device))
    np.testing.assert_allclose(npa(x.grad), fx[f"{name}.grad"], rtol=1e-12, atol=1e-13)


@given(mode=st.sampled_from(["bicubic", "area", "bilinear_aa", "bicubic_aa", "nearest-exact"]),
       oh=st.integers(1, 7), ow=st.integers(1, 7), seed=st.integers(0, 999))
@settings(max_examples=12, deadline=None)
def test_interpolate_gradcheck_and_dtypes(device, mode, oh, ow, seed):
    rng = np.random.default_rng(seed)
    aa = mode.endswith("_aa")
    kw = dict(size=(oh, ow), mode=mode.replace("_aa", ""), antialias=aa)
    xs = T(rng.standard_normal((1, 2, 4, 5)), device, grad=True)
    assert gradcheck(lambda a: F.interpolate(a, **kw), (xs,))
    y32 = F.interpolate(T(rng.standard_normal((1, 2, 4, 5)), device, dtype=flame.float32), **kw)
    assert y32.dtype == flame.float32 and tuple(y32.shape) == (1, 2, oh, ow)


# ----------------------------------------------------------------------------- MultiheadAttention
def _mha_ref_params(mha):
    E = mha.embed_dim
    w, b = npa(mha.in_proj_weight), npa(mha.in_proj_bias)
    return (w[:E], w[E:2 * E], w[2 * E:], b[:E], b[E:2 * E], b[2 * E:], npa(mha.out_proj.weight),
            npa(mha.out_proj.bias))


def test_multihead_self_attention_weights_path(device, rng):
    mha = params64(nn.MultiheadAttention(8, 2, device=device))
    with flame.no_grad():
        mha.in_proj_bias.copy_(T(rng.standard_normal(24) * 0.1, device))
    x = rng.standard_normal((5, 3, 8))  # (L, N, E): batch_first=False
    keypad = np.zeros((3, 5), dtype=bool)
    keypad[1, 3:] = True
    out, w = mha(T(x, device), T(x, device), T(x, device), key_padding_mask=flame.tensor(keypad, device=device))
    xb = x.transpose(1, 0, 2)
    mask = np.where(keypad, -np.inf, 0.0)[:, None, None, :]
    want, attn = ref.multihead_attention(xb, xb, xb, *_mha_ref_params(mha), heads=2, mask=mask)
    np.testing.assert_allclose(npa(out), want.transpose(1, 0, 2), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(w), attn.mean(1), rtol=1e-10, atol=1e-12)
    assert tuple(mha.in_proj_weight.shape) == (24, 8)
    assert [n for n, _ in mha.named_parameters()] == ["in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                      "out_proj.bias"]


def test_multihead_cross_attention_kdim_vdim_and_gradcheck(device, rng):
    mha = params64(nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True, device=device))
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 5))
    causal = np.triu(np.ones((3, 6), dtype=bool), 1)
    out, _ = mha(T(q, device), T(k, device), T(v, device), attn_mask=flame.tensor(causal, device=device),
                 need_weights=True)
    b = npa(mha.in_proj_bias)
    want, _ = ref.multihead_attention(q, k, v, npa(mha.q_proj_weight), npa(mha.k_proj_weight),
                                      npa(mha.v_proj_weight), b[:4], b[4:8], b[8:], npa(mha.out_proj.weight),
                                      npa(mha.out_proj.bias), heads=2, mask=np.where(causal, -np.inf, 0.0))
    np.testing.assert_allclose(npa(out), want, rtol=1e-10, atol=1e-12)
    qs = T(rng.standard_normal((1, 2, 4)), device, grad=True)
    ks = T(rng.standard_normal((1, 3, 3)), device, grad=True)
    vs = T(rng.standard_normal((1, 3, 5)), device, grad=True)
    assert gradcheck(lambda a, bb, c: mha(a, bb, c)[0], (qs, ks, vs))


def test_multihead_attention_sdpa_path_matches_weights_path(device, rng):
    mha = params64(nn.MultiheadAttention(8, 2, batch_first=True, device=device))
    x = T(rng.standard_normal((2, 5, 8)), device)
    ctx = T(rng.standard_normal((2, 7, 8)), device)
    for kv in (x, ctx):  # self and cross attention
        slow, _ = mha(x, kv, kv, need_weights=True)
        fast, w = mha(x, kv, kv, need_weights=False)
        assert w is None
        np.testing.assert_allclose(npa(fast), npa(slow), rtol=1e-9, atol=1e-11)
    causal = flame.tensor(np.triu(np.ones((5, 5), dtype=bool), 1), device=device)
    keypad = flame.tensor(np.array([[False] * 4 + [True], [False] * 5]), device=device)
    slow, _ = mha(x, x, x, attn_mask=causal, key_padding_mask=keypad)
    fast, _ = mha(x, x, x, is_causal=True, key_padding_mask=keypad, need_weights=False)
    np.testing.assert_allclose(npa(fast), npa(slow), rtol=1e-9, atol=1e-11)
    slow, _ = mha(x, x, x, attn_mask=causal)
    fast, _ = mha(x, x, x, is_causal=True, need_weights=False)
    np.testing.assert_allclose(npa(fast), npa(slow), rtol=1e-9, atol=1e-11)
