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
