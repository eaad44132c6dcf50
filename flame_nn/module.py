"""Module: the base of every layer and model, with PyTorch's registration, traversal, state_dict and hook API.

Registered parameters, buffers and submodules live in `_parameters` / `_buffers` / `_modules` AND in the instance
`__dict__`, so `self.weight` is a plain attribute read (no `__getattr__` round trip on the hot path).
"""
import itertools
import warnings
from collections import OrderedDict, namedtuple

import numpy as np

from flame_core import backend
from flame_core import dtypes as D
from flame_core.autograd import no_grad
from flame_core.device import device as _parse_device
from flame_core.errors import FlameError, fmt_shape
from flame_core.tensor import Tensor

from . import backward_hooks as _bw
from . import empty_init as _ei
from . import state_dict_hooks as _sdh
from .parameter import MetaTensorError, Parameter, empty_storage, meta_array


class _BufferMeta(type):
    def __instancecheck__(cls, instance):
        return isinstance(instance, Tensor) and getattr(instance, "_is_buffer", False)


class Buffer(metaclass=_BufferMeta):
    """`Buffer(data=None, *, persistent=True)`: `data` detached (its storage, no copy) and marked, so that assigning
    it as a Module attribute registers a buffer (`self.x = nn.Buffer(t)`, PyTorch >= 2.5); `persistent` says
    whether state_dict holds it. It is a plain Tensor: isinstance(t, Buffer) reads the mark."""

    def __new__(cls, data=None, *, persistent=True):
        if data is None:
            data = Tensor(np.empty((0,), dtype=D.get_default_dtype().np))
        if not isinstance(data, Tensor):
            raise TypeError(f"Buffer expects a Tensor, got {type(data).__name__}")
        t = data.detach().requires_grad_(data.requires_grad)
        t.persistent, t._is_buffer = persistent, True
        return t


def to_target(args, kwargs):
    """(device or None, dtype or None) of Module.to's arguments: to(device), to(dtype), to(device, dtype),
    to(tensor), device= / dtype=; the dtype must be a floating one."""
    dev = dt = None
    for a in args:
        if isinstance(a, Tensor):
            dev, dt = a.device, a.dtype
        elif isinstance(a, D.DType):
            dt = a
        elif a is not None:
            try:
                dev = _parse_device(a)
            except Exception:
                dt = D.dtype(a)
    if kwargs.get("device") is not None:
        dev = _parse_device(kwargs["device"])
    if kwargs.get("dtype") is not None:
        dt = D.dtype(kwargs["dtype"])
    if dt is not None and not dt.is_floating_point:
        raise TypeError(f"Module.to only accepts floating point dtypes, got {dt}")
    return dev, dt


class StateDictError(FlameError, RuntimeError):
    """Missing, unexpected or misshaped keys when loading a state_dict or a weights file."""


IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

_MAX_LISTED = 25
_hook_ids = itertools.count()


def _listing(keys):
    shown = ", ".join(f'"{k}"' for k in keys[:_MAX_LISTED])
    return shown + (f", ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else "")


def _format_load_errors(owner, missing, unexpected, misshaped, source=None):
    lines = [f"Error(s) in loading state_dict for {owner}" + (f" from {source}" if source else "") + ":"]
    if missing:
        lines.append(f"\tMissing key(s) in state_dict ({len(missing)}): {_listing(missing)}.")
    if unexpected:
        lines.append(f"\tUnexpected key(s) in state_dict ({len(unexpected)}): {_listing(unexpected)}.")
    for k, src, dst in misshaped[:_MAX_LISTED]:
        lines.append(f"\tsize mismatch for {k}: copying a param with shape {fmt_shape(src)} from checkpoint, "
                     f"the shape in current model is {fmt_shape(dst)}.")
    if len(misshaped) > _MAX_LISTED:
        lines.append(f"\t... and {len(misshaped) - _MAX_LISTED} more size mismatches.")
    return "\n".join(lines)


class RemovableHandle:
    """Returned by register_*_hook; `remove()` unregisters (also usable as a context manager)."""

    def __init__(self, hooks_dict, extra_dict=None):
        self.id = next(_hook_ids)
        self._dicts = [d for d in (hooks_dict, extra_dict) if d is not None]

    def remove(self):
        for d in self._dicts:
            d.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _addindent(s, n):
    lines = s.split("\n")
    if len(lines) == 1:
        return s
    return lines[0] + "\n" + "\n".join(" " * n + line for line in lines[1:])


def _array_of(v):
    """(array, is_fp8_bytes) of a state_dict value: a Tensor, or a NumPy / CuPy array."""
    if isinstance(v, Tensor):
        return v.array, v._f8
    if backend.is_cuda_array(v):
        return v, False
    if hasattr(v, "__array__"):
        return np.asarray(v), False
    raise TypeError(f"state_dict values must be Tensors or arrays, got {type(v).__name__}")


class Module(D.FloatCasts):
    """Base class of layers and models. Subclasses call `super().__init__()` and define `forward`."""

    training = True
    _meta_check = False  # True while this module may hold meta parameters (checked on call)

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{type(self).__name__}.__init__() got unexpected arguments")
        d = self.__dict__
        d["training"] = True
        d["_parameters"] = {}
        d["_buffers"] = {}
        d["_non_persistent_buffers_set"] = set()
        d["_modules"] = {}
        d["_forward_pre_hooks"] = OrderedDict()
        d["_forward_hooks"] = OrderedDict()
        d["_backward_hooks"] = OrderedDict()
        d["_backward_pre_hooks"] = OrderedDict()
        d["_hooks_with_kwargs"] = set()
        d["_hooks_always_called"] = set()

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

    # ----------------------------------------------------------------- calling
    def __call__(self, *args, **kwargs):
        if self._meta_check:
            self._check_materialized()
        if self._forward_pre_hooks or self._forward_hooks or self._backward_hooks or self._backward_pre_hooks:
            return self._call_with_hooks(args, kwargs)
        return self.forward(*args, **kwargs)

    def has_hooks(self):
        """Whether a forward (pre-) or backward (pre-) hook is registered on this module: a fused op that would take
        its place in a bigger kernel must call it instead (the hooks see its inputs and outputs)."""
        return bool(self._forward_pre_hooks or self._forward_hooks or self._backward_hooks or self._backward_pre_hooks)

    def _check_materialized(self):
        meta = [n for n, p in self._parameters.items() if p is not None and p.is_meta]
        if meta:
            raise MetaTensorError(f"{type(self).__name__} was called but its parameter(s) {', '.join(meta)} were "
                                  f"created under empty_init and hold no data: load the weights first "
                                  f"(load_state_dict / flame_nn.load_weights_) or call .to_empty()")
        self.__dict__["_meta_check"] = False

    def _call_with_hooks(self, args, kwargs):
        kw_hooks = self._hooks_with_kwargs
        for hid, hook in list(self._forward_pre_hooks.items()):
            if hid in kw_hooks:
                r = hook(self, args, kwargs)
                if r is not None:
                    if not (isinstance(r, tuple) and len(r) == 2):
                        raise RuntimeError(f"forward pre-hook with kwargs must return None or (args, kwargs), got "
                                           f"{type(r).__name__}")
                    args, kwargs = r
            else:
                r = hook(self, args)
                if r is not None:
                    args = r if isinstance(r, tuple) else (r,)
        bw_state = None
        if self._backward_hooks or self._backward_pre_hooks:
            args, bw_state = _bw.wrap_inputs(self, args)
        try:
            out = self.forward(*args, **kwargs)
        except Exception:
            for hid, hook in list(self._forward_hooks.items()):
                if hid in self._hooks_always_called:
                    try:
                        hook(self, args, kwargs, None) if hid in kw_hooks else hook(self, args, None)
                    except Exception:
                        pass
            raise
        for hid, hook in list(self._forward_hooks.items()):
            r = hook(self, args, kwargs, out) if hid in kw_hooks else hook(self, args, out)
            if r is not None:
                out = r
        if bw_state is not None:
            out = _bw.wrap_outputs(bw_state, out)
        return out

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        """`hook(module, args) -> None | new args` (with_kwargs: `hook(module, args, kwargs) -> None | (a, kw)`)."""
        h = RemovableHandle(self._forward_pre_hooks)
        self._add_hook(self._forward_pre_hooks, h.id, hook, prepend)
        if with_kwargs:
            self._hooks_with_kwargs.add(h.id)
        return h

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False, always_call=False):
        """`hook(module, args, output) -> None | new output` (with_kwargs: `hook(module, args, kwargs, output)`)."""
        h = RemovableHandle(self._forward_hooks)
        self._add_hook(self._forward_hooks, h.id, hook, prepend)
        if with_kwargs:
            self._hooks_with_kwargs.add(h.id)
        if always_call:
            self._hooks_always_called.add(h.id)
        return h

    def register_full_backward_hook(self, hook, prepend=False):
        """`hook(module, grad_input, grad_output) -> None | new grad_input`, called when the gradients with respect
        to the module's positional tensor inputs are computed (flame_nn/backward_hooks.py)."""
        h = RemovableHandle(self._backward_hooks)
        self._add_hook(self._backward_hooks, h.id, hook, prepend)
        return h

    def register_full_backward_pre_hook(self, hook, prepend=False):
        """`hook(module, grad_output) -> None | new grad_output`, called before the module's gradients are computed."""
        h = RemovableHandle(self._backward_pre_hooks)
        self._add_hook(self._backward_pre_hooks, h.id, hook, prepend)
        return h

    @staticmethod
    def _add_hook(d, hid, hook, prepend):
        d[hid] = hook
        if prepend:
            d.move_to_end(hid, last=False)

    # ----------------------------------------------------------------- registration
    def _check_name(self, kind, name):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {kind} before Module.__init__() call")
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if name == "" or "." in name:
            raise KeyError(f"{kind} name can't be empty or contain '.', got {name!r}")

    def _forget(self, name):
        d = self.__dict__
        for reg in (d["_parameters"], d["_buffers"], d["_modules"]):
            reg.pop(name, None)
        d["_non_persistent_buffers_set"].discard(name)

    def _claim(self, name, registry, replaces):
        """Make room for `name` in `registry`: a member of that name in one of the `replaces` registries is
        forgotten; any other attribute of that name is a KeyError (PyTorch's rules)."""
        d = self.__dict__
        if name in d and name not in d[registry]:
            if not any(name in d[r] for r in replaces):
                raise KeyError(f"attribute '{name}' already exists")
            self._forget(name)

    def register_parameter(self, name, param):
        self._check_name("parameter", name)
        self._claim(name, "_parameters", replaces=("_buffers", "_modules"))
        d = self.__dict__
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                            f"(flame_nn.Parameter or None required)")
        if param is not None and _ei.is_empty_init():
            param = _ei.to_meta_if_empty_init(param)
        d["_parameters"][name] = param
        d[name] = param
        if param is not None and param.is_meta:
            d["_meta_check"] = True

    def register_buffer(self, name, tensor, persistent=True):
        self._check_name("buffer", name)
        self._claim(name, "_buffers", replaces=())
        d = self.__dict__
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' (Tensor or None "
                            f"required)")
        d["_buffers"][name] = tensor
        d[name] = tensor
        if persistent:
            d["_non_persistent_buffers_set"].discard(name)
        else:
            d["_non_persistent_buffers_set"].add(name)

    def add_module(self, name, module):
        self._check_name("module", name)
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._claim(name, "_modules", replaces=("_parameters", "_buffers"))
        d = self.__dict__
        d["_modules"][name] = module
        d[name] = module

    register_module = add_module

    def __setattr__(self, name, value):
        d = self.__dict__
        params = d.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            if name in d and name not in params:
                self._forget(name)
                d.pop(name, None)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                f"(flame_nn.Parameter or None expected)")
            self.register_parameter(name, None)
        elif isinstance(value, Module):
            if params is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            if name in d and name not in d["_modules"]:
                self._forget(name)
                d.pop(name, None)
            self.add_module(name, value)
        elif params is not None and name in d["_modules"]:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module '{name}' (Module or None "
                                f"expected)")
            d["_modules"][name] = None
            d[name] = None
        elif isinstance(value, Buffer):
            self.register_buffer(name, value, value.persistent)
        elif params is not None and name in d["_buffers"]:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' (Tensor or None "
                                f"expected)")
            d["_buffers"][name] = value
            d[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):  # only reached when `name` is neither registered nor a plain attribute
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        d = self.__dict__
        if name in d.get("_parameters", ()) or name in d.get("_buffers", ()) or name in d.get("_modules", ()):
            self._forget(name)
            del d[name]
        else:
            object.__delattr__(self, name)

    def __dir__(self):
        return sorted(set(object.__dir__(self)))

    # ----------------------------------------------------------------- traversal
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is None:
                continue
            yield from m.named_modules(memo, prefix + ("." if prefix else "") + name, remove_duplicate)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self):
        for _, m in self.named_children():
            yield m

    def _named_members(self, registry, prefix, recurse, remove_duplicate):
        seen = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        for mp, m in mods:
            for k, v in getattr(m, registry).items():
                if v is None:
                    continue
                if remove_duplicate:
                    if id(v) in seen:
                        continue
                    seen.add(id(v))
                yield (mp + "." + k if mp else k), v

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse=True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target):
        m = self
        if target == "":
            return m
        for part in target.split("."):
            sub = m._modules.get(part) if isinstance(m, Module) else None
            if sub is None:
                raise AttributeError(f"{type(m).__name__} has no submodule '{part}' (looking up '{target}')")
            m = sub
        return m

    def get_parameter(self, target):
        return self._get_member(target, "_parameters", "parameter")

    def get_buffer(self, target):
        return self._get_member(target, "_buffers", "buffer")

    def _get_member(self, target, table, what):
        mod_path, _, name = target.rpartition(".")
        m = self.get_submodule(mod_path)
        t = getattr(m, table).get(name)
        if t is None:
            raise AttributeError(f"{type(m).__name__} has no {what} '{name}' (looking up '{target}')")
        return t

    def apply(self, fn):
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ----------------------------------------------------------------- modes and grads
    def train(self, mode=True):
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        for m in self.modules():
            m.__dict__["training"] = mode
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none=True):
        """Reset the gradients of all parameters (one memset per flat buffer when the gradient pool owns them)."""
        from .utils import zero_grads
        zero_grads(self.parameters(), set_to_none=set_to_none)

    # ----------------------------------------------------------------- device / dtype
    def _convert_(self, fn_param):
        seen = set()
        for m in self.modules():
            for reg in (m._parameters, m._buffers):
                for t in reg.values():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        fn_param(t)
        return self

    def to(self, *args, **kwargs):
        """to(device), to(dtype), to(device, dtype), to(tensor): converts parameters and buffers IN PLACE (the same
        Parameter objects, so optimizers keep working); only floating tensors change dtype."""
        dev, dt = to_target(args, kwargs)
        from flame_core.io import convert

        from .utils import _pool
        moved = []
        # a module's storage whose dtype is its format (an fp8-stored Linear's float8 weight and float32 scales:
        # `_keep_dtype` names them) keeps it; the module is told the new compute dtype (`_dtype_changed_`)
        keep, told = set(), []
        if dt is not None:
            for m in self.modules():
                for n in getattr(m, "_keep_dtype", ()):
                    t = m._parameters.get(n, m._buffers.get(n))
                    if t is not None:
                        keep.add(id(t))
                if hasattr(m, "_dtype_changed_"):
                    told.append(m)

        def conv(t):
            want = dt.np if (dt is not None and t.dtype.is_floating_point and id(t) not in keep) else None
            if getattr(t, "_meta_device", None) is not None:
                if dev is not None:
                    t._meta_device = dev
                if want is not None:
                    t.set_array_(meta_array(t.array.shape, want))
                return
            arr, f8 = convert(t.array, want, dev, t._f8)
            if arr is t.array:
                return
            if _pool is not None and isinstance(t, Parameter) and _pool.is_registered(t):
                _pool.unregister([t])  # its pooled gradient storage has the old device/dtype
                moved.append(t)
            t.set_array_(arr, f8)
            g = t._grad
            if g is not None:
                garr, gf8 = convert(g.array, want, dev, g._f8)
                if garr is not g.array:
                    t._grad = g = g._detached_owned()  # a pooled .grad is a view: detach it from the old buffer
                    g.set_array_(garr, gf8)
        self._convert_(conv)
        if moved:
            _pool.register(moved)
        for m in told:
            m._dtype_changed_(dt)
        return self

    def cuda(self, device=None):
        return self.to("cuda" if device is None else (f"cuda:{device}" if isinstance(device, int) else device))

    def cpu(self):
        return self.to("cpu")

    def to_empty(self, *, device=None):
        """Give every meta parameter uninitialised storage on `device` (default: its target device)."""
        for p in self.parameters():
            if p.is_meta:
                dev = _parse_device(device) if device is not None else p._meta_device
                p.materialize_(*empty_storage(p.array.shape, p.array.dtype, dev))
        if device is not None:
            self.to(device)
        return self

    # ----------------------------------------------------------------- state dict
    def _own_state_items(self, prefix, keep_vars):
        """This module's own parameters and persistent buffers."""
        for k, p in self._parameters.items():
            if p is not None:
                yield prefix + k, (p if keep_vars else p.detach())
        for k, b in self._buffers.items():
            if b is not None and k not in self._non_persistent_buffers_set:
                yield prefix + k, (b if keep_vars else b.detach())

    def _state_items(self, prefix="", keep_vars=True):
        """The parameters and persistent buffers of the whole tree (no hooks, no extra state)."""
        yield from self._own_state_items(prefix, keep_vars)
        for name, m in self._modules.items():
            if m is not None:
                yield from m._state_items(prefix + name + ".", keep_vars)

    def get_extra_state(self):
        """A module's non-tensor state for its state_dict (override with set_extra_state; see state_dict_hooks.py)."""
        raise RuntimeError("Reached a code path in Module.get_extra_state() that should never be called: override "
                           "it (and set_extra_state) to keep extra state")

    def set_extra_state(self, state):
        raise RuntimeError("Reached a code path in Module.set_extra_state() that should never be called: override "
                           "it (and get_extra_state) to load extra state")

    def register_state_dict_pre_hook(self, hook):
        return _sdh.add(self, "_state_dict_pre_hooks", hook, RemovableHandle)

    def register_state_dict_post_hook(self, hook):
        def public(*args):
            return hook(*args)
        public._public = True
        return _sdh.add(self, "_state_dict_hooks", public, RemovableHandle)

    def _register_state_dict_hook(self, hook):
        return _sdh.add(self, "_state_dict_hooks", hook, RemovableHandle)

    def register_load_state_dict_pre_hook(self, hook):
        return _sdh.add(self, "_load_state_dict_pre_hooks", hook, RemovableHandle)

    def _register_load_state_dict_pre_hook(self, hook, with_module=False):
        return self.register_load_state_dict_pre_hook(hook if with_module else lambda m, *args: hook(*args))

    def register_load_state_dict_post_hook(self, hook):
        return _sdh.add(self, "_load_state_dict_post_hooks", hook, RemovableHandle)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Ordered name -> tensor (detached unless keep_vars) of parameters and persistent buffers, with the modules'
        extra state and state_dict hooks (state_dict_hooks.py). PyTorch's deprecated positional form
        (destination, prefix, keep_vars) is taken too."""
        if args:
            warnings.warn("Positional args are being deprecated, use kwargs instead (destination, prefix, keep_vars)",
                          FutureWarning, stacklevel=2)
            destination, prefix, keep_vars = (tuple(args) + (destination, prefix, keep_vars)[len(args):])[:3]
        if destination is None:
            destination = OrderedDict()
        return _sdh.save(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Copy tensors/arrays from `state_dict` into parameters and buffers (converted to their dtype and device).

        Meta parameters (built under empty_init) get their storage here. With `assign=True` tensors take the given
        array as is (its dtype and device, no copy). The modules' load pre-hooks may rename keys first and their
        post-hooks clear reported keys after; extra state goes to set_extra_state. Raises StateDictError listing
        missing, unexpected (strict) and misshaped keys -- before anything is copied, unless a post-hook must see the
        load; returns IncompatibleKeys(missing_keys, unexpected_keys).
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"expected a mapping for state_dict, got {type(state_dict).__name__}")
        state_dict = OrderedDict(state_dict)
        hook_missing, hook_unexpected, errors = _sdh.run_load_pre_hooks(self, state_dict, strict)
        expected = dict(self._state_items())
        extra = _sdh.extra_state_keys(self)
        missing = hook_missing + [k for k in list(expected) + list(extra) if k not in state_dict]
        unexpected = hook_unexpected + [k for k in state_dict if k not in expected and k not in extra]
        misshaped = []
        for k, t in expected.items():
            if k in state_dict:
                src = tuple(_array_of(state_dict[k])[0].shape)
                if src != tuple(t.shape):
                    misshaped.append((k, src, tuple(t.shape)))
        post = _sdh.has_load_post_hooks(self)

        def check():
            if errors or misshaped or (strict and (missing or unexpected)):
                raise StateDictError(_format_load_errors(type(self).__name__, missing if strict else [],
                                                         unexpected if strict else [], misshaped)
                                     + "".join("\n\t" + e for e in errors))
        if not post or misshaped or errors:
            check()
        from flame_core.io import convert
        with no_grad():
            for k, t in expected.items():
                if k not in state_dict:
                    continue
                src, src_f8 = _array_of(state_dict[k])
                if assign:  # take the given array itself: its dtype, its device, its memory
                    if isinstance(t, Parameter):
                        t.materialize_(src, src_f8)
                    else:
                        t.set_array_(src, src_f8)
                        t._version[0] += 1
                    continue
                arr, f8 = convert(src, t.dtype.np, t.device, src_f8)
                if getattr(t, "_meta_device", None) is not None:
                    if arr is src:
                        arr = arr.copy()  # never alias the caller's array
                    t.materialize_(arr, f8)
                else:
                    t.array[...] = arr
                    t._version[0] += 1
        for k, m in extra.items():
            if k in state_dict:
                m.set_extra_state(state_dict[k])
        for m in self.modules():
            if m._meta_check:
                m.__dict__["_meta_check"] = any(p is not None and p.is_meta for p in m._parameters.values())
        result = IncompatibleKeys(missing, unexpected)
        if post:   # PyTorch's order: the hooks see the loaded module and may clear keys; then the strict check
            _sdh.run_load_post_hooks(self, result)
            check()
        return result

    # ----------------------------------------------------------------- repr
    def extra_repr(self):
        return ""

    def _get_name(self):
        return type(self).__name__

    def __repr__(self):
        extra = self.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        child_lines = [f"({k}): " + _addindent(repr(m), 2) for k, m in self._modules.items()]
        lines = extra_lines + child_lines
        s = self._get_name() + "("
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                s += extra_lines[0]
            else:
                s += "\n  " + "\n  ".join(lines) + "\n"
        return s + ")"
