"""User mistakes raise FLAME exceptions (subclassing the built-in a PyTorch user catches) naming what was involved."""
import pytest

import flame_core as flame
from flame_core import errors


def test_hierarchy():
    assert issubclass(errors.ShapeError, ValueError) and issubclass(errors.DTypeError, TypeError)
    assert issubclass(errors.DeviceError, RuntimeError) and issubclass(errors.OutOfMemoryError, RuntimeError)
    for e in (errors.ShapeError, errors.DTypeError, errors.DeviceError, errors.AutogradError):
        assert issubclass(e, errors.FlameError)


def test_messages_name_shapes_dtypes(device):
    a = flame.zeros(2, 3, device=device)
    with pytest.raises(errors.ShapeError, match=r"\(2, 3\).*\(2, 3\)"):
        a @ a
    with pytest.raises(errors.ShapeError, match=r"\(4, 4\)"):
        flame.cat([a, flame.zeros(4, 4, device=device)])
    with pytest.raises(errors.DTypeError, match="unknown dtype name 'float17'"):
        flame.zeros(2, dtype="float17")
    with pytest.raises(errors.DTypeError, match="int64"):
        flame.randn(2, dtype=flame.int64, device=device)
    with pytest.raises(errors.AutogradError, match="float"):
        flame.tensor([1, 2], device=device).requires_grad_()
    with pytest.raises(IndexError, match="out of range"):
        a.sum(dim=5)
    with pytest.raises(errors.DeviceError, match="cuda:x"):
        flame.device("cuda:x")


@pytest.mark.skipif(not flame.cuda.is_available(), reason="mixing devices needs a GPU")
def test_linear_ops_name_both_devices():
    from flame_core.ops.linear import linear, linear_low_rank
    x = flame.randn(3, 4, device="cuda")
    w, b = flame.randn(5, 4, device="cpu"), flame.randn(5, device="cpu")
    with pytest.raises(errors.DeviceError, match="linear: .*cuda:0 and cpu"):
        linear(x, w, b)
    a_, b_ = flame.randn(2, 4, device="cuda"), flame.randn(5, 2, device="cuda")
    with pytest.raises(errors.DeviceError, match="linear_low_rank: .*cuda:0 and cpu"):
        linear_low_rank(x, w, b, [(a_, b_, 0, 5, 1.0)])
