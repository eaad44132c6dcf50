"""Issue 31's layers against NumPy float64 references written here and against PyTorch's own outputs
(tests/fixtures/torch_nn/layers.safetensors, made by tests/fixtures/make_torch_nn_fixtures.py), with float64
gradient checks; state_dict keys as PyTorch's."""
import json
import math
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F
from flame_core.autograd import gradcheck

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "layers.safetensors")


def npa(t):
    return t.detach().numpy().astype(np.float64)


def T(a, device, grad=False, dtype=flame.float64):
    return flame.tensor(np.asarray(a), dtype=dtype, device=device, requires_grad=grad)


@pytest.fixture(scope="module")
def golden():
    return load_file(FIXTURE)


def case(golden, name):
    """(state_dict, other tensors) of one fixture case."""
    items = {k[len(name) + 1:]: v for k, v in golden.items() if k.startswith(name + ".")}
    return items


def load(module, golden, name, extra):
    items = case(golden, name)
    state = {k: v for k, v in items.items() if k not in extra}
    module.load_state_dict(state)
    return {k: items[k] for k in extra}


# ----------------------------------------------------------------------------- activation modules
def test_activation_modules(device, rng):
    x = T(rng.standard_normal((3, 4)) * 3, device)
    for m, f in ((nn.LeakyReLU(0.3), lambda v: F.leaky_relu(v, 0.3)), (nn.ELU(0.5), lambda v: F.elu(v, 0.5)),
                 (nn.Softplus(2.0, 5.0), lambda v: F.softplus(v, 2.0, 5.0)), (nn.Mish(), F.mish),
                 (nn.Hardswish(), F.hardswish)):
        np.testing.assert_array_equal(npa(m(x)), npa(f(x)))
        assert list(m.state_dict()) == []
    assert repr(nn.LeakyReLU(0.2, inplace=True)) == "LeakyReLU(negative_slope=0.2, inplace=True)"
    assert repr(nn.Softplus()) == "Softplus(beta=1.0, threshold=20.0)"
    y = x.clone()
    assert nn.ELU(inplace=True)(y) is y


def test_the_other_activation_modules(device, rng):
    """PyTorch's remaining activation modules: each its functional with the module's options, no state but PReLU's
    slope (`weight`, init 0.25, one per channel or shared, trained), PyTorch's reprs, in-place where PyTorch has it."""
    x = T(rng.standard_normal((3, 4, 2)) * 4, device)
    pairs = ((nn.Hardtanh(-2.0, 3.0), lambda v: F.hardtanh(v, -2.0, 3.0)), (nn.ReLU6(), F.relu6),
             (nn.Hardsigmoid(), F.hardsigmoid), (nn.LogSigmoid(), F.logsigmoid), (nn.Softsign(), F.softsign),
             (nn.Tanhshrink(), F.tanhshrink), (nn.SELU(), F.selu), (nn.CELU(0.6), lambda v: F.celu(v, 0.6)),
             (nn.Threshold(0.2, -1.0), lambda v: F.threshold(v, 0.2, -1.0)),
             (nn.Hardshrink(0.7), lambda v: F.hardshrink(v, 0.7)), (nn.Softshrink(0.7), lambda v: F.softshrink(v, 0.7)),
             (nn.Softmin(1), lambda v: F.softmin(v, 1)), (nn.GLU(1), lambda v: F.glu(v, 1)))
    for m, f in pairs:
        np.testing.assert_array_equal(npa(m(x)), npa(f(x)))
        assert list(m.state_dict()) == []
    assert repr(nn.Hardtanh(-2.0, 3.0, inplace=True)) == "Hardtanh(min_val=-2.0, max_val=3.0, inplace=True)"
    assert repr(nn.Softshrink(0.7)) == "Softshrink(0.7)" and repr(nn.GLU()) == "GLU(dim=-1)"
    assert repr(nn.Threshold(0.2, -1.0)) == "Threshold(threshold=0.2, value=-1.0)"
    for m in (nn.ReLU6(inplace=True), nn.Hardsigmoid(inplace=True), nn.SELU(inplace=True), nn.CELU(inplace=True),
              nn.Threshold(0.1, 0.0, inplace=True)):
        y = x.clone()
        assert m(y) is y
    p = nn.PReLU(4, init=0.1, device=device, dtype=flame.float64)
    assert list(p.state_dict()) == ["weight"] and tuple(p.weight.shape) == (4,) and p.weight.requires_grad
    np.testing.assert_array_equal(npa(p.weight), [0.1] * 4)
    xg = T(rng.standard_normal((3, 4, 2)), device, grad=True)
    out = p(xg)
    np.testing.assert_allclose(npa(out), np.where(npa(xg) > 0, npa(xg), 0.1 * npa(xg)), rtol=1e-15)
    out.sum().backward()
    np.testing.assert_allclose(npa(p.weight.grad), np.minimum(npa(xg), 0).sum(axis=(0, 2)), rtol=1e-12)
    assert nn.PReLU().weight.shape == (1,) and repr(nn.PReLU()) == "PReLU(num_parameters=1)"
    with nn.empty_init():
        assert nn.PReLU(3).weight.is_meta
    with pytest.raises(ValueError, match="Hardtanh"):
        nn.Hardtanh(1.0, -1.0)


# ----------------------------------------------------------------------------- BatchNorm
def bn_ref_run(batches, momentum, eps=1e-5, axes=(0, 2, 3)):
    """Running statistics after each training batch (momentum None: cumulative average)."""
    C = batches[0].shape[1]
    rm, rv, n = np.zeros(C), np.ones(C), 0
    outs = []
    for x in batches:
        n += 1
        f = 1.0 / n if momentum is None else momentum
        m, v = x.mean(axes), x.var(axes)
        cnt = x.size // C
        shp = [1] * x.ndim
        shp[1] = C
        outs.append((x - m.reshape(shp)) / np.sqrt(v.reshape(shp) + eps))
        rm = (1 - f) * rm + f * m
        rv = (1 - f) * rv + f * v * cnt / (cnt - 1)
    return outs, rm, rv, n


@pytest.mark.parametrize("momentum", [0.1, None, 0.5])
def test_batchnorm2d_running_stats_and_eval(device, rng, momentum):
    bn = nn.BatchNorm2d(3, momentum=momentum, device=device).to(flame.float64)
    assert list(bn.state_dict()) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert bn.num_batches_tracked.dtype == flame.int64
    batches = [rng.standard_normal((4, 3, 2, 3)) * s + s for s in (1.0, 2.0, 0.5)]
    outs, rm, rv, n = bn_ref_run(batches, momentum)
    for x, want in zip(batches, outs):
        np.testing.assert_allclose(npa(bn(T(x, device))), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(bn.running_mean), rm, rtol=1e-12)
    np.testing.assert_allclose(npa(bn.running_var), rv, rtol=1e-12)
    assert int(bn.num_batches_tracked.item()) == n
    bn.eval()
    x = rng.standard_normal((2, 3, 2, 2))
    want = (x - rm[None, :, None, None]) / np.sqrt(rv[None, :, None, None] + 1e-5)
    np.testing.assert_allclose(npa(bn(T(x, device))), want, rtol=1e-10)
    assert int(bn.num_batches_tracked.item()) == n  # eval does not count


def test_batchnorm_flags(device, rng):
    x = rng.standard_normal((5, 4))
    bn = nn.BatchNorm1d(4, affine=False, track_running_stats=False, device=device).to(flame.float64)
    assert list(bn.state_dict()) == [] and bn.running_mean is None and bn.weight is None
    bn.eval()  # no running statistics: eval normalises with the batch's
    np.testing.assert_allclose(npa(bn(T(x, device))), (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-10)
    bn = nn.BatchNorm1d(4, device=device).to(flame.float64)
    with flame.no_grad():
        bn.weight.copy_(T([1.0, 2.0, 0.5, 1.5], device))
        bn.bias.copy_(T([0.0, 1.0, -1.0, 0.5], device))
    y = bn(T(x, device))
    np.testing.assert_allclose(npa(y), (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5) * [1, 2, .5, 1.5] + [0, 1, -1, .5],
                               rtol=1e-10)
    with pytest.raises(ValueError, match=r"expected 2D or 3D input \(got 4D"):
        bn(T(np.zeros((2, 4, 1, 1)), device))
    with pytest.raises(ValueError, match="expected 4 channels"):
        bn(T(np.zeros((2, 3)), device))
    with pytest.raises(ValueError, match="expected 4D input"):
        nn.BatchNorm2d(4)(T(x, device))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(T(x[:1], device))
    bn.reset_running_stats()
    assert int(bn.num_batches_tracked.item()) == 0 and npa(bn.running_var).tolist() == [1.0] * 4


def test_batchnorm_gradcheck_and_torch_fixture(device, rng, golden):
    bn = nn.BatchNorm2d(2, device=device).to(flame.float64)
    x = T(rng.standard_normal((3, 2, 2, 2)), device, grad=True)
    assert gradcheck(lambda v, w, b: F.batch_norm(v, None, None, w, b, True),
                     (x, T([1.5, 0.5], device, grad=True), T([0.1, -0.2], device, grad=True)))
    assert gradcheck(lambda v: bn(v), (x,))
    bn2 = nn.BatchNorm2d(3, momentum=None, device=device).to(flame.float64)
    g = case(golden, "bn2d")
    with flame.no_grad():
        bn2.weight.copy_(T(g["weight"], device))
        bn2.bias.copy_(T(g["bias"], device))
    np.testing.assert_allclose(npa(bn2(T(g["x1"], device))), g["y1"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(bn2(T(g["x2"], device))), g["y2"], rtol=1e-10, atol=1e-12)
    bn2.eval()
    np.testing.assert_allclose(npa(bn2(T(g["x3"], device))), g["y3"], rtol=1e-10, atol=1e-12)
    for k in ("running_mean", "running_var"):
        np.testing.assert_allclose(npa(getattr(bn2, k)), g[k], rtol=1e-12)
    assert int(bn2.num_batches_tracked.item()) == int(g["num_batches_tracked"]) == 2
    bn1 = nn.BatchNorm1d(4, momentum=0.3, device=device).to(flame.float64)
    g = case(golden, "bn1d")
    np.testing.assert_allclose(npa(bn1(T(g["input"], device))), g["out"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(bn1.running_var), g["running_var"], rtol=1e-12)


# ----------------------------------------------------------------------------- Conv1d / ConvTranspose2d
def test_conv1d_module(device, rng):
    m = nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2, device=device).to(flame.float64)
    assert tuple(m.weight.shape) == (6, 2, 3) and list(m.state_dict()) == ["weight", "bias"]
    assert np.abs(npa(m.bias)).max() <= 1 / math.sqrt(6)
    x = rng.standard_normal((2, 4, 9))
    np.testing.assert_array_equal(npa(m(T(x, device))),
                                  npa(F.conv1d(T(x, device), m.weight, m.bias, 2, 1, 1, 2)))
    r = nn.Conv1d(2, 1, 3, padding=2, padding_mode="reflect", bias=False, device=device).to(flame.float64)
    x = rng.standard_normal((1, 2, 6))
    xp = np.pad(x, ((0, 0), (0, 0), (2, 2)), mode="reflect")
    w = npa(r.weight)
    want = np.stack([(xp[0, :, i:i + 3] * w[0]).sum() for i in range(8)])
    np.testing.assert_allclose(npa(r(T(x, device)))[0, 0], want, rtol=1e-12)
    assert "padding_mode=reflect" in repr(r)


def test_conv_transpose2d_module(device, rng, golden):
    m = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, device=device).to(flame.float64)
    assert tuple(m.weight.shape) == (4, 3, 3, 3) and list(m.state_dict()) == ["weight", "bias"]
    assert np.abs(npa(m.weight)).max() <= 1 / math.sqrt(27)  # kaiming_uniform(a=sqrt 5): bound 1/sqrt(fan_in)
    extra = load(m, golden, "convt_a", ("input", "out"))
    np.testing.assert_allclose(npa(m(T(extra["input"], device))), extra["out"], rtol=1e-10, atol=1e-12)
    m2 = nn.ConvTranspose2d(3, 2, (2, 3), stride=(2, 1), padding=(1, 2), output_padding=(1, 1), dilation=2,
                            bias=False, device=device).to(flame.float64)
    extra = load(m2, golden, "convt_b", ("input", "out"))
    np.testing.assert_allclose(npa(m2(T(extra["input"], device))), extra["out"], rtol=1e-10, atol=1e-12)
    # output_size picks the output_padding (PyTorch's rule)
    m3 = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, device=device).to(flame.float64)
    x = T(rng.standard_normal((1, 2, 4, 4)), device)
    assert tuple(m3(x).shape) == (1, 2, 7, 7)
    assert tuple(m3(x, output_size=(8, 7)).shape) == (1, 2, 8, 7)
    assert tuple(m3(x, output_size=[1, 2, 8, 8]).shape) == (1, 2, 8, 8)
    with pytest.raises(flame.ShapeError, match="between 7 and 8"):
        m3(x, output_size=(9, 9))
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
    assert gradcheck(lambda v: m3(v), (T(rng.standard_normal((1, 2, 2, 3)), device, grad=True),))


# ----------------------------------------------------------------------------- PixelShuffle, Bilinear
def test_pixel_shuffle_modules(device, rng):
    x = T(rng.standard_normal((1, 8, 2, 3)), device)
    y = nn.PixelShuffle(2)(x)
    assert tuple(y.shape) == (1, 2, 4, 6)
    np.testing.assert_array_equal(npa(nn.PixelUnshuffle(2)(y)), npa(x))
    assert repr(nn.PixelShuffle(2)) == "PixelShuffle(upscale_factor=2)"


def test_bilinear_module(device, rng, golden):
    m = nn.Bilinear(3, 4, 2, device=device).to(flame.float64)
    assert list(m.state_dict()) == ["weight", "bias"] and tuple(m.weight.shape) == (2, 3, 4)
    assert np.abs(npa(m.weight)).max() <= 1 / math.sqrt(3)
    extra = load(m, golden, "bilinear", ("input1", "input2", "out"))
    np.testing.assert_allclose(npa(m(T(extra["input1"], device), T(extra["input2"], device))), extra["out"],
                               rtol=1e-12)


# ----------------------------------------------------------------------------- ParameterList / ParameterDict
def test_parameter_list(device):
    pl = nn.ParameterList([flame.zeros(2, device=device), nn.Parameter(flame.ones(3, device=device))])
    pl.append(flame.full((1,), 2.0, device=device))
    assert len(pl) == 3 and list(pl.state_dict()) == ["0", "1", "2"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in pl)
    assert isinstance(pl[1:], nn.ParameterList) and len(pl[1:]) == 2 and pl[-1] is pl[2]
    pl[0] = nn.Parameter(flame.full((2,), 5.0, device=device))
    assert npa(pl[0]).tolist() == [5.0, 5.0]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = nn.ParameterList([nn.Parameter(flame.ones(2, device=device)) for _ in range(2)])

        def forward(self, x):
            for w in self.ws:
                x = x * w
            return x

    net = Net()
    assert [n for n, _ in net.named_parameters()] == ["ws.0", "ws.1"]
    opt = nn.optim.SGD(net.parameters(), lr=0.5)
    net(flame.full((2,), 3.0, device=device)).sum().backward()
    opt.step()
    np.testing.assert_allclose(npa(net.ws[0]), [-0.5, -0.5])
    net.load_state_dict({"ws.0": np.zeros(2), "ws.1": np.full(2, 7.0)})
    assert npa(net.ws[1]).tolist() == [7.0, 7.0]
    with pytest.raises(IndexError, match="out of range"):
        pl[5]
    with pytest.raises(TypeError, match="iterable"):
        pl.extend(flame.zeros(2))
    assert "(1): Parameter containing: [flame.float32 of size 3" in repr(pl)


def test_parameter_dict(device):
    pd = nn.ParameterDict({"a": flame.zeros(2, device=device)})
    pd["b"] = nn.Parameter(flame.ones(1, device=device))
    pd.update([("c", flame.ones(3, device=device))])
    assert list(pd) == ["a", "b", "c"] and list(pd.state_dict()) == ["a", "b", "c"] and len(pd) == 3
    assert "b" in pd and pd.get("zz") is None and isinstance(pd["a"], nn.Parameter)
    assert [k for k, _ in pd.items()] == ["a", "b", "c"] and len(pd.values()) == 3
    p = pd.pop("b")
    assert tuple(p.shape) == (1,) and list(pd.state_dict()) == ["a", "c"]
    assert len(list(pd.parameters())) == 2
    with pytest.raises(KeyError, match="has no key 'b'"):
        pd["b"]
    with pytest.raises(TypeError, match="keys must be strings"):
        pd[1] = flame.zeros(1)
    pd.clear()
    assert len(pd) == 0 and list(pd.parameters()) == []


# ----------------------------------------------------------------------------- Transformer encoder
def ln_ref(x, w, b, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def mha_ref(x, s, nhead, pad=None, mask=None):
    """Self-attention of x (N, L, E) with PyTorch's packed in_proj; pad (N, L) True = ignore; mask (L, L) additive."""
    N, L, E = x.shape
    D = E // nhead
    qkv = x @ s["self_attn.in_proj_weight"].T + s["self_attn.in_proj_bias"]
    q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(N, L, nhead, D).transpose(0, 2, 1, 3) for i in range(3))
    sc = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    if mask is not None:
        sc = sc + mask
    if pad is not None:
        sc = np.where(pad[:, None, None, :], -np.inf, sc)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(N, L, E)
    return o @ s["self_attn.out_proj.weight"].T + s["self_attn.out_proj.bias"]


def encoder_layer_ref(x, s, nhead, norm_first, act, pad=None, mask=None):
    def ff(h):
        a = h @ s["linear1.weight"].T + s["linear1.bias"]
        a = np.maximum(a, 0) if act == "relu" else 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
        return a @ s["linear2.weight"].T + s["linear2.bias"]
    n1 = lambda h: ln_ref(h, s["norm1.weight"], s["norm1.bias"])  # noqa: E731
    n2 = lambda h: ln_ref(h, s["norm2.weight"], s["norm2.bias"])  # noqa: E731
    if norm_first:
        x = x + mha_ref(n1(x), s, nhead, pad, mask)
        return x + ff(n2(x))
    x = n1(x + mha_ref(x, s, nhead, pad, mask))
    return n2(x + ff(x))


@pytest.mark.parametrize("name,norm_first,act", [("enc_post", False, "relu"), ("enc_pre", True, "gelu")])
def test_transformer_encoder_layer(device, golden, name, norm_first, act):
    m = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first,
                                   device=device).to(flame.float64)
    extra = load(m, golden, name, ("input", "pad", "out"))
    state = {k: npa(v) for k, v in m.state_dict().items()}
    pad = extra["pad"].astype(bool)
    got = npa(m(T(extra["input"], device), src_key_padding_mask=flame.tensor(pad, device=device)))
    np.testing.assert_allclose(got, extra["out"], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got, encoder_layer_ref(extra["input"], state, 2, norm_first, act, pad), rtol=1e-9,
                               atol=1e-11)


def test_transformer_encoder_stack(device, golden, rng):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, device=device)
    m = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8, device=device), enable_nested_tensor=False)
    m = m.to(flame.float64)
    assert m.layers[0] is not m.layers[1] and m.layers[0].linear1.weight is not m.layers[1].linear1.weight
    extra = load(m, golden, "encoder", ("input", "mask", "out"))
    got = m(T(extra["input"], device), mask=T(extra["mask"], device), is_causal=True)
    np.testing.assert_allclose(npa(got), extra["out"], rtol=1e-9, atol=1e-11)
    # the same through the causal flag alone (no explicit mask)
    np.testing.assert_allclose(npa(m.layers[0](T(extra["input"], device), is_causal=True)),
                               npa(m.layers[0](T(extra["input"], device), src_mask=T(extra["mask"], device))),
                               rtol=1e-12, atol=1e-12)
    small = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True, device=device).to(flame.float64)
    x = T(rng.standard_normal((1, 3, 4)), device, grad=True)
    assert gradcheck(lambda v: small(v), (x,))
    with pytest.raises(RuntimeError, match="relu/gelu"):
        nn.TransformerEncoderLayer(4, 2, activation="swish")


def test_transformer_encoder_nested_tensor_path_gives_pytorchs_numbers(device, golden):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, device=device)
    m = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8, device=device)).to(flame.float64)
    assert m.use_nested_tensor and m.mask_check
    extra = load(m, golden, "nested", ("input", "left", "holes", "out_left", "out_left_float", "out_holes_checked",
                                       "out_holes_unchecked"))
    m.eval()
    x = T(extra["input"], device)
    left, holes = (flame.tensor(extra[k].astype(bool), device=device) for k in ("left", "holes"))
    left_float = flame.tensor(np.where(extra["left"].astype(bool), -np.inf, 0.0), device=device)
    with flame.no_grad():
        got = {"out_left": m(x, src_key_padding_mask=left), "out_left_float": m(x, src_key_padding_mask=left_float),
               "out_holes_checked": m(x, src_key_padding_mask=holes)}
        m.mask_check = False
        got["out_holes_unchecked"] = m(x, src_key_padding_mask=holes)
        m.mask_check = True
    for k, v in got.items():
        np.testing.assert_allclose(npa(v), extra[k], rtol=1e-9, atol=1e-11, err_msg=k)
    bias = npa(m.norm.bias)
    np.testing.assert_allclose(npa(got["out_left"])[1, 3:], np.broadcast_to(bias, (2, 8)), rtol=1e-12)  # zeros, normed
    # the dense path where PyTorch takes it: training, autograd, or the option off
    dense = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    assert not dense.use_nested_tensor
    dense.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("norm.")})
    dense = dense.to(flame.float64).eval()
    with flame.no_grad():
        out = npa(dense(x, src_key_padding_mask=left))
    assert np.abs(out[1, 3:]).min() > 0                                  # padded positions computed, not zeroed
    with flame.no_grad():
        m.train()
        assert np.abs(npa(m(x, src_key_padding_mask=left))[1, 3:] - bias).max() > 1e-3
        m.eval()
    assert np.abs(npa(m(x, src_key_padding_mask=left))[1, 3:] - bias).max() > 1e-3   # grad on, weights trainable
    with pytest.warns(UserWarning, match="num_heads is odd"):
        odd = nn.TransformerEncoder(nn.TransformerEncoderLayer(9, 3, 4, batch_first=True), 1)
    assert not odd.use_nested_tensor
    with pytest.warns(UserWarning, match="batch_first was not True"):
        nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 4), 1)


# ----------------------------------------------------------------------------- LSTM / GRU
def sig(v):
    return 1 / (1 + np.exp(-v))


def lstm_ref(x, s, layers, dirs, h0, c0, proj=False):
    """x (L, N, F); PyTorch's gate order i, f, g, o; returns out, h_n, c_n."""
    hs, cs = [], []
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            wi, wh = s["weight_ih" + sfx], s["weight_hh" + sfx]
            bi, bh = s.get("bias_ih" + sfx, 0), s.get("bias_hh" + sfx, 0)
            h, c = h0[layer * dirs + d], c0[layer * dirs + d]
            out = [None] * len(x)
            for t in (range(len(x) - 1, -1, -1) if d else range(len(x))):
                g = x[t] @ wi.T + bi + h @ wh.T + bh
                i, f, gg, o = np.split(g, 4, -1)
                c = sig(f) * c + sig(i) * np.tanh(gg)
                h = sig(o) * np.tanh(c)
                if proj:
                    h = h @ s["weight_hr" + sfx].T
                out[t] = h
            outs.append(np.stack(out))
            hs.append(h)
            cs.append(c)
        x = np.concatenate(outs, -1)
    return x, np.stack(hs), np.stack(cs)


def gru_ref(x, s, layers, h0):
    hs = []
    for layer in range(layers):
        sfx = f"_l{layer}"
        wi, wh, bi, bh = (s[k + sfx] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        h = h0[layer]
        out = []
        for t in range(len(x)):
            xr, xz, xn = np.split(x[t] @ wi.T + bi, 3, -1)
            hr, hz, hn = np.split(h @ wh.T + bh, 3, -1)
            r, z = sig(xr + hr), sig(xz + hz)
            n = np.tanh(xn + r * hn)
            h = (1 - z) * n + z * h
            out.append(h)
        x = np.stack(out)
        hs.append(h)
    return x, np.stack(hs)


def test_lstm_against_reference_and_torch(device, golden):
    m = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True, device=device).to(flame.float64)
    names = [f"{w}_l{k}{s}" for k in range(2) for s in ("", "_reverse")
             for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    assert list(m.state_dict()) == names
    assert tuple(m.weight_ih_l1.shape) == (16, 8) and tuple(m.weight_hh_l0_reverse.shape) == (16, 4)
    assert np.abs(npa(m.weight_ih_l0)).max() <= 0.5  # uniform(+-1/sqrt(hidden))
    extra = load(m, golden, "lstm", ("input", "h0", "c0", "out", "h_n", "c_n"))
    out, (h, c) = m(T(extra["input"], device), (T(extra["h0"], device), T(extra["c0"], device)))
    for got, k in ((out, "out"), (h, "h_n"), (c, "c_n")):
        np.testing.assert_allclose(npa(got), extra[k], rtol=1e-10, atol=1e-12)
    state = {k: npa(v) for k, v in m.state_dict().items()}
    ro, rh, rc = lstm_ref(extra["input"].transpose(1, 0, 2), state, 2, 2, extra["h0"], extra["c0"])
    np.testing.assert_allclose(npa(out), ro.transpose(1, 0, 2), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(c), rc, rtol=1e-10, atol=1e-12)


def test_lstm_projection_and_unbatched(device, golden, rng):
    m = nn.LSTM(3, 5, proj_size=2, device=device).to(flame.float64)
    assert list(m.state_dict()) == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_hr_l0"]
    assert tuple(m.weight_hh_l0.shape) == (20, 2)
    extra = load(m, golden, "lstm_proj", ("input", "out", "h_n", "c_n"))
    out, (h, c) = m(T(extra["input"], device))
    np.testing.assert_allclose(npa(out), extra["out"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(c), extra["c_n"], rtol=1e-10, atol=1e-12)
    x = rng.standard_normal((4, 3))  # (L, F): no batch dim
    out1, (h1, c1) = m(T(x, device))
    out2, (h2, _) = m(T(x[:, None], device))
    assert tuple(out1.shape) == (4, 2) and tuple(h1.shape) == (1, 2) and tuple(c1.shape) == (1, 5)
    np.testing.assert_allclose(npa(out1), npa(out2)[:, 0], rtol=1e-12)
    with pytest.raises(flame.ShapeError, match=r"expected h_0 of shape \(1, 2, 2\)"):
        m(T(rng.standard_normal((4, 2, 3)), device), (T(np.zeros((1, 2, 5)), device), T(np.zeros((1, 2, 5)),
                                                                                       device)))
    with pytest.raises(flame.ShapeError, match="input_size=3"):
        m(T(rng.standard_normal((4, 2, 2)), device))


def test_gru_against_reference_and_torch(device, golden):
    m = nn.GRU(3, 4, num_layers=2, device=device).to(flame.float64)
    assert list(m.state_dict())[:4] == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
    extra = load(m, golden, "gru", ("input", "h0", "out", "h_n"))
    out, h = m(T(extra["input"], device), T(extra["h0"], device))
    np.testing.assert_allclose(npa(out), extra["out"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(h), extra["h_n"], rtol=1e-10, atol=1e-12)
    ro, rh = gru_ref(extra["input"], {k: npa(v) for k, v in m.state_dict().items()}, 2, extra["h0"])
    np.testing.assert_allclose(npa(out), ro, rtol=1e-10, atol=1e-12)


def test_rnn_gradcheck_dropout_and_bias(device, rng):
    lstm = nn.LSTM(2, 3, bidirectional=True, device=device).to(flame.float64)
    gru = nn.GRU(2, 3, num_layers=2, batch_first=True, bias=False, device=device).to(flame.float64)
    assert not any("bias" in k for k in gru.state_dict())
    x = T(rng.standard_normal((3, 1, 2)), device, grad=True)
    h0 = T(rng.standard_normal((2, 1, 3)), device, grad=True)
    c0 = T(rng.standard_normal((2, 1, 3)), device, grad=True)
    assert gradcheck(lambda v, h, c: lstm(v, (h, c))[0], (x, h0, c0))
    assert gradcheck(lambda v: gru(v)[0], (x,))
    assert gradcheck(lambda w: lstm(x.detach())[0], (lstm.weight_hh_l0_reverse,))  # lstm reads w itself
    d = nn.LSTM(2, 3, num_layers=2, dropout=0.5, device=device).to(flame.float64)
    flame.manual_seed(0)
    a = npa(d(x.detach())[0])
    d.eval()
    b1, b2 = npa(d(x.detach())[0]), npa(d(x.detach())[0])
    np.testing.assert_array_equal(b1, b2)
    assert not np.allclose(a, b1)  # dropout between the layers in training only
    with pytest.raises(ValueError, match="hidden_size"):
        nn.GRU(2, 0)
    with pytest.warns(UserWarning, match="expects num_layers greater than 1"):
        nn.LSTM(2, 3, dropout=0.2)


# ----------------------------------------------------------------------------- loss modules
def test_loss_modules_match_functional(device, rng):
    a, b = T(rng.standard_normal((4, 3)), device), T(rng.standard_normal((4, 3)), device)
    p, t = T(rng.uniform(0.1, 0.9, (4, 3)), device), T(rng.uniform(0, 1, (4, 3)), device)
    w, pw = T(rng.uniform(0.5, 2, (4, 3)), device), T(rng.uniform(0.5, 2, 3), device)
    logits, cls = T(rng.standard_normal((4, 5)), device), flame.tensor([0, 4, 2, 1], device=device)
    cw = T(rng.uniform(0.5, 2, 5), device)
    pairs = [
        (nn.MSELoss(reduction="sum")(a, b), F.mse_loss(a, b, reduction="sum")),
        (nn.L1Loss()(a, b), F.l1_loss(a, b)),
        (nn.SmoothL1Loss(beta=0.5)(a, b), F.smooth_l1_loss(a, b, beta=0.5)),
        (nn.HuberLoss(delta=0.5, reduction="none")(a, b), F.huber_loss(a, b, reduction="none", delta=0.5)),
        (nn.BCELoss(weight=w)(p, t), F.binary_cross_entropy(p, t, weight=w)),
        (nn.BCEWithLogitsLoss(pos_weight=pw)(a, t), F.binary_cross_entropy_with_logits(a, t, pos_weight=pw)),
        (nn.KLDivLoss(reduction="batchmean", log_target=True)(a, b),
         F.kl_div(a, b, reduction="batchmean", log_target=True)),
        (nn.CrossEntropyLoss(weight=cw, label_smoothing=0.1)(logits, cls),
         F.cross_entropy(logits, cls, weight=cw, label_smoothing=0.1)),
        (nn.NLLLoss(ignore_index=2)(logits.log_softmax(1), cls), F.nll_loss(logits.log_softmax(1), cls,
                                                                          ignore_index=2)),
    ]
    for got, want in pairs:
        np.testing.assert_array_equal(npa(got), npa(want))
    assert list(nn.CrossEntropyLoss(weight=cw).state_dict()) == ["weight"]
    assert list(nn.BCEWithLogitsLoss(pos_weight=pw).state_dict()) == ["pos_weight"]
    assert list(nn.CrossEntropyLoss().state_dict()) == []
    with pytest.warns(UserWarning, match="deprecated"):
        assert nn.MSELoss(size_average=False).reduction == "sum"
    with pytest.warns(UserWarning, match="deprecated"):
        assert nn.L1Loss(reduce=False).reduction == "none"


# ----------------------------------------------------------------------------- hypothesis gradient checks
@given(kind=st.sampled_from(["lstm", "gru"]), L=st.integers(1, 3), N=st.integers(1, 2), H=st.integers(1, 3),
       layers=st.integers(1, 2), bidirectional=st.booleans(), batch_first=st.booleans(), seed=st.integers(0, 999))
@settings(max_examples=10)
def test_rnn_gradcheck_random_configs(device, kind, L, N, H, layers, bidirectional, batch_first, seed):
    flame.manual_seed(seed)
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    m = cls(2, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
            device=device).to(flame.float64)
    rng = np.random.default_rng(seed)
    x = T(rng.standard_normal((N, L, 2) if batch_first else (L, N, 2)), device, grad=True)
    h0 = T(rng.standard_normal(((2 if bidirectional else 1) * layers, N, H)), device, grad=True)
    if kind == "lstm":
        assert gradcheck(lambda v, h: (lambda o: (o[0], o[1][0], o[1][1]))(m(v, (h, h * 0.5))), (x, h0))
    else:
        assert gradcheck(lambda v, h: m(v, h), (x, h0))


@given(shape=st.sampled_from([(3, 2), (2, 3, 4), (2, 2, 2, 3)]), affine=st.booleans(), seed=st.integers(0, 999))
@settings(max_examples=8)
def test_batchnorm_gradcheck_random_shapes(device, shape, affine, seed):
    rng = np.random.default_rng(seed)
    C = shape[1]
    x = T(rng.standard_normal(shape) * 2, device, grad=True)
    w = T(rng.uniform(0.5, 1.5, C), device, grad=True) if affine else None
    b = T(rng.standard_normal(C), device, grad=True) if affine else None
    args = (x, w, b) if affine else (x,)
    assert gradcheck(lambda v, *wb: F.batch_norm(v, None, None, *(wb or (None, None)), training=True), args)


@given(n=st.integers(1, 3), i1=st.integers(1, 3), i2=st.integers(1, 3), o=st.integers(1, 3),
       seed=st.integers(0, 999))
@settings(max_examples=8)
def test_bilinear_gradcheck_random_shapes(device, n, i1, i2, o, seed):
    rng = np.random.default_rng(seed)
    args = [T(rng.standard_normal(s), device, grad=True) for s in ((n, i1), (n, i2), (o, i1, i2), (o,))]
    assert gradcheck(F.bilinear, tuple(args))


@given(N=st.integers(1, 2), C=st.integers(1, 3), H=st.integers(2, 7), W=st.integers(2, 7), k=st.integers(1, 3),
       s=st.integers(1, 3), pad=st.booleans(), dil=st.integers(1, 2), seed=st.integers(0, 999))
@example(N=1, C=2, H=6, W=5, k=2, s=2, pad=False, dil=1, seed=3)  # (the unpool check surely runs)
@example(N=2, C=1, H=7, W=7, k=3, s=3, pad=True, dil=1, seed=5)
@settings(max_examples=12, deadline=None)
def test_max_pool_and_unpool_gradcheck_random_geometries(device, N, C, H, W, k, s, pad, dil, seed):
    """max_pool2d (return_indices) and max_unpool2d of its output, float64 gradient checks on random geometries
    (distinct values: no ties the check's perturbation could flip)."""
    p = k // 2 if pad else 0
    if (H + 2 * p - dil * (k - 1) - 1) < 0 or (W + 2 * p - dil * (k - 1) - 1) < 0:
        return  # no window fits
    rng = np.random.default_rng(seed)
    x = T(rng.permutation(N * C * H * W).reshape(N, C, H, W) * 0.1, device, grad=True)
    assert gradcheck(lambda a: F.max_pool2d(a, k, s, p, dil, return_indices=True)[0], (x,))
    y, idx = F.max_pool2d(x.detach(), k, s, p, dil, return_indices=True)
    yg = T(rng.standard_normal(tuple(y.shape)), device, grad=True)
    if dil == 1 and s >= k:  # windows that do not overlap: every index once (a repeated index keeps one of its
        # values, which one undefined, as in PyTorch, while the gradient reaches them all)
        assert gradcheck(lambda a: F.max_unpool2d(a, idx, k, s, p, output_size=(H, W)), (yg,))



# ----------------------------------------------------------------------------- padding modules
_PAD_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "padding.safetensors")
_PAD_NAMES = [f"{k}Pad{d}d" for k in ("Reflection", "Replication", "Circular", "Zero", "Constant") for d in (1, 2, 3)]


@pytest.mark.parametrize("name", _PAD_NAMES)
def test_padding_modules_match_pytorch(device, name):
    """Each padding module against PyTorch's output and input gradient (tests/fixtures/make_padding_fixtures.py),
    batched and unbatched inputs, asymmetric paddings."""
    fx = {k[len(name) + 1:]: v for k, v in load_file(_PAD_FIXTURE).items() if k.startswith(name + ".")}
    pad = tuple(int(v) for v in fx["padding"])
    cls = getattr(nn, name)
    m = cls(pad, 2.5) if name.startswith("Constant") else cls(pad)
    x = T(fx["x"], device, grad=True)
    y = m(x)
    np.testing.assert_array_equal(npa(y), fx["out"])
    y.backward(T(fx["go"], device))
    np.testing.assert_allclose(npa(x.grad), fx["grad"], rtol=1e-14, atol=1e-15)
    if len(set(pad)) == 1:  # an int means every side
        np.testing.assert_array_equal(npa((cls(pad[0], 2.5) if name.startswith("Constant") else cls(pad[0]))(
            T(fx["x"], device))), fx["out"])


def test_padding_module_reprs_and_refusals(device):
    assert repr(nn.ReflectionPad2d((1, 0, 2, 1))) == "ReflectionPad2d((1, 0, 2, 1))"
    assert repr(nn.ZeroPad2d(2)) == "ZeroPad2d((2, 2, 2, 2))"
    assert repr(nn.ConstantPad2d(1, 3.5)) == "ConstantPad2d(padding=(1, 1, 1, 1), value=3.5)"
    with pytest.raises(ValueError, match="4 ints"):
        nn.ReflectionPad2d((1, 2, 3))
    with pytest.raises(flame.errors.ShapeError, match="3-D .unbatched. or 4-D input"):
        nn.ReflectionPad2d(1)(T(np.ones((4, 4)), device))
    with pytest.raises(flame.errors.ShapeError, match="reflect padding"):
        nn.ReflectionPad1d(3)(T(np.ones((1, 2, 3)), device))


# ------------------------------------------------------------------ channel dropout, softmax modules, distances
@pytest.mark.parametrize("cls, fn, shape, lead", [(nn.Dropout1d, F.dropout1d, (6, 40, 5), 2),
                                                  (nn.Dropout1d, F.dropout1d, (40, 5), 1),
                                                  (nn.Dropout2d, F.dropout2d, (6, 40, 3, 4), 2),
                                                  (nn.Dropout3d, F.dropout3d, (3, 40, 2, 2, 3), 2),
                                                  (nn.Dropout3d, F.dropout3d, (40, 2, 2, 3), 1)])
def test_channel_dropout(device, cls, fn, shape, lead):
    """Whole channels zeroed (one draw per (sample, channel)), the rest scaled by 1 / (1 - p); the gradient is the
    same mask; identity in eval mode and at p = 0; zeros at p = 1."""
    flame.manual_seed(3)
    x = T(np.ones(shape), device, grad=True)
    m = cls(0.4)
    y = m(x)
    v = npa(y).reshape(shape[:lead] + (-1,))
    per = v[..., 0]
    assert np.all((v == per[..., None]))  # one value per channel
    assert set(np.unique(per)) <= {0.0, 1.0 / 0.6} and 0.2 < (per == 0).mean() < 0.6
    y.backward(T(np.ones(shape), device))
    np.testing.assert_array_equal(npa(x.grad), npa(y))
    m.eval()
    assert m(x) is x
    assert fn(x, 0.0) is x
    assert not npa(fn(x, 1.0)).any()
    z = T(np.ones(shape), device)
    assert fn(z, 0.5, inplace=True) is z
    with pytest.raises(ValueError, match="between 0 and 1"):
        fn(x, 1.5)
    with pytest.raises(ValueError, match="D .unbatched."):
        fn(T(np.ones((2,) * (len(shape) + 2)), device), 0.5)


def test_dropout2d_reads_a_3d_input_as_pytorch_does(device):
    flame.manual_seed(0)
    with pytest.warns(UserWarning, match=r"interpreted as shape \(N, C, L\)"):
        y = F.dropout2d(T(np.ones((4, 30, 6)), device), 0.5)
    v = npa(y)
    assert np.all(v == v[..., :1])  # one draw per (N, C) of its first two dimensions
    assert len(np.unique(v[:, :, 0])) == 2


def test_logsoftmax_softmax2d_modules(device, rng):
    x = T(rng.standard_normal((2, 3, 4, 5)), device)
    np.testing.assert_array_equal(npa(nn.LogSoftmax(1)(x)), npa(F.log_softmax(x, 1)))
    np.testing.assert_array_equal(npa(nn.LogSoftmax()(x)), npa(F.log_softmax(x, -1)))
    s = nn.Softmax2d()(x)
    np.testing.assert_allclose(npa(s).sum(1), 1.0, rtol=1e-14)
    np.testing.assert_array_equal(npa(nn.Softmax2d()(x[0])), npa(F.softmax(x[0], 0)))
    with pytest.raises(ValueError, match="3-D or 4-D"):
        nn.Softmax2d()(x[0, 0])


@pytest.mark.parametrize("p, keepdim", [(2.0, False), (1.0, True), (3.0, False)])
def test_pairwise_distance_and_modules(device, rng, p, keepdim):
    a, b = rng.standard_normal((4, 5)), rng.standard_normal((1, 5))
    want = (np.abs(a - b + 1e-6) ** p).sum(-1, keepdims=keepdim) ** (1 / p)
    np.testing.assert_allclose(npa(F.pairwise_distance(T(a, device), T(b, device), p, keepdim=keepdim)), want,
                               rtol=1e-12)
    np.testing.assert_allclose(npa(nn.PairwiseDistance(p, keepdim=keepdim)(T(a, device), T(b, device))), want,
                               rtol=1e-12)
    xa = T(a, device, grad=True)
    assert gradcheck(lambda v: F.pairwise_distance(v, T(b, device), p), (xa,))
    np.testing.assert_array_equal(npa(nn.CosineSimilarity(1)(T(a, device), T(b, device))),
                                  npa(F.cosine_similarity(T(a, device), T(b, device), 1)))
    assert repr(nn.PairwiseDistance()) == "PairwiseDistance(p=2.0, eps=1e-06, keepdim=False)"
    with pytest.raises(flame.errors.ShapeError, match="cannot be broadcast"):
        F.pairwise_distance(T(a, device), T(np.ones((3, 2)), device))



# ----------------------------------------------------------------------------- unfold / fold
_FOLD_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn")
with open(os.path.join(_FOLD_DIR, "fold.json")) as _f:
    _FOLD = json.load(_f)


@pytest.mark.parametrize("name", sorted(_FOLD))
def test_unfold_fold_match_pytorch(device, name):
    """F.unfold / F.fold and their modules against PyTorch (tests/fixtures/make_fold_fixtures.py): outputs and input
    gradients over kernel sizes, dilation, padding, stride, overlapping blocks and unbatched inputs."""
    fx = {k[len(name) + 1:]: v for k, v in load_file(os.path.join(_FOLD_DIR, "fold.safetensors")).items()
          if k.startswith(name + ".")}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in _FOLD[name].items()}
    fn, cls = (F.unfold, nn.Unfold) if name.startswith("unfold") else (F.fold, nn.Fold)
    x = T(fx["x"], device, grad=True)
    y = fn(x, **kw)
    np.testing.assert_allclose(npa(y), fx["out"], rtol=1e-14, atol=1e-15)
    y.backward(T(fx["go"], device))
    np.testing.assert_allclose(npa(x.grad), fx["grad"], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(npa(cls(**kw)(T(fx["x"], device))), fx["out"], rtol=1e-14, atol=1e-15)


@given(H=st.integers(3, 7), W=st.integers(3, 7), k=st.integers(1, 3), s=st.integers(1, 2), p=st.integers(0, 1),
       d=st.integers(1, 2), seed=st.integers(0, 999))
@settings(max_examples=10, deadline=None)
def test_unfold_fold_gradcheck(device, H, W, k, s, p, d, seed):
    if H + 2 * p - d * (k - 1) - 1 < 0 or W + 2 * p - d * (k - 1) - 1 < 0:
        return
    rng = np.random.default_rng(seed)
    x = T(rng.standard_normal((1, 2, H, W)), device, grad=True)
    assert gradcheck(lambda a: F.unfold(a, k, d, p, s), (x,))
    cols = F.unfold(x.detach(), k, d, p, s)
    c = T(rng.standard_normal(tuple(cols.shape)), device, grad=True)
    assert gradcheck(lambda a: F.fold(a, (H, W), k, d, p, s), (c,))


def test_fold_refusals(device):
    with pytest.raises(flame.errors.ShapeError, match="holds 3 x 2 = 6"):
        F.fold(T(np.ones((1, 4, 5)), device), (4, 3), 2)
    with pytest.raises(flame.errors.ShapeError, match="divisible"):
        F.fold(T(np.ones((1, 5, 6)), device), (4, 3), 2)
    with pytest.raises(flame.errors.ShapeError, match="does not fit"):
        F.unfold(T(np.ones((1, 1, 2, 2)), device), 3)


# ----------------------------------------------------------------------------- instance norm
_IN_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "instance_norm.safetensors")


def test_instance_norm_matches_pytorch(device):
    """F.instance_norm and nn.InstanceNorm1d / 2d / 3d against PyTorch (tests/fixtures/make_instance_norm_fixtures.py):
    the plain op with its input gradient; an affine, tracked InstanceNorm2d over two training steps (outputs, input /
    weight / bias gradients, the running statistics) and then in eval (the running statistics used); an unbatched
    InstanceNorm1d; momentum=None leaving the running statistics where they are."""
    fx = load_file(_IN_FIXTURE)
    x = T(fx["plain.x"], device, grad=True)
    y = F.instance_norm(x)
    np.testing.assert_allclose(npa(y), fx["plain.out"], rtol=1e-12, atol=1e-13)
    y.backward(T(fx["plain.go"], device))
    np.testing.assert_allclose(npa(x.grad), fx["plain.grad"], rtol=1e-10, atol=1e-12)

    m = nn.InstanceNorm2d(3, affine=True, track_running_stats=True, device=device, dtype=flame.float64)
    m.load_state_dict({"weight": T(fx["tracked.weight"], device), "bias": T(fx["tracked.bias"], device),
                       "running_mean": T(np.zeros(3), device), "running_var": T(np.ones(3), device),
                       "num_batches_tracked": flame.tensor(0, dtype=flame.int64, device=device)})
    x1 = T(fx["tracked.x1"], device, grad=True)
    out1 = m(x1)
    np.testing.assert_allclose(npa(out1), fx["tracked.out1"], rtol=1e-12, atol=1e-13)
    out1.backward(T(fx["tracked.go1"], device))
    np.testing.assert_allclose(npa(x1.grad), fx["tracked.grad1"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(m.weight.grad), fx["tracked.gweight"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(m.bias.grad), fx["tracked.gbias"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npa(m(T(fx["tracked.x2"], device))), fx["tracked.out2"], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(npa(m.running_mean), fx["tracked.running_mean"], rtol=1e-12)
    np.testing.assert_allclose(npa(m.running_var), fx["tracked.running_var"], rtol=1e-12)
    m.eval()
    np.testing.assert_allclose(npa(m(T(fx["tracked.x3"], device))), fx["tracked.out3"], rtol=1e-12, atol=1e-13)

    u = nn.InstanceNorm1d(4, dtype=flame.float64, device=device)
    np.testing.assert_allclose(npa(u(T(fx["unbatched.x"], device))), fx["unbatched.out"], rtol=1e-12, atol=1e-13)
    assert list(u.state_dict()) == []
    v = nn.InstanceNorm3d(2, momentum=None, track_running_stats=True, dtype=flame.float64, device=device)
    np.testing.assert_allclose(npa(v(T(fx["vol.x"], device))), fx["vol.out"], rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(npa(v.running_mean), fx["vol.running_mean"])
    np.testing.assert_array_equal(npa(v.running_var), fx["vol.running_var"])


def test_instance_norm_refusals_and_gradcheck(device, rng):
    with pytest.raises(ValueError, match="expected 3D .unbatched. or 4D input"):
        nn.InstanceNorm2d(3)(T(np.ones((3, 4)), device))
    with pytest.raises(ValueError, match="num_features"):
        nn.InstanceNorm2d(3, affine=True)(T(np.ones((1, 2, 3, 3)), device))
    with pytest.raises(ValueError, match="required when use_input_stats=False"):
        F.instance_norm(T(np.ones((1, 2, 3)), device), use_input_stats=False)
    x = T(rng.standard_normal((2, 2, 3, 2)), device, grad=True)
    w = T(rng.uniform(0.5, 1.5, 2), device, grad=True)
    assert gradcheck(lambda a, b: F.instance_norm(a, weight=b), (x, w))


@given(H=st.integers(1, 7), W=st.integers(1, 7), oh=st.integers(1, 5), ow=st.integers(1, 5), seed=st.integers(0, 999))
@settings(max_examples=10, deadline=None)
def test_adaptive_max_pool_and_1d_pools_gradcheck(device, H, W, oh, ow, seed):
    rng = np.random.default_rng(seed)
    x = T(rng.permutation(2 * H * W).reshape(1, 2, H, W) * 0.1, device, grad=True)  # distinct values: no ties
    assert gradcheck(lambda a: F.adaptive_max_pool2d(a, (oh, ow)), (x,))
    v = T(rng.standard_normal((2, 3, H + 3)), device, grad=True)
    assert gradcheck(lambda a: F.avg_pool1d(a, 2, 1, 1, count_include_pad=False), (v,))
    assert gradcheck(lambda a: F.adaptive_avg_pool1d(a, oh), (v,))
