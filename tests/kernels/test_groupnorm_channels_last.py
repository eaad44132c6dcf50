"""group_norm / group_norm_silu writing a channels-last output (memory_format=flame.channels_last): the split path's
statistics with the apply pass fused into an NCHW -> NHWC transpose (cuda_src/groupnorm.cu: gn_apply_cl). Values and
gradients equal the contiguous output's; the layout is N, H, W, C."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, rand

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import groupnorm as K


def test_reference_path_channels_last(rng):
    """The NumPy path: the same values as the contiguous output, laid out N, H, W, C."""
    x = rng.standard_normal((3, 12, 5, 7)) * 2 + 1
    w, b = rng.standard_normal(12), rng.standard_normal(12)
    for act in (None, "silu"):
        y, mean, rstd = K.group_norm_forward(x, 4, w, b, 1e-5, act=act, channels_last=True)
        y0, mean0, rstd0 = K.group_norm_forward(x, 4, w, b, 1e-5, act=act)
        assert y.transpose(0, 2, 3, 1).flags.c_contiguous and not y.flags.c_contiguous
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(mean, mean0)
        np.testing.assert_array_equal(rstd, rstd0)


def test_op_memory_format(device, rng):
    x = flame.tensor(rng.standard_normal((2, 8, 5, 3)), dtype=flame.float32, device=device)
    for fn in (F.group_norm, F.group_norm_silu):
        y = fn(x, 4, memory_format=flame.channels_last)
        assert y.is_contiguous(memory_format=flame.channels_last) and not y.is_contiguous()
        np.testing.assert_allclose(y.numpy(), fn(x, 4).numpy(), rtol=1e-6, atol=1e-6)
        assert fn(x, 4, memory_format=flame.contiguous_format).is_contiguous()
        # preserve_format (the default): a channels-last input gives a channels-last output
        xc = x.contiguous(memory_format=flame.channels_last)
        assert fn(xc, 4).is_contiguous(memory_format=flame.channels_last)
        assert fn(xc, 4, memory_format=flame.contiguous_format).is_contiguous()


def test_op_errors():
    x3 = flame.zeros(2, 4, 6)
    with pytest.raises(ShapeError, match=r"group_norm_silu: memory_format=flame.channels_last needs a 4-D"):
        F.group_norm_silu(x3, 2, memory_format=flame.channels_last)
    with pytest.raises(TypeError, match="group_norm: memory_format must be"):
        F.group_norm(x3, 2, memory_format="channels_last")
    with pytest.raises(ShapeError, match="channels-last output needs a 4-D"):
        K.group_norm_forward(np.zeros((2, 4, 6), np.float32), 2, channels_last=True)


@settings(deadline=None, max_examples=20)
@given(n=st.integers(1, 3), g=st.integers(1, 3), cpg=st.integers(1, 3), hw=st.sampled_from([(1, 2), (2, 3), (3, 3)]),
       act=st.sampled_from([None, "silu"]), seed=st.integers(0, 2 ** 16))
def test_gradcheck_channels_last(n, g, cpg, hw, act, seed):
    rng = np.random.default_rng(seed)
    c = g * cpg
    assume(cpg * hw[0] * hw[1] >= 2)
    x = flame.tensor(rng.standard_normal((n, c) + hw) * 2 + 1, dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True)
    b = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True)
    fn = F.group_norm_silu if act else F.group_norm
    assert gradcheck(lambda a, ww, bb: fn(a, g, ww, bb, eps=1e-5, memory_format=flame.channels_last), (x, w, b))


# ragged: channels not a multiple of the 64-channel tile, spatial sizes not of the 64-pixel tile, batch 1 and 3
SHAPES = [((1, 7, 5, 3), 1), ((3, 28, 9, 11), 4), ((1, 96, 13, 7), 32), ((3, 160, 31, 29), 32), ((2, 320, 16, 16), 32),
          ((1, 12, 97, 95), 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("path", ["cluster", "split"])
def test_channels_last_kernel(ab, rng, monkeypatch, dt, shape, g, act, path):
    """The statistics by the cluster kernels (sm_90+; y not written) or the split path, then gn_apply_cl (16-byte
    accesses where hw and C are multiples of 8 in a 2-byte dtype, else one element per access)."""
    import cupy as cp
    monkeypatch.setattr(K, "use_cluster", path == "cluster")
    d = DTYPES[dt]
    x = rand(rng, shape, d, loc=1.5, scale=2.0)
    w = cp.asarray(rand(rng, shape[1:2], np.float32, loc=1.0))
    b = cp.asarray(rand(rng, shape[1:2], np.float32, scale=2.0))
    (yk, mk, rk), (yr, mr, rr) = ab(lambda a: K.group_norm_forward(a, g, w, b, 1e-5, act=act, channels_last=True), x)
    assert yk.dtype == d and yk.shape == shape
    assert yk.transpose(0, 2, 3, 1).flags.c_contiguous
    assert_close(yk, yr, dt, "y", scale=2)
    assert_close(mk, mr, "float32", "mean", scale=10)
    assert_close(rk, rr, "float32", "rstd", scale=10)
    y0, _, _ = K.group_norm_forward(cp.asarray(x), g, w, b, 1e-5, act=act)  # the contiguous output (any path)
    assert_close(yk, y0, dt, "y vs contiguous", scale=2)


@pytest.mark.gpu
def test_channels_last_gradients_equal_contiguous(rng):
    """Through autograd on the GPU (bf16): output and gradients of the channels-last output equal the contiguous one's
    (the backward is the same kernel; only the forward's write differs)."""
    shape = (2, 64, 24, 20)
    x = flame.tensor(rand(rng, shape, np.float32, loc=1.0), dtype=flame.bfloat16, device="cuda", requires_grad=True)
    w = flame.tensor(rand(rng, (64,), np.float32, loc=1.0), device="cuda", requires_grad=True)
    b = flame.tensor(rand(rng, (64,), np.float32), device="cuda", requires_grad=True)
    gy = flame.tensor(rand(rng, shape, np.float32), dtype=flame.bfloat16, device="cuda")
    out = []
    for fmt in (flame.channels_last, flame.contiguous_format):
        y = F.group_norm_silu(x, 16, w, b, memory_format=fmt)
        (y.float() * gy.float()).sum().backward()
        out.append([y.detach().float().numpy()] + [t.grad.float().numpy() for t in (x, w, b)])
        for t in (x, w, b):
            t.grad = None
    for got, want, what in zip(out[0], out[1], ("y", "dx", "dw", "db")):
        assert_close(got, want, "bfloat16", what, scale=2)
