"""PyTorch's padding modules over F.pad: ZeroPad1d/2d/3d, ConstantPad1d/2d/3d, ReflectionPad1d/2d/3d,
ReplicationPad1d/2d/3d, CircularPad1d/2d/3d. `padding` is an int (every side) or 2 * N ints (left, right, top,
bottom, front, back: from the last dimension), N the padded dimensions; the input has N + 1 (unbatched) or N + 2."""
from flame_core.errors import ShapeError

from .. import functional as F
from ..module import Module


class _PadNd(Module):
    dims = 0
    mode = "constant"

    def __init__(self, padding, value=0.0):
        super().__init__()
        n = 2 * self.dims
        if isinstance(padding, int):
            padding = (padding,) * n
        padding = tuple(int(p) for p in padding)
        if len(padding) != n:
            raise ValueError(f"{type(self).__name__}: padding must be an int or {n} ints, got {padding}")
        self.padding, self.value = padding, float(value)

    def forward(self, input):
        if input.ndim not in (self.dims + 1, self.dims + 2):
            raise ShapeError(f"{type(self).__name__}: expected a {self.dims + 1}-D (unbatched) or "
                             f"{self.dims + 2}-D input, got shape {tuple(input.shape)}")
        return F.pad(input, self.padding, self.mode, self.value)

    def extra_repr(self):
        return f"{self.padding}"


class ConstantPad1d(_PadNd):
    dims = 1

    def __init__(self, padding, value):
        super().__init__(padding, value)

    def extra_repr(self):
        return f"padding={self.padding}, value={self.value}"


class ConstantPad2d(ConstantPad1d):
    dims = 2


class ConstantPad3d(ConstantPad1d):
    dims = 3


class ZeroPad1d(_PadNd):
    dims = 1

    def __init__(self, padding):
        super().__init__(padding, 0.0)


class ZeroPad2d(ZeroPad1d):
    dims = 2


class ZeroPad3d(ZeroPad1d):
    dims = 3


class ReflectionPad1d(ZeroPad1d):
    mode = "reflect"


class ReflectionPad2d(ReflectionPad1d):
    dims = 2


class ReflectionPad3d(ReflectionPad1d):
    dims = 3


class ReplicationPad1d(ZeroPad1d):
    mode = "replicate"


class ReplicationPad2d(ReplicationPad1d):
    dims = 2


class ReplicationPad3d(ReplicationPad1d):
    dims = 3


class CircularPad1d(ZeroPad1d):
    mode = "circular"


class CircularPad2d(CircularPad1d):
    dims = 2


class CircularPad3d(CircularPad1d):
    dims = 3
