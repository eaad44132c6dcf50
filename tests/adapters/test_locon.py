"""LoRA on Conv2d (LoCon): forward against a NumPy convolution reference on ragged shapes (stride 2, padding,
dilation, 1x1), float64 gradients (hypothesis over shapes), merge / unmerge, enable / disable, files (kohya, PEFT)
and the errors (other kinds, grouped convolutions)."""
import numpy as np
import pytest
from adapter_helpers import randomize
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_nn.adapters import AdapterError, LoRAConv2d, adapter_parameters
from flame_nn.module import Module


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def conv_ref(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """NumPy float64 convolution (cross-correlation, as PyTorch): x (N, C, H, W), w (O, C, kh, kw)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    x = np.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    ho = (x.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (x.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i * dilation[0]: i * dilation[0] + stride[0] * (ho - 1) + 1: stride[0],
                      j * dilation[1]: j * dilation[1] + stride[1] * (wo - 1) + 1: stride[1]]
            y += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return y


class Convs(Module):
    def __init__(self, device=None, dtype=flame.float64):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.conv1 = flame_nn.Conv2d(3, 5, 3, padding=1, **kw)
        self.down = flame_nn.Conv2d(5, 5, 3, stride=2, padding=1, **kw)
        self.skip = flame_nn.Conv2d(5, 4, 1, bias=False, **kw)
        self.odd = flame_nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 0), dilation=(1, 2), **kw)
        self.lin = flame_nn.Linear(6, 2, **kw)

    def forward(self, x):
        h = self.skip(self.down(self.conv1(x)).tanh())
        return self.lin(self.odd(h).permute(0, 2, 3, 1))


def _ref(model, x, deltas):
    def c(name, h):
        m = getattr(model, name)
        w = _np(m.weight) + deltas.get(name, 0)
        y = conv_ref(h, w, m.stride, m.padding, m.dilation)
        return y + (0 if m.bias is None else _np(m.bias)[None, :, None, None])
    h = c("skip", np.tanh(c("down", c("conv1", x))))
    h = c("odd", h).transpose(0, 2, 3, 1)
    return h @ _np(model.lin.weight).T + _np(model.lin.bias)


def _lora_delta(ad):
    """ΔW from the adapter's tensors in NumPy: s · up[:, :, 0, 0] @ down.reshape(r, -1)."""
    a, b = _np(ad.lora_A), _np(ad.lora_B)
    return ad.scale * (b[:, :, 0, 0] @ a.reshape(a.shape[0], -1)).reshape((b.shape[0],) + a.shape[1:])


@pytest.fixture
def convs(device):
    flame.manual_seed(0)
    return Convs(device)


def test_forward_against_numpy(convs, rng, device):
    made = A.inject_adapters(convs, ["conv1", "down", "skip", "odd"], "locon", rank=2, alpha=3.0,
                             dtype=flame.float64)
    assert [m for m, _ in made] == ["conv1", "down", "skip", "odd"]
    ads = {m: ad for m, _, ad in A.adapter_modules(convs)}
    assert tuple(ads["odd"].lora_A.shape) == (2, 4, 3, 2) and tuple(ads["odd"].lora_B.shape) == (6, 2, 1, 1)
    assert ads["down"].stride == (2, 2) and ads["odd"].dilation == (1, 2) and ads["skip"].kernel_size == (1, 1)
    assert np.all(_np(ads["conv1"].lora_B) == 0)      # up starts at zero: the model starts as the base
    x = rng.standard_normal((2, 3, 11, 9))            # ragged: odd sides through stride 2
    xt = flame.tensor(x, dtype=flame.float64, device=device)
    np.testing.assert_allclose(_np(convs(xt)), _ref(convs, x, {}), rtol=1e-10, atol=1e-12)
    randomize(adapter_parameters(convs), rng)
    deltas = {m: _lora_delta(ad) for m, ad in ads.items()}
    y = _np(convs(xt))
    ref = _ref(convs, x, deltas)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    assert np.abs(ref - _ref(convs, x, {})).max() > 1e-2
    # the conv composition itself: base + s * up(down(x)) for one layer
    h = rng.standard_normal((1, 5, 7, 6))
    m = convs.down
    want = conv_ref(h, _np(m.weight), (2, 2), (1, 1)) + _np(m.bias)[None, :, None, None] + ads["down"].scale * \
        conv_ref(conv_ref(h, _np(ads["down"].lora_A), (2, 2), (1, 1)), _np(ads["down"].lora_B))
    np.testing.assert_allclose(_np(m(flame.tensor(h, dtype=flame.float64, device=device))), want, rtol=1e-10,
                               atol=1e-12)


def test_merge_unmerge_enable_disable_weights(convs, rng, device):
    A.inject_adapters(convs, ["conv1", "down", "odd"], "lora", rank=3, alpha=1.5, dtype=flame.float64)
    randomize(adapter_parameters(convs), rng)
    x = flame.tensor(rng.standard_normal((1, 3, 8, 10)), dtype=flame.float64, device=device)
    w0 = {n: _np(getattr(convs, n).weight) for n in ("conv1", "down", "odd")}
    y = _np(convs(x))
    A.merge_adapters(convs)
    for mod, _, ad in A.adapter_modules(convs):
        np.testing.assert_allclose(_np(getattr(convs, mod).weight), w0[mod] + _lora_delta(ad), rtol=1e-12,
                                   atol=1e-14)
    np.testing.assert_allclose(_np(convs(x)), y, rtol=1e-10, atol=1e-12)
    A.unmerge_adapters(convs)
    for n, w in w0.items():
        assert np.array_equal(_np(getattr(convs, n).weight), w)
    A.disable_adapters(convs)
    base = _np(convs(x))
    A.enable_adapters(convs)
    A.set_adapter_weight(convs, "default", 0.5)
    half = _np(convs(x))
    assert np.abs(base - y).max() > 1e-2 and not np.allclose(half, y) and not np.allclose(half, base)
    A.remove_adapters(convs)
    assert type(convs.conv1) is flame_nn.Conv2d
    np.testing.assert_allclose(_np(convs(x)), base, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(cin=st.integers(1, 3), cout=st.integers(1, 3), k=st.sampled_from([1, 2, 3]), stride=st.integers(1, 2),
       padding=st.integers(0, 1), rank=st.integers(1, 3), h=st.integers(3, 5))
def test_gradcheck_float64(cin, cout, k, stride, padding, rank, h):
    rng = np.random.default_rng(cin * 100 + cout * 10 + k)
    conv = flame_nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dtype=flame.float64)
    ad = LoRAConv2d.for_conv(conv, rank=rank, alpha=2.0, dtype=flame.float64)
    A.adapt(conv).add_adapter("default", ad)
    conv.requires_grad_(False)
    randomize(list(ad.parameters()), rng)
    x = flame.tensor(rng.standard_normal((2, cin, h, h + 1)), dtype=flame.float64, requires_grad=True)

    def f(x, a, b):
        return conv(x)
    assert flame.autograd.gradcheck(f, (x, ad.lora_A, ad.lora_B), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_files_roundtrip(convs, rng, device, tmp_path, fmt):
    A.inject_adapters(convs, ["conv1", "down", "skip", "lin"], "lora", rank=2, alpha=4.0, dtype=flame.float64)
    randomize(adapter_parameters(convs), rng)
    x = flame.tensor(rng.standard_normal((1, 3, 9, 7)), dtype=flame.float64, device=device)
    y = _np(convs(x))
    path = str(tmp_path / "locon.safetensors")
    A.save_adapters(convs, path, format=fmt)
    from flame_core.io import safe_open
    with safe_open(path) as f:
        shapes = {k: tuple(f.get_array(k).shape) for k in f.keys()}
    down, up = ("lora_A", "lora_B") if fmt == "peft" else ("lora_down", "lora_up")
    name = "transformer.down" if fmt == "peft" else "lora_unet_down"
    assert shapes[f"{name}.{down}.weight"] == (2, 5, 3, 3) and shapes[f"{name}.{up}.weight"] == (5, 2, 1, 1)
    params = [_np(p) for p in adapter_parameters(convs)]
    A.remove_adapters(convs)
    A.load_adapters(convs, path, dtype=flame.float64)            # fresh adapters shaped by the file
    for p, q in zip(adapter_parameters(convs), params):
        np.testing.assert_allclose(_np(p), q, rtol=1e-6)
    np.testing.assert_allclose(_np(convs(x)), y, rtol=1e-6, atol=1e-9)


def test_squeezed_1x1_file_loads(convs, rng, tmp_path):
    from flame_core.io import save_file
    down, up = rng.standard_normal((2, 5)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    path = str(tmp_path / "sq.safetensors")
    save_file({"lora_unet_skip.lora_down.weight": down, "lora_unet_skip.lora_up.weight": up,
               "lora_unet_skip.alpha": np.asarray(2.0, np.float32)}, path)
    A.load_adapters(convs, path, dtype=flame.float64)
    (_, _, ad), = A.adapter_modules(convs)
    np.testing.assert_array_equal(_np(ad.lora_A)[:, :, 0, 0], down)
    np.testing.assert_array_equal(_np(ad.lora_B)[:, :, 0, 0], up)


def test_errors(convs, device):
    for kind in ("dora", "lokr", "loha"):
        with pytest.raises(AdapterError, match=f"down: a {kind} adapter cannot adapt a Conv2d"):
            A.inject_adapters(convs, ["down", "lin"], kind)
        assert not A.adapted_modules(convs)                     # nothing changed
    grouped = flame_nn.Conv2d(4, 4, 3, groups=2, device=device)
    with pytest.raises(AdapterError, match="grouped"):
        A.adapt(grouped)
    A.inject_adapters(convs, ["conv1"], "lora", rank=2)
    with pytest.raises(AdapterError, match="does not fit a Conv2d"):
        convs.conv1.add_adapter("other", LoRAConv2d(3, 5, 1))
    with pytest.raises(AdapterError, match="cannot adapt a Conv2d"):
        convs.conv1.add_adapter("other", A.LoRA(3, 5))
