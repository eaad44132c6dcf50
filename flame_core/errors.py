"""Exception types. Each subclasses the built-in a PyTorch user would catch, and names what was involved."""


class FlameError(Exception):
    """Base of every FLAME error."""


class ShapeError(FlameError, ValueError):
    """Shapes that do not fit together (the message names them)."""


class DTypeError(FlameError, TypeError):
    """A dtype that an op does not accept or cannot combine."""


class DeviceError(FlameError, RuntimeError):
    """Tensors on different devices in one op, or a device that is not available."""


class AutogradError(FlameError, RuntimeError):
    """Misuse of autograd: backward through a freed graph, a saved tensor modified in place, ..."""


class NonFiniteError(FlameError, RuntimeError):
    """A value that must be finite is inf or NaN (a gradient norm asked to be checked, ...)."""


class OutOfMemoryError(FlameError, RuntimeError):
    """An allocation would exceed the memory limit or the device's memory."""


class SafetensorsError(FlameError, ValueError):
    """A file that is not valid safetensors, or a request it cannot satisfy (the message names the file and key)."""


class KernelCompileError(FlameError, RuntimeError):
    """A cuda_src kernel failed to compile; the message names the file and line."""


def fmt_shape(shape):
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
