"""Questions about tensors with PyTorch's names: is_tensor, numel, and Tensor.type (the legacy type string, or a
conversion given a type string or dtype)."""
from .. import dtypes as D
from ..device import CPU
from ..device import device as _device
from ..errors import DTypeError
from ..tensor import Tensor

# torch's legacy tensor type names; float8 has none there either: torch says Float8_e4m3fnTensor
_TYPE_NAMES = {D.float32: "FloatTensor", D.float64: "DoubleTensor", D.float16: "HalfTensor",
               D.bfloat16: "BFloat16Tensor", D.int64: "LongTensor", D.int32: "IntTensor", D.int16: "ShortTensor",
               D.int8: "CharTensor", D.uint8: "ByteTensor", D.bool_: "BoolTensor",
               D.float8_e4m3fn: "Float8_e4m3fnTensor"}
_BY_TYPE_NAME = {v: k for k, v in _TYPE_NAMES.items()}


def is_tensor(obj):
    """True for a flame Tensor (as torch.is_tensor: an isinstance check)."""
    return isinstance(obj, Tensor)


def is_floating_point(input):
    """Whether a Tensor's dtype is a floating point one (torch.is_floating_point)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"is_floating_point: expected a Tensor, got {type(input).__name__}")
    return input.dtype.is_floating_point


def numel(input):
    """The number of elements of a Tensor."""
    if not isinstance(input, Tensor):
        raise TypeError(f"numel: expected a Tensor, got {type(input).__name__}")
    return input.numel()


def _parse_type_name(name):
    """'flame.FloatTensor' / 'torch.cuda.HalfTensor' / 'FloatTensor' -> (is_cuda, dtype)."""
    parts = name.split(".")
    if parts and parts[0] in ("flame", "torch"):
        parts = parts[1:]
    cuda = len(parts) == 2 and parts[0] == "cuda"
    if (len(parts) == 2 and not cuda) or len(parts) not in (1, 2) or parts[-1] not in _BY_TYPE_NAME:
        raise DTypeError(f"invalid type: {name!r} (expected e.g. 'flame.FloatTensor' or 'flame.cuda.HalfTensor'; "
                         f"known: {sorted(_BY_TYPE_NAME)})")
    return cuda, _BY_TYPE_NAME[parts[-1]]


def tensor_type(self, dtype=None):
    """Tensor.type(): 'flame.FloatTensor' ('flame.cuda.FloatTensor' on a GPU). Tensor.type(t) with a type string
    ('torch.' is accepted for 'flame.'; a 'cuda.' part moves to the GPU and its absence to the cpu, as PyTorch) or
    a dtype converts; the tensor itself is returned when it already has that type."""
    if dtype is None:
        return ("flame.cuda." if self.is_cuda else "flame.") + _TYPE_NAMES[self.dtype]
    if isinstance(dtype, str) and dtype.endswith("Tensor"):
        cuda, dt = _parse_type_name(dtype)
        dev = _device("cuda") if cuda else CPU
        if cuda and self.is_cuda:
            dev = None  # stays on its GPU
        return self.to(dt) if dev is None else self.to(dev, dt)
    return self.to(D.dtype(dtype))
