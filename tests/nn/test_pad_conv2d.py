"""F.pad_conv2d: conv2d with the zero padding folded in equals F.pad then conv2d - output, input gradient (the
input's shape), weight and bias gradients - on ragged shapes, strides, dilation and batch sizes; float64 hypothesis
gradcheck; bad pads and biases are refused before any work; the VAE encoder's Downsample runs it."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd.gradcheck import gradcheck

CASES = [  # (N, C, H, W, O, k, stride, dilation, pad (left, right, top, bottom))
    (1, 4, 9, 9, 5, 3, 2, 1, (0, 1, 0, 1)),      # the VAE downsample
    (2, 3, 8, 10, 4, 3, 2, 1, (0, 1, 0, 1)),     # even sizes: the last padded column is read
    (3, 2, 7, 6, 3, 3, 1, 1, (1, 0, 2, 1)),      # stride 1, every side different
    (1, 3, 11, 9, 2, 5, 2, 1, (2, 1, 0, 3)),     # 5x5
    (2, 2, 9, 8, 3, 3, 1, 2, (0, 2, 2, 0)),      # dilation 2
    (1, 5, 6, 7, 4, 1, 1, 1, (0, 1, 0, 1)),      # 1x1 with a trailing pad: not a plain pointwise conv
    (1, 2, 6, 6, 3, 3, (2, 1), 1, (1, 0, 0, 1)),  # per-axis strides
]


@pytest.mark.parametrize("case", CASES)
def test_matches_pad_then_conv(case, device):
    N, C, H, W, O, k, stride, dil, pad = case
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((N, C, H, W))
    ws = rng.standard_normal((O, C, k, k)) * 0.3
    bs = rng.standard_normal(O)

    def run(fused):
        x = flame.tensor(xs, dtype=flame.float64, device=device, requires_grad=True)
        w = flame.tensor(ws, dtype=flame.float64, device=device, requires_grad=True)
        b = flame.tensor(bs, dtype=flame.float64, device=device, requires_grad=True)
        y = F.pad_conv2d(x, w, b, pad, stride=stride, dilation=dil) if fused else \
            F.conv2d(F.pad(x, pad), w, b, stride=stride, dilation=dil)
        y.backward(flame.tensor(np.cos(np.arange(y.numel())).reshape(y.shape), dtype=flame.float64, device=device))
        return y.detach().numpy(), x.grad.numpy(), w.grad.numpy(), b.grad.numpy()
    got, want = run(True), run(False)
    assert got[1].shape == (N, C, H, W)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(st.integers(5, 8), st.integers(5, 8), st.integers(1, 2), st.integers(1, 3),
       st.tuples(*[st.integers(0, 2)] * 4))
def test_gradcheck_float64(H, W, stride, k, pad):
    rng = np.random.default_rng(H * 7 + W)
    x = flame.tensor(rng.standard_normal((1, 2, H, W)), dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal((3, 2, k, k)), dtype=flame.float64, requires_grad=True)
    b = flame.tensor(rng.standard_normal(3), dtype=flame.float64, requires_grad=True)
    assert gradcheck(lambda x, w, b: F.pad_conv2d(x, w, b, pad, stride=stride), (x, w, b))


def test_unbatched_input():
    x = flame.randn(2, 6, 6, dtype=flame.float64)
    w = flame.randn(3, 2, 3, 3, dtype=flame.float64)
    y = F.pad_conv2d(x, w, None, (0, 1, 0, 1), stride=2)
    np.testing.assert_allclose(y.numpy(), F.conv2d(F.pad(x.unsqueeze(0), (0, 1, 0, 1)), w, stride=2)[0].numpy())


@pytest.mark.parametrize("pad, match", [((0, 1), "four integers"), ((0, -1, 0, 1), "four integers"),
                                        ((0, 1.5, 0, 1), "four integers")])
def test_bad_pad_is_refused(pad, match):
    x, w = flame.randn(1, 2, 6, 6), flame.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match=match):
        F.pad_conv2d(x, w, None, pad, stride=2)


def test_bad_bias_is_refused():
    x, w = flame.randn(1, 2, 6, 6), flame.randn(3, 2, 3, 3)
    with pytest.raises(Exception, match="bias of shape"):
        F.pad_conv2d(x, w, flame.randn(4), (0, 1, 0, 1), stride=2)


def test_vae_downsample_folds_the_pad_and_keeps_it_for_adapted_convs():
    """The plain conv takes pad_conv2d (no padded copy); the same numbers as F.pad + the layer."""
    from flame_models.vae.layers import Downsample
    flame.manual_seed(0)
    d = Downsample(4, dtype=flame.float64)
    x = flame.randn(2, 4, 9, 8, dtype=flame.float64)
    want = d.conv(F.pad(x, (0, 1, 0, 1)))
    calls = []
    orig = F.pad_conv2d
    import flame_models.vae.layers as L
    L.F.pad_conv2d = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        got = d(x)
    finally:
        L.F.pad_conv2d = orig
    assert calls == [1]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_vae_downsample_with_a_hooked_conv_pads_first():
    """A conv with a forward hook (or adapters) sees the padded input, as F.pad + the layer gives it."""
    from flame_models.vae.layers import Downsample
    flame.manual_seed(0)
    d = Downsample(3, dtype=flame.float64)
    x = flame.randn(1, 3, 8, 8, dtype=flame.float64)
    seen = []
    d.conv.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    y = d(x)
    assert seen == [(1, 3, 9, 9)] and tuple(y.shape) == (1, 3, 4, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["im2col", "igemm", "wgmma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3], (2, 40, 17, 16, 24, 3, 2, 1, (0, 1, 0, 1)),
                                  (1, 24, 15, 13, 40, 3, 1, 1, (1, 0, 2, 1))])
def test_gpu_paths_match_the_float64_reference(case, dtype, algo, monkeypatch):
    """Every CUDA path (im2col + cuBLAS, the mma.sync and wgmma implicit GEMMs; dx strided by phases) with the pad
    folded in, against pad + conv in float64 on the cpu: output, dx, dw."""
    from flame_core.kernels import conv as K
    if algo == "wgmma" and not K.wgmma_available():
        pytest.skip("needs compute capability 9.0")
    monkeypatch.setenv("FLAME_CONV_ALGO", algo)
    N, C, H, W, O, k, stride, dil, pad = case
    rng = np.random.default_rng(1)
    dt = getattr(flame, dtype)
    xs = rng.standard_normal((N, C, H, W)).astype(np.float32)
    ws = (rng.standard_normal((O, C, k, k)) * 0.2).astype(np.float32)
    xs, ws = (flame.tensor(a).to(dt).float().numpy().astype(np.float64) for a in (xs, ws))  # rounded to dtype
    x = flame.tensor(xs, device="cuda").to(dt).requires_grad_(True)
    w = flame.tensor(ws, device="cuda").to(dt).requires_grad_(True)
    y = F.pad_conv2d(x, w, None, pad, stride=stride, dilation=dil)
    gys = np.cos(np.arange(y.numel())).reshape(y.shape)
    y.backward(flame.tensor(gys, device="cuda").to(dt))
    xr = flame.tensor(xs, dtype=flame.float64, requires_grad=True)
    wr = flame.tensor(ws, dtype=flame.float64, requires_grad=True)
    yr = F.conv2d(F.pad(xr, pad), wr, stride=stride, dilation=dil)
    yr.backward(flame.tensor(gys, dtype=flame.float64))
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    for got, want in ((y.detach(), yr.detach()), (x.grad, xr.grad), (w.grad, wr.grad)):
        a, b = got.float().numpy().astype(np.float64), want.numpy()
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), (algo, np.abs(a - b).max(), np.abs(b).max())
