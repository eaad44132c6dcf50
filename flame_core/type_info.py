"""finfo / iinfo: the numerical limits of a dtype under PyTorch's attribute names (bits, eps, max, min, tiny,
smallest_normal, resolution, dtype), read from NumPy / ml_dtypes (bfloat16, float8_e4m3fn).

    flame.finfo(flame.bfloat16).min     # as torch.finfo(torch.bfloat16).min: the most negative finite value
    flame.finfo()                       # the default float dtype's
"""
import math

import ml_dtypes
import numpy as np

from . import dtypes as D
from .errors import DTypeError


class finfo:  # noqa: N801  (PyTorch's name)
    __slots__ = ("bits", "eps", "max", "min", "tiny", "smallest_normal", "resolution", "dtype")

    def __init__(self, type=None):  # noqa: A002  (PyTorch's argument name)
        dt = D.get_default_dtype() if type is None else D.dtype(type)
        if not dt.is_floating_point:
            raise DTypeError(f"finfo: {dt} is not a floating point dtype (iinfo takes integer dtypes)")
        fi = ml_dtypes.finfo(dt.np)
        self.bits = int(fi.bits)
        self.eps, self.max, self.min = float(fi.eps), float(fi.max), float(fi.min)
        self.tiny = self.smallest_normal = float(fi.smallest_normal)
        self.resolution = 10.0 ** -math.floor(fi.nmant * math.log10(2))   # PyTorch's: decimal digits of the mantissa
        self.dtype = dt.name

    def __repr__(self):
        return (f"finfo(resolution={self.resolution}, min={self.min:g}, max={self.max:g}, eps={self.eps:g}, "
                f"smallest_normal={self.smallest_normal:g}, tiny={self.tiny:g}, dtype={self.dtype})")


class iinfo:  # noqa: N801
    __slots__ = ("bits", "max", "min", "dtype")

    def __init__(self, type):  # noqa: A002
        dt = D.dtype(type)
        if dt.is_floating_point or dt.np == np.bool_:
            raise DTypeError(f"iinfo: {dt} is not an integer dtype (finfo takes floating point dtypes)")
        ii = np.iinfo(dt.np)
        self.bits, self.max, self.min, self.dtype = int(ii.bits), int(ii.max), int(ii.min), dt.name

    def __repr__(self):
        return f"iinfo(min={self.min}, max={self.max}, dtype={self.dtype})"
