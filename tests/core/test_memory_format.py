"""Memory formats (flame.contiguous_format / channels_last / preserve_format), as torch's: contiguous(), is_contiguous()
and clone() with memory_format; values and gradients never change, only the strides."""
import numpy as np
import pytest

import flame_core as flame


def _cl_strides(shape):
    N, C, H, W = shape
    return (H * W * C, 1, W * C, C)


def test_contiguous_channels_last(device, rng):
    a = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    x = flame.tensor(a, device=device)
    y = x.contiguous(memory_format=flame.channels_last)
    assert y.shape == x.shape and y.stride() == _cl_strides(x.shape)
    assert y.is_contiguous(memory_format=flame.channels_last) and not y.is_contiguous()
    np.testing.assert_array_equal(y.numpy(), a)
    assert y.contiguous(memory_format=flame.channels_last) is y  # already so: no copy
    z = y.contiguous()
    assert z.is_contiguous() and z.stride() == (60, 20, 5, 1)
    np.testing.assert_array_equal(z.numpy(), a)
    assert x.contiguous() is x


def test_clone_memory_format(device, rng):
    x = flame.tensor(rng.standard_normal((2, 3, 4, 5)).astype(np.float32), device=device)
    cl = x.contiguous(memory_format=flame.channels_last)
    assert cl.clone().stride() == _cl_strides(x.shape)  # preserve_format keeps channels-last
    assert flame.clone(cl, memory_format=flame.contiguous_format).is_contiguous()
    c2 = x.clone(memory_format=flame.channels_last)
    assert c2.is_contiguous(memory_format=flame.channels_last)
    assert x.clone().is_contiguous()
    t = x.permute(0, 2, 1, 3)  # neither format: preserve gives a contiguous copy
    assert t.clone().is_contiguous()
    for c in (cl.clone(), c2, t.clone()):
        assert c._data is not x._data
    np.testing.assert_array_equal(c2.numpy(), x.numpy())
    np.testing.assert_array_equal(t.clone().numpy(), t.numpy())


def test_gradient_passes_through(device, rng):
    x = flame.tensor(rng.standard_normal((2, 3, 4, 5)).astype(np.float32), device=device, requires_grad=True)
    w = flame.tensor(rng.standard_normal((2, 3, 4, 5)).astype(np.float32), device=device)
    ((x.contiguous(memory_format=flame.channels_last) * w).sum() + (x.clone(memory_format=flame.channels_last)
                                                                    * w).sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * w.numpy(), rtol=1e-6)
    assert "Clone" in x.clone().grad_fn.name() and "Contiguous" in x.permute(0, 2, 1, 3).contiguous().grad_fn.name()


def test_channels_last_and_contiguous_at_once():
    """A size-1 channel dim makes a tensor both; preserve_format then keeps it C-contiguous."""
    x = flame.zeros(2, 1, 3, 3)
    assert x.is_contiguous() and x.is_contiguous(memory_format=flame.channels_last)
    assert x.clone().is_contiguous()


def test_errors():
    x = flame.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"channels_last is a format of 4-D tensors.*\(2, 3, 4\)"):
        x.contiguous(memory_format=flame.channels_last)
    with pytest.raises(ValueError, match="channels_last is a format of 4-D"):
        x.is_contiguous(memory_format=flame.channels_last)
    with pytest.raises(TypeError, match="contiguous: memory_format must be"):
        x.contiguous(memory_format="channels_last")
    with pytest.raises(ValueError, match="preserve_format is not supported"):
        x.contiguous(memory_format=flame.preserve_format)
    assert repr(flame.channels_last) == "flame.channels_last"
