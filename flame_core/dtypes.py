"""dtypes: thin named wrappers over NumPy dtypes (bfloat16 and float8 come from ml_dtypes), with PyTorch promotion."""
import builtins

import ml_dtypes
import numpy as np

from .errors import DTypeError


class DType:
    __slots__ = ("name", "np", "is_floating_point", "is_complex", "itemsize", "_kind")

    def __init__(self, name, np_dtype, kind):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.is_floating_point = kind == 2
        self.is_complex = False
        self.itemsize = self.np.itemsize
        self._kind = kind  # 0 bool, 1 integer, 2 floating

    def __repr__(self):
        return f"flame.{self.name}"

    def __reduce__(self):
        return (dtype, (self.name,))

    def to_numpy(self):
        return self.np


bool_ = DType("bool", np.bool_, 0)
uint8 = DType("uint8", np.uint8, 1)
int8 = DType("int8", np.int8, 1)
int16 = DType("int16", np.int16, 1)
int32 = DType("int32", np.int32, 1)
int64 = DType("int64", np.int64, 1)
float16 = DType("float16", np.float16, 2)
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, 2)
float32 = DType("float32", np.float32, 2)
float64 = DType("float64", np.float64, 2)
float8_e4m3fn = DType("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 2)

half, float, double, long, int = float16, float32, float64, int64, int32  # PyTorch aliases
ALL = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, float8_e4m3fn)
_BY_NP = {d.np: d for d in ALL}
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"half": float16, "float": float32, "double": float64, "long": int64, "int": int32, "bf16": bfloat16,
                 "fp16": float16, "fp32": float32})


def dtype_of(np_dtype):
    """The FLAME dtype of a NumPy/CuPy array dtype."""
    d = _BY_NP.get(np_dtype)
    if d is None:
        d = _BY_NP.get(np.dtype(np_dtype))
        if d is None:
            raise DTypeError(f"unsupported array dtype {np_dtype}")
    return d


def dtype(x):
    """Parse a dtype given as DType, name, NumPy dtype or Python type."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        if x in _BY_NAME:
            return _BY_NAME[x]
        raise DTypeError(f"unknown dtype name {x!r}; known: {sorted(_BY_NAME)}")
    if x is builtins.float:
        return get_default_dtype()
    if x is builtins.int:
        return int64
    if x is builtins.bool:
        return bool_
    try:
        return dtype_of(np.dtype(x))
    except TypeError as e:
        raise DTypeError(f"cannot interpret {x!r} as a dtype") from e


_default_float = float32


def get_default_dtype():
    return _default_float


def set_default_dtype(d):
    global _default_float
    d = dtype(d)
    if not d.is_floating_point:
        raise DTypeError(f"default dtype must be floating point, got {d}")
    _default_float = d


# PyTorch's promotion among floating types: f16 & bf16 -> f32; otherwise the wider one.
_FLOAT_RANK = {float8_e4m3fn: 0, float16: 1, bfloat16: 1, float32: 2, float64: 3}


def promote_types(a, b):
    if a is b:
        return a
    if a._kind != b._kind:
        return a if a._kind > b._kind else b
    if a._kind == 2:
        ra, rb = _FLOAT_RANK[a], _FLOAT_RANK[b]
        if ra == rb:  # float16 with bfloat16
            return float32
        return a if ra > rb else b
    if a._kind == 1:
        return dtype_of(np.promote_types(a.np, b.np))
    return a


def result_type(*operands):
    """PyTorch's result type: tensors with dims beat 0-dim tensors beat Python scalars, within a category."""
    from .tensor import Tensor

    dim_t = zero_t = None
    scalar_kind = -1
    for x in operands:
        if isinstance(x, Tensor):
            d = x.dtype
            if x.ndim:
                dim_t = d if dim_t is None else promote_types(dim_t, d)
            else:
                zero_t = d if zero_t is None else promote_types(zero_t, d)
        elif isinstance(x, (bool, np.bool_)):
            scalar_kind = max(scalar_kind, 0)
        elif isinstance(x, (builtins.int, np.integer)):
            scalar_kind = max(scalar_kind, 1)
        elif isinstance(x, (builtins.float, np.floating)):
            scalar_kind = max(scalar_kind, 2)
        elif x is None:
            continue
        else:
            raise DTypeError(f"unsupported operand of type {type(x).__name__}")
    res = dim_t
    if zero_t is not None:
        if res is None:
            res = zero_t
        elif zero_t._kind > res._kind:
            res = zero_t
    if scalar_kind >= 0:
        if res is None:
            res = {0: bool_, 1: int64, 2: get_default_dtype()}[scalar_kind]
        elif scalar_kind > res._kind:
            res = int64 if scalar_kind == 1 else get_default_dtype()
    return res


class FloatCasts:
    """float(), double(), half() and bfloat16(): `self.to(dtype)`, the casts Tensor (a converted tensor) and
    flame_nn.Module (its floating parameters and buffers, converted in place) share."""

    def float(self):
        return self.to(float32)

    def double(self):
        return self.to(float64)

    def half(self):
        return self.to(float16)

    def bfloat16(self):
        return self.to(bfloat16)
