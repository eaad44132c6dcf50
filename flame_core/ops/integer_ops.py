"""PyTorch's integer elementwise ops: gcd, lcm and the bit shifts (bitwise_left_shift / bitwise_right_shift, the
<< and >> operators). Integer (and, for the shifts, bool-free integer) operands only; the result has their promoted
dtype. Not differentiable (integer results)."""
from .. import backend
from ..errors import DTypeError
from ..tensor import Tensor, _wrap
from .promotion import _operands


def _integer_op(op, a, b, ufunc):
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise TypeError(f"{op}: one of the operands must be a Tensor")
    xa, xb, dt = _operands(op, a, b)
    if dt.kind not in "iu":
        raise DTypeError(f"{op}: expected integer operands, got {dt.name if dt.kind != 'b' else 'bool'}")
    xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
    return _wrap(xp.asarray(getattr(xp, ufunc)(xa, xb)).astype(dt, copy=False))


def gcd(input, other):
    """The greatest common divisor, elementwise (gcd(0, 0) = 0; non-negative)."""
    return _integer_op("gcd", input, other, "gcd")


def lcm(input, other):
    """The least common multiple, elementwise (0 where either is 0; non-negative)."""
    return _integer_op("lcm", input, other, "lcm")


def bitwise_left_shift(input, other):
    """input << other, elementwise."""
    return _integer_op("bitwise_left_shift", input, other, "left_shift")


def bitwise_right_shift(input, other):
    """input >> other, elementwise (arithmetic for signed types)."""
    return _integer_op("bitwise_right_shift", input, other, "right_shift")
