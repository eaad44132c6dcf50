"""Tensor: one NumPy (cpu) or CuPy (cuda) array plus its autograd state. Ops live in flame_core/ops."""
import numpy as np

from . import backend, speedups
from . import dtypes as D
from .device import CPU, device_of_array
from .device import device as _parse_device
from .errors import AutogradError, DeviceError, DTypeError, fmt_shape

_ndarray = np.ndarray
_memory_hook = None  # set by flame_core.memory: called with every array a tensor is born with


class Tensor(D.FloatCasts):
    """A multi-dimensional array on a device with tape-based autograd (PyTorch semantics)."""

    __array_priority__ = 1000  # numpy scalars on the left defer to our reflected operators
    _requires_grad = False
    _grad = None
    _grad_fn = None
    _out_idx = 0
    _accum_ref = None
    _hooks = None
    _post_acc_hooks = None
    _retains_grad = False
    _name = None
    _f8 = False  # cuda float8_e4m3fn: raw bytes in a uint8 array (CuPy has no fp8 dtype)
    _base = None  # a view's base: the tensor whose storage it shares (never itself a view), as torch's ._base
    _graph_gen = 0  # bumped when an in-place op rewrites this tensor's history: its views derive theirs again

    def __init__(self, data=None, *, dtype=None, device=None, requires_grad=False):
        from .ops.creation import _array_from
        arr = _array_from(data if data is not None else [], dtype, device)
        self._data = arr
        self._version = [0]
        if requires_grad:
            self.requires_grad_(True)
        if _memory_hook is not None:
            _memory_hook(arr)

    # ----------------------------------------------------------------- properties
    @property
    def shape(self):
        return Size(self._data.shape)

    @property
    def dtype(self):
        if self._f8:
            return D.float8_e4m3fn
        return D.dtype_of(self._data.dtype)

    @property
    def device(self):
        return device_of_array(self._data)

    @property
    def is_cuda(self):
        return backend.is_cuda_array(self._data)

    @property
    def ndim(self):
        return self._data.ndim

    @property
    def T(self):
        return self.permute(*range(self.ndim - 1, -1, -1))

    @property
    def mT(self):
        return self.transpose(-2, -1)

    @property
    def data(self):
        return self.detach()  # PyTorch's `.data`: a tensor sharing the storage, outside autograd (see `.array`)

    @data.setter
    def data(self, value):
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be a Tensor, got {type(value).__name__}")
        self._data = value._data

    @property
    def array(self):
        """The NumPy (cpu) or CuPy (cuda) array holding this tensor's elements: the storage itself, no copy.

        For code below the autograd (optimizers, kernels, offload): reads and in-place writes through it are not
        recorded and do not bump the version counter, like writes through PyTorch's `.data`. A cuda
        float8_e4m3fn tensor's array is its raw bytes (uint8: CuPy has no fp8 dtype); a cpu one's is an ml_dtypes
        float8 array. `flame_core.as_tensor(array)` is the way back (no copy)."""
        return self._data

    def set_array_(self, array, f8=None):
        """Make `array` (NumPy or CuPy, used as it is: no copy, no check) this tensor's storage, in place: the
        tensor keeps its identity, grad, hooks and version counter (as assigning PyTorch's `.data`). `f8` True
        marks a uint8 CuPy array as float8_e4m3fn bytes, False as its own dtype; None keeps the current marking
        (a storage swapped for one of the same kind). Returns self."""
        if f8 is not None:
            if f8 and array.dtype != np.uint8:
                raise DTypeError(f"set_array_: float8 bytes must be a uint8 array, got {array.dtype}")
            self._f8 = bool(f8)
        self._data = array
        return self

    @property
    def requires_grad(self):
        return self._requires_grad or self._grad_fn is not None

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)

    @property
    def is_leaf(self):
        return self._grad_fn is None

    @property
    def grad_fn(self):
        return self._grad_fn

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"assigned grad must be a Tensor or None, got {type(value).__name__}")
            if value.shape != self.shape:
                raise AutogradError(f"assigned grad has shape {fmt_shape(value.shape)} but the tensor has shape "
                                    f"{fmt_shape(self.shape)}")
        self._grad = value

    @property
    def itemsize(self):
        return self._data.itemsize

    @property
    def nbytes(self):
        return self._data.nbytes

    # ----------------------------------------------------------------- basics
    def size(self, dim=None):
        if dim is None:
            return Size(self._data.shape)
        return self._data.shape[dim]

    def dim(self):
        return self._data.ndim

    def numel(self):
        return int(self._data.size)

    def element_size(self):
        return self._data.itemsize

    def is_floating_point(self):
        return self.dtype.is_floating_point

    def stride(self, dim=None):
        st = tuple(s // self._data.itemsize for s in self._data.strides)
        return st if dim is None else st[dim]

    def data_ptr(self):
        a = self._data
        return a.data.ptr if backend.is_cuda_array(a) else a.ctypes.data

    def _xp(self):
        return backend.xp_of(self._data)

    def _alias(self):
        """A detached tensor sharing data and version counter (not a new view for autograd)."""
        t = _new(Tensor)
        t._data = self._data
        t._version = self._version
        if self._f8:
            t._f8 = True
        return t

    def _detached_owned(self):
        """Detached tensor over this one's data; used by the engine for .grad (the grad owns its storage)."""
        t = _new(Tensor)
        t._data = self._data
        t._version = [0]
        return t

    @staticmethod
    def _from_array_copy(arr):
        """A tensor owning a C-contiguous copy of `arr`."""
        return _wrap(backend.copy_array(arr))

    def detach(self):
        t = self._alias()
        return t

    def detach_(self):
        if self._base is not None:  # a view: its history is its base's (PyTorch refuses the same)
            if self._grad_fn is not None:
                raise AutogradError("can't detach views in-place; use .detach() instead")
        elif self._grad_fn is not None:
            self._grad_fn = None
            self._graph_gen += 1  # views of this tensor lose their history too
        self._requires_grad = False
        return self

    def requires_grad_(self, requires_grad=True):
        if self._grad_fn is not None:
            if not requires_grad:
                raise AutogradError("you can only change requires_grad flags of leaf tensors; use .detach()")
            return self
        if requires_grad and not self.dtype.is_floating_point:
            raise AutogradError(f"only tensors of floating point dtype can require gradients, got {self.dtype}")
        if requires_grad and self.dtype is D.float8_e4m3fn:
            raise AutogradError("float8_e4m3fn tensors are storage only and cannot require gradients; convert with "
                                ".to(dtype) and let the converted tensor require grad")
        self._requires_grad = bool(requires_grad)
        return self

    def retain_grad(self):
        if self._grad_fn is None:
            return self
        if not self._retains_grad:
            import weakref
            ref = weakref.ref(self)

            def _store(g):
                t = ref()
                if t is not None:
                    t._grad = g.detach() if t._grad is None else t._grad + g.detach()
            _store._retains_grad = True
            self._grad_fn.register_hook(_store, self._out_idx)
            self._retains_grad = True
        return self

    @property
    def retains_grad(self):
        return self._retains_grad

    def register_hook(self, hook):
        """Call `hook(grad)` when the gradient of this tensor is computed; a returned tensor replaces it."""
        if not self.requires_grad:
            raise AutogradError("cannot register a hook on a tensor that doesn't require gradient")
        if self._grad_fn is not None:
            self._grad_fn.register_hook(hook, self._out_idx)
        else:
            if self._hooks is None:
                self._hooks = []
            self._hooks.append(hook)
        return _HookHandle(self, hook)

    def register_post_accumulate_grad_hook(self, hook):
        """Call `hook(tensor)` each time a backward pass has accumulated a gradient into this leaf's `.grad` (a
        checkpointed region's recompute accumulates once more for the parameters it uses). As PyTorch's."""
        if self._grad_fn is not None:
            raise AutogradError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if not self._requires_grad:
            raise AutogradError("cannot register a hook on a tensor that doesn't require gradient")
        if self._post_acc_hooks is None:
            self._post_acc_hooks = []
        self._post_acc_hooks.append(hook)
        return _ListHookHandle(self._post_acc_hooks, hook)

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        from .autograd import backward
        if inputs is not None:
            from .autograd import grad as _grad
            inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
            gs = _grad([self], inputs, [gradient] if gradient is not None else None, retain_graph=retain_graph,
                       create_graph=create_graph, allow_unused=True)
            for t, g in zip(inputs, gs):
                if g is not None:
                    t._grad = g if t._grad is None else t._grad + g
            return
        backward([self], [gradient] if gradient is not None else None, retain_graph=retain_graph,
                 create_graph=create_graph)

    # ----------------------------------------------------------------- conversion
    def _host(self):
        """The data as a NumPy array (fp8 bytes viewed as ml_dtypes float8)."""
        a = backend.to_numpy(self._data)
        return a.view(D.float8_e4m3fn.np) if self._f8 else a

    def numpy(self, *, force=False):
        if self.requires_grad and not force:
            raise AutogradError("Can't call numpy() on a tensor that requires grad. Use tensor.detach().numpy().")
        return self._host()

    def item(self):
        if self._data.size != 1:
            raise ValueError(f"a Tensor with {self._data.size} elements cannot be converted to a Python scalar")
        a = self._host().reshape(())
        return (a.astype(np.float32) if a.dtype in (D.bfloat16.np, D.float8_e4m3fn.np) else a).item()

    def tolist(self):
        a = self._host()
        if a.dtype.kind == "V" or a.dtype in (D.bfloat16.np, D.float8_e4m3fn.np):
            a = a.astype(np.float32)
        return a.tolist()

    def to(self, *args, **kwargs):
        """to(device), to(dtype), to(device, dtype), to(other); `copy=True` forces a copy. Differentiable."""
        if len(args) == 1 and not kwargs and type(args[0]) is D.DType:   # x.to(dtype): nothing to parse
            return _to_op[0](self, None, args[0])
        dev = dt = None
        for a in args:
            if isinstance(a, Tensor):
                dev, dt = a.device, a.dtype
            elif isinstance(a, D.DType) or (not isinstance(a, (str, int)) and a is not None and
                                             _looks_like_dtype(a)):
                dt = D.dtype(a)
            elif a is not None:
                dev = _parse_device(a)
        dev = _parse_device(kwargs["device"]) if kwargs.get("device") is not None else dev
        dt = D.dtype(kwargs["dtype"]) if kwargs.get("dtype") is not None else dt
        return _to_op[0](self, dev, dt, copy=kwargs.get("copy", False))

    def cpu(self):
        return self.to(CPU)

    def cuda(self, device=None):
        return self.to(_parse_device("cuda" if device is None else (f"cuda:{device}" if isinstance(device, int)
                                                                     else device)))

    def long(self):
        return self.to(D.int64)

    def int(self):
        return self.to(D.int32)

    def bool(self):
        return self.to(D.bool_)

    def type_as(self, other):
        return self.to(other.dtype)

    # ----------------------------------------------------------------- python protocol
    def __repr__(self):
        a = self._host()
        if a.dtype in (D.bfloat16.np, D.float8_e4m3fn.np, np.dtype(np.float16)):
            a = a.astype(np.float32)
        body = np.array2string(a, separator=", ", prefix="tensor(", threshold=200, precision=4)
        extras = []
        if self.device != CPU:
            extras.append(f"device='{self.device}'")
        if self.dtype not in (D.float32, D.int64, D.bool_):
            extras.append(f"dtype={self.dtype!r}")
        if self._grad_fn is not None:
            extras.append(f"grad_fn=<{self._grad_fn.name()}>")
        elif self._requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    def __len__(self):
        if self._data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._data.shape[0]

    def __iter__(self):
        if self._data.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __bool__(self):
        if self._data.size != 1:
            raise RuntimeError(f"Boolean value of Tensor with {self._data.size} elements is ambiguous")
        return bool(self.item())

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.is_floating_point or self._data.size != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    __hash__ = object.__hash__

    def __reduce__(self):
        return (_rebuild, (backend.to_numpy(self._data), str(self.device), self._requires_grad))

    def __array__(self, dtype=None, copy=None):
        """np.asarray(t) for a cpu tensor (as .numpy(): no copy, and an error if it requires grad)."""
        if backend.is_cuda_array(self._data):
            raise TypeError(f"can't convert a {self.device} tensor to a NumPy array: copy it to host memory "
                            f"first with .cpu() (or .numpy(), which does)")
        a = self.numpy()
        if dtype is not None and a.dtype != np.dtype(dtype):
            if copy is False:
                raise ValueError(f"a {self.dtype.name} tensor cannot be a {np.dtype(dtype)} array without a copy")
            return a.astype(dtype)
        return a.copy() if copy else a

    def __dlpack__(self, *args, **kwargs):
        return self._data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


class Size(tuple):
    """torch.Size: a tuple of ints with numel()."""

    def numel(self):
        n = 1
        for s in self:
            n *= s
        return n

    def __repr__(self):
        return f"flame.Size([{', '.join(str(s) for s in self)}])"


class _ListHookHandle:
    def __init__(self, hooks, hook):
        self._hooks, self._hook = hooks, hook

    def remove(self):
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class _HookHandle:
    def __init__(self, tensor, hook):
        self._t, self._hook = tensor, hook

    def remove(self):
        t = self._t
        if t._grad_fn is not None and t._grad_fn._hooks:
            for hooks in t._grad_fn._hooks.values():
                if self._hook in hooks:
                    hooks.remove(self._hook)
        elif t._hooks and self._hook in t._hooks:
            t._hooks.remove(self._hook)


_new = object.__new__

from .autograd import function as _function  # noqa: E402

_to_op = [None]  # flame_core.ops.conversion.to: set by the ops package's install (which imports this module)

_function._tensor_cls[0] = Tensor


_cupy_ndarray = backend._cupy_ndarray if backend.cupy is not None else None


def _wrap(arr, requires_grad=False):
    """The one place tensors are born from arrays."""
    ta = type(arr)
    if ta is not _ndarray and ta is not _cupy_ndarray and not backend.is_cuda_array(arr):
        arr = np.asarray(arr)
    t = _new(Tensor)
    t._data = arr
    t._version = [0]
    if requires_grad:
        t._requires_grad = True
    if _memory_hook is not None:
        _memory_hook(arr)
    return t


# tensor birth in C where the extension is built (flame_core/csrc/tensor.c: this function, statement for statement);
# py_wrap stays the specification and the fallback (flame_core.speedups). Bound before the modules that import _wrap.
py_wrap = _wrap
if speedups.module is not None:
    speedups.module.configure_tensor(globals())
    _wrap = speedups.module.wrap


class _View(Tensor):
    """A tensor over part of its `_base`'s storage (made by reshape, permute, slicing, ...).

    An in-place op on a view is recorded on the base (CopySlices, see ops/views.py), and an in-place op on the base
    or on any of its views bumps the base's `_graph_gen`. A view whose history is then out of date derives its
    grad_fn again from the base's on the next read (ViewOfBase: its region of the base), so backward through the
    base or through any view, taken before or after, sees every modification -- PyTorch's semantics. Plain tensors
    pay nothing for this: `_grad_fn` is an ordinary attribute everywhere except on views.
    """

    _gfn = None
    _gen = 0

    @property
    def _grad_fn(self):
        if self._gen != self._base._graph_gen:
            _refresh_view(self)
        return self._gfn

    @_grad_fn.setter
    def _grad_fn(self, node):
        # a node is set on a view that is current (Function.apply on a new view; apply_inplace sets `_gen` itself);
        # None (zero_/fill_ making the view "constant") means: derive again from the base on the next read
        self._gfn = node
        if node is None:
            self._gen = -1


def _refresh_view(v):
    base = v._base
    v._gen = base._graph_gen
    v._out_idx = 0
    if base._grad_fn is None and not base._requires_grad:
        v._gfn = None
        return
    from .ops.views import view_of_base
    v._gfn = view_of_base(base, v._data)


def _view_of(arr, base):
    """A tensor over `arr`, which is a view of `base`'s storage: it shares the version counter, and its autograd
    history follows in-place changes of the base (see `_View`)."""
    t = _new(_View)
    t._data = arr
    t._version = base._version
    root = base._base
    if root is None:
        root = base
    t._base = root
    t._gen = root._graph_gen
    if base._f8:
        t._f8 = True
    return t


def _rebuild(arr, dev, requires_grad):
    from .ops.creation import tensor
    return tensor(arr, device=dev, requires_grad=requires_grad)


def _looks_like_dtype(a):
    try:
        D.dtype(a)
        return True
    except Exception:
        return False


def check_same_device(op, *tensors):
    """Raise DeviceError naming both devices when an op mixes them (0-d cpu tensors may join cuda ones)."""
    kind = None
    for t in tensors:   # the common case first: Tensors whose arrays are all of one type, one device kind
        if type(t) is not Tensor and not isinstance(t, Tensor):
            break
        if kind is None:
            kind = type(t._data)
        elif type(t._data) is not kind:
            break
    else:
        return
    first = None
    for t in tensors:
        if isinstance(t, Tensor):
            cuda = backend.is_cuda_array(t._data)
            if first is None:
                first = (cuda, t)
            elif cuda != first[0] and t.ndim and first[1].ndim:
                raise DeviceError(f"{op}: expected all tensors on the same device, but found at least two "
                                  f"devices, {first[1].device} and {t.device}")
