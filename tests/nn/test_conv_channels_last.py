"""conv2d on a channels-last input (memory N, H, W, C): the implicit-GEMM kernels read it in place as their NHWC
operand (no to_nhwc copy) in the forward and the weight gradient, and a channels-last output gradient likewise in
the backward; every other path makes it contiguous first. Results equal the contiguous input's bit for bit on the
GPU kernels (the same operand bytes), and F.conv2d_memory_format says which format a conv reads in place."""
from unittest import mock

import numpy as np
import pytest

import flame_core as flame
import flame_nn
import flame_nn.functional as F


def _run(x, w, gy, **kw):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    y = F.conv2d(x, w, **kw)
    y.backward(gy)
    return [t.float().numpy() for t in (y.detach(), x.grad, w.grad)]


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=1), dict(padding=0)])
def test_cpu_channels_last_input_matches(kw):
    rng = np.random.default_rng(0)
    x = flame.tensor(rng.standard_normal((2, 8, 9, 7)), dtype=flame.float64)
    w = flame.tensor(rng.standard_normal((5, 8, 3, 3)), dtype=flame.float64)
    gy = flame.tensor(rng.standard_normal(tuple(F.conv2d(x, w, **kw).shape)), dtype=flame.float64)
    want = _run(x, w, gy, **kw)
    got = _run(x.contiguous(memory_format=flame.channels_last), w, gy.contiguous(memory_format=flame.channels_last),
               **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_memory_format_query_on_cpu():
    """On the CPU no conv reads NHWC: contiguous_format; the query does not fail on 'same' padding or a 3-D input."""
    x, w = flame.randn(2, 8, 6, 6), flame.randn(4, 8, 3, 3)
    assert F.conv2d_memory_format(x, w, 1, 1) is flame.contiguous_format
    assert F.conv2d_memory_format(x, w, 1, "same") is flame.contiguous_format
    assert F.conv2d_memory_format(flame.randn(8, 6, 6), w) is flame.contiguous_format


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["wgmma", "igemm", "im2col"])
@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=1), dict(padding=1, dilation=2)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("C", [16, 20])
def test_gpu_channels_last_equals_contiguous(dtype, algo, kw, C, monkeypatch):
    """Every CUDA path: a channels-last x and dy give exactly the contiguous ones' y, dx, dw. On the implicit GEMM with
    C and O multiples of 8, no NHWC copy of x or dy is made (to_nhwc is called for neither)."""
    from flame_core.kernels import conv as K
    if algo == "wgmma" and not K.wgmma_available():
        pytest.skip("needs compute capability 9.0")
    monkeypatch.setenv("FLAME_CONV_ALGO", algo)
    dt = getattr(flame, dtype)
    rng = np.random.default_rng(C)
    N, H, W, O = 3, 19, 23, 24
    x = flame.tensor(rng.standard_normal((N, C, H, W)), device="cuda").to(dt)
    w = flame.tensor(rng.standard_normal((O, C, 3, 3)) * 0.2, device="cuda").to(dt)
    gy = flame.tensor(rng.standard_normal(tuple(F.conv2d(x, w, **kw).shape)), device="cuda").to(dt)
    want = _run(x, w, gy, **kw)
    spy = mock.Mock(wraps=K.to_nhwc)
    monkeypatch.setattr(K, "to_nhwc", spy)
    got = _run(x.contiguous(memory_format=flame.channels_last), w, gy.contiguous(memory_format=flame.channels_last),
               **kw)
    for a, b, what in zip(got, want, ("y", "dx", "dw")):
        np.testing.assert_array_equal(a, b, err_msg=what)
    copied = [c.args[1] for c in spy.call_args_list if c.args[0].ndim == 4]  # Rp of every activation's NHWC copy
    # (the dx weights' packing, pack_weight_dx, goes through to_nhwc too: a 3-D array)
    if algo != "im2col" and C % 8 == 0:
        assert C not in copied and O not in copied, copied
    elif algo != "im2col":
        assert K.round8(C) in copied  # 20 channels: the kernels need a padded copy


@pytest.mark.gpu
def test_gpu_memory_format_query(monkeypatch):
    monkeypatch.setenv("FLAME_CONV_ALGO", "igemm")
    x = flame.randn(2, 32, 16, 16, device="cuda", dtype=flame.bfloat16)
    w = flame.randn(32, 32, 3, 3, device="cuda", dtype=flame.bfloat16)
    assert F.conv2d_memory_format(x, w, 1, 1) is flame.channels_last
    assert F.conv2d_memory_format(x[:, :20], w[:, :20], 1, 1) is flame.contiguous_format  # 20 channels: padded copy
    assert F.conv2d_memory_format(x.float(), w.float(), 1, 1) is flame.contiguous_format  # fp32: im2col
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=igemm,dx=igemm,dw=im2col")
    assert F.conv2d_memory_format(x, w.requires_grad_(True), 1, 1) is flame.contiguous_format  # dw reads NCHW
    with flame.no_grad():
        assert F.conv2d_memory_format(x, w, 1, 1) is flame.channels_last


@pytest.mark.gpu
def test_gpu_resblock_norm_writes_channels_last(monkeypatch):
    """The SDXL ResBlock's GroupNorm+SiLU writes channels-last for its convs (F.conv2d_memory_format), so neither
    3x3 conv copies its input to NHWC, and the block's output matches the contiguous run's."""
    from flame_core.kernels import conv as K
    from flame_models.sdxl.resblocks import ResBlock
    monkeypatch.setenv("FLAME_CONV_ALGO", "igemm")
    flame.manual_seed(0)
    blk = ResBlock(64, 32, 64, dtype=flame.bfloat16, device="cuda")
    x = flame.randn(2, 64, 16, 16, device="cuda", dtype=flame.bfloat16)
    emb = flame.randn(2, 32, device="cuda", dtype=flame.bfloat16)
    spy = mock.Mock(wraps=K.to_nhwc)
    monkeypatch.setattr(K, "to_nhwc", spy)
    with flame.no_grad():
        y = blk(x, emb)
    assert spy.call_count == 0
    monkeypatch.setattr(flame_nn.functional, "conv2d_memory_format", lambda *a, **k: flame.contiguous_format)
    with flame.no_grad():
        y0 = blk(x, emb)
    assert spy.call_count == 2
    a, b = y.float().numpy(), y0.float().numpy()
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
