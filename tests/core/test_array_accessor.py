"""The core's public surface for code below the autograd: Tensor.array / set_array_, as_tensor over an array,
mm_arrays and CheckpointFunction (what flame_nn's optimizers, offload and fp8 layers build on)."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import backend
from flame_core.checkpoint import CheckpointFunction, checkpoint
from flame_core.ops.linalg import mm_arrays


def test_array_is_the_storage_itself(device):
    t = flame.arange(6, dtype=flame.float32, device=device).reshape(2, 3)
    a = t.array
    assert a is t.array and type(a) is type(backend.xp_for(t.device).empty(0))
    assert a.shape == (2, 3) and a.dtype == np.float32
    a[0, 0] = 42.0  # written in place: the tensor sees it, no copy in between
    assert t[0, 0].item() == 42.0
    view = t[1]
    assert backend.to_numpy(view.array).tolist() == [3.0, 4.0, 5.0]


def test_array_of_a_grad_leaf_has_no_autograd_and_data_stays_torchs(device):
    w = flame.ones(3, device=device, requires_grad=True)
    assert not hasattr(w.array, "requires_grad")
    d = w.data  # PyTorch's .data: a detached tensor over the same storage, not an array
    assert isinstance(d, flame.Tensor) and not d.requires_grad and d.array is w.array


def test_as_tensor_over_an_array_shares_it_both_ways(device):
    xp = backend.xp_for(flame.device(device))
    for dt in (np.float32, np.float16, flame.bfloat16.np, np.uint8, np.int64):
        with flame.device(device).context():
            a = xp.zeros((2, 3), dtype=dt)
        t = flame.as_tensor(a)
        assert t.array is a and t.dtype.np == np.dtype(dt) and str(t.device) == str(flame.device(device))
        assert not t.requires_grad and t.is_leaf


def test_as_tensor_still_converts_when_asked(device):
    a = np.arange(4, dtype=np.float32)
    t = flame.as_tensor(a, dtype=flame.float16, device=device)
    assert t.dtype is flame.float16 and t.array is not a
    assert flame.as_tensor(a, dtype=flame.float32).array is a  # already that dtype: shared
    assert flame.as_tensor([1.0, 2.0]).dtype is flame.float32  # not an array: a new one


def test_set_array_swaps_the_storage_keeping_identity_grad_and_version(device):
    p = flame.ones(3, device=device, requires_grad=True)
    (p * 2).sum().backward()
    version = p._version[0]
    new = flame.full((3,), 5.0, device=device).array
    assert p.set_array_(new) is p
    assert p.array is new and p.requires_grad and p.is_leaf
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    assert p._version[0] == version  # as assigning torch's .data: not an in-place op
    assert p.tolist() == [5.0, 5.0, 5.0]


def test_set_array_marks_float8_bytes_and_keeps_the_marking_by_default():
    t = flame.zeros(4)
    t.set_array_(np.zeros(4, dtype=np.uint8), f8=True)
    assert t.dtype is flame.float8_e4m3fn
    t.set_array_(np.ones(4, dtype=np.uint8))  # f8=None: the same kind of storage
    assert t.dtype is flame.float8_e4m3fn
    t.set_array_(np.ones(4, dtype=np.float32), f8=False)
    assert t.dtype is flame.float32


def test_set_array_refuses_float8_bytes_that_are_not_bytes():
    t = flame.zeros(4)
    with pytest.raises(flame.DTypeError, match="uint8.*float32"):
        t.set_array_(np.zeros(4, dtype=np.float32), f8=True)
    assert t.dtype is flame.float32


def test_parameter_shares_the_tensors_array(device):
    t = flame.randn(2, 2, device=device)
    p = flame_nn.Parameter(t)
    assert p.array is t.array and p.requires_grad


@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_mm_arrays_is_matmul_on_arrays(dt, rng):
    a, b = rng.standard_normal((5, 7)).astype(dt), rng.standard_normal((7, 3)).astype(dt)
    out = mm_arrays(a, b)
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(dt)
    assert out.dtype == np.dtype(dt) and out.shape == (5, 3)
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


class _Counting(CheckpointFunction):
    calls = []

    @staticmethod
    def backward(ctx, *grads):
        _Counting.calls.append("before")
        out = CheckpointFunction.backward(ctx, *grads)
        _Counting.calls.append("after")
        return out


def test_a_checkpoint_function_subclass_wraps_the_regions_backward(device):
    lin = flame_nn.Linear(4, 4).to(device)
    x = flame.randn(2, 4, device=device)  # no input requires grad: the frozen-base LoRA case
    _Counting.calls.clear()
    y = _Counting.run(lin, (x,), {}, preserve_rng_state=True, offload=False)
    assert y.grad_fn.name() == "_CountingBackward"
    y.sum().backward()
    assert _Counting.calls == ["before", "after"]
    got = [p.grad.numpy().copy() for p in lin.parameters()]
    lin.zero_grad()
    lin(x).sum().backward()
    for g, p in zip(got, lin.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_checkpoint_records_the_public_node(device):
    x = flame.randn(3, device=device, requires_grad=True)
    assert checkpoint(flame.sin, x).grad_fn.name() == "CheckpointFunctionBackward"
