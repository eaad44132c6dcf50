"""cat / stack of more than 8 tensors: joined piece by piece (CuPy's one-call join of more arrays reads a host
table, which a CUDA graph capture refuses), with the same values and gradients as a plain concatenation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
from flame_core import DeviceError
from flame_core.ops.shape import _CAT_DIRECT


@settings(max_examples=20, deadline=None)
@given(n=st.integers(_CAT_DIRECT - 1, _CAT_DIRECT + 5), dim=st.sampled_from([0, 1, -1]), seed=st.integers(0, 99))
def test_cat_of_many_equals_numpy_and_splits_its_gradient(n, dim, seed):
    rng = np.random.default_rng(seed)
    shapes = [[2, 3, 4] for _ in range(n)]
    for s in shapes:
        s[dim] = int(rng.integers(1, 4))
    arrs = [rng.standard_normal(s) for s in shapes]
    xs = [flame.tensor(a, dtype=flame.float64, requires_grad=True) for a in arrs]
    y = flame.cat(xs, dim=dim)
    want = np.concatenate(arrs, axis=dim)
    np.testing.assert_array_equal(y.detach().numpy(), want)
    g = rng.standard_normal(want.shape)
    (y * flame.tensor(g, dtype=flame.float64)).sum().backward()
    pieces = np.split(g, np.cumsum([a.shape[dim] for a in arrs])[:-1], axis=dim)
    for x, p in zip(xs, pieces):
        np.testing.assert_array_equal(x.grad.numpy(), p)


def test_stack_of_many_bf16():
    xs = [flame.full((3,), float(i), dtype=flame.bfloat16) for i in range(12)]
    y = flame.stack(xs, dim=-1)
    assert y.dtype == flame.bfloat16 and tuple(y.shape) == (3, 12)
    np.testing.assert_array_equal(y.float().numpy(), np.tile(np.arange(12, dtype=np.float32), (3, 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["cat", "stack"])
def test_cat_and_stack_refuse_mixed_devices_naming_both(op):
    a = flame.ones(2, 3, device="cpu")
    b = flame.ones(2, 3, device="cuda")
    with pytest.raises(DeviceError, match=f"{op}: expected all tensors on the same device.*cpu.*cuda"):
        getattr(flame, op)([a, b])
    with pytest.raises(DeviceError, match="cuda.*cpu"):
        getattr(flame, op)([b, b, a])
    assert getattr(flame, op)([b, b]).device.type == "cuda"


@pytest.mark.parametrize("op", ["cat", "stack"])
def test_cat_and_stack_take_arrays_of_one_device_in_two_array_types(op):
    """A NumPy subclass (a memmap, say) beside a plain array: two array types, one device -- joined."""
    a = np.arange(6.0).reshape(2, 3)
    sub = a.view(np.memmap)
    x, y = flame.tensor(a, device="cpu"), flame.tensor(a, device="cpu")
    y._data = sub   # (tensor() would copy it into a plain array)
    got = getattr(flame, op)([x, y])
    want = np.concatenate([a, a]) if op == "cat" else np.stack([a, a])
    np.testing.assert_array_equal(got.numpy(), want)
