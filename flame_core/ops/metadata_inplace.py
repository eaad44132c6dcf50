"""The in-place forms of the view ops, which change a tensor's shape and strides, not its values: squeeze_,
unsqueeze_, t_, transpose_, swapaxes_ / swapdims_, as_strided_ (strided.py); and resize_ / resize_as_. As in
PyTorch, a leaf that requires grad refuses them (resize_ refuses any tensor that requires grad); on a tensor with
history the new geometry's view op is recorded, so backward sees the tensor as the view it now is."""
import numpy as np

from ..autograd.grad_mode import state
from ..errors import AutogradError, ShapeError
from . import shape as S


def adopt(self, out):
    """self takes out's array and history (out is a view op's result on self)."""
    if state.enabled and self._requires_grad and self._grad_fn is None:
        raise AutogradError(f"a leaf tensor of shape {tuple(self.shape)} that requires grad is being used in an "
                            f"in-place operation (wrap it in flame.no_grad() or use the out-of-place op)")
    self._data = out._data
    if out._grad_fn is not None:
        self._grad_fn, self._out_idx = out._grad_fn, out._out_idx
    return self


def squeeze_(self, dim=None):
    return adopt(self, S.squeeze(self, dim) if dim is not None else S.squeeze(self))


def unsqueeze_(self, dim):
    return adopt(self, S.unsqueeze(self, dim))


def t_(self):
    return adopt(self, S.t(self))


def transpose_(self, dim0, dim1):
    return adopt(self, S.transpose(self, dim0, dim1))


def resize_(self, *sizes):
    """self reshaped to `sizes` over its elements in row-major order: shrinking keeps the first elements, growing
    adds zeros after them (PyTorch leaves those uninitialised). Not for tensors that require grad, as PyTorch."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    sizes = tuple(int(s) for s in sizes)
    if any(s < 0 for s in sizes):
        raise ShapeError(f"resize_: sizes must be non-negative, got {sizes}")
    if self.requires_grad:
        raise AutogradError("resize_: cannot resize a tensor that requires grad")
    a = self._data
    if sizes == a.shape:
        return self
    if not a.flags.c_contiguous:
        raise ShapeError(f"resize_: the tensor (shape {tuple(a.shape)}) is not contiguous; call .contiguous() first")
    n = int(np.prod(sizes, dtype=np.int64))
    if n <= a.size:
        self._data = a.reshape(-1)[:n].reshape(sizes)   # the same storage, as PyTorch's shrink
    elif self._base is not None:
        raise ShapeError(f"resize_: a view (shape {tuple(a.shape)}) cannot grow past its base's storage")
    else:
        out = self._xp().zeros(sizes, dtype=a.dtype)
        out.reshape(-1)[:a.size] = a.reshape(-1)
        self._data = out
    self._version[0] += 1
    return self


def resize_as_(self, other):
    return resize_(self, tuple(other.shape))
