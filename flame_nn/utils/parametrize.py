"""Parametrizations, PyTorch's torch.nn.utils.parametrize: register_parametrization makes `module.<name>` a property
computed from an unconstrained original, `module.parametrizations.<name>.original` (or `original0`, `original1`, ...
when the first parametrization's right_inverse returns several tensors), by the registered modules in order.
Assigning `module.<name> = value` stores right_inverse(value) in the originals. state_dict keys are PyTorch's.

The module's class is swapped for a subclass, `Parametrized<Class>`, that holds the properties, as PyTorch does.
"""
import contextlib
import copy
from collections.abc import Sequence

from flame_core.autograd import no_grad
from flame_core.tensor import Tensor

from ..containers import ModuleDict, ModuleList
from ..module import Buffer, Module
from ..parameter import Parameter

_cache_depth = 0
_cache = {}


@contextlib.contextmanager
def cached():
    """Inside this block a parametrized tensor is computed once per module and name, on first use."""
    global _cache_depth
    _cache_depth += 1
    try:
        yield
    finally:
        _cache_depth -= 1
        if not _cache_depth:
            _cache.clear()


def _register_original(owner, name, tensor):
    if isinstance(tensor, Parameter):
        owner.register_parameter(name, tensor)
    else:
        owner.register_buffer(name, tensor)


def _check_dtype(value, original, what):
    if not isinstance(value, Tensor):
        raise ValueError(f"`right_inverse` must return {what}. Got {type(value).__name__}")
    if value.dtype != original.dtype:
        raise ValueError(f"The tensor returned by `right_inverse` has dtype {value.dtype} while `original` has dtype "
                         f"{original.dtype}")


def _check_kept(value, dtype, shape):
    """A parametrization's output when `unsafe` is off: a tensor of the unparametrized dtype and shape."""
    if not isinstance(value, Tensor):
        raise ValueError(f"A parametrization must return a tensor. Got {type(value).__name__}.")
    for what, want, got in (("dtype", dtype, value.dtype), ("shape", tuple(shape), tuple(value.shape))):
        if got != want:
            raise ValueError(f"Registering a parametrization may not change the {what} of the tensor, unless the "
                             f"`unsafe` flag is enabled.\nunparametrized {what}: {want}\nparametrized {what}: {got}")


class ParametrizationList(ModuleList):
    """The parametrizations of one tensor, applied in order to the original(s) they hold (`original`, or `original0`,
    `original1`, ... when the first one's right_inverse returns a sequence)."""

    def __init__(self, modules, original, unsafe=False):
        if len(modules) == 0:
            raise ValueError("ParametrizationList requires one or more modules.")
        super().__init__(modules)
        self.unsafe = unsafe
        shape, dtype = tuple(original.shape), original.dtype
        with no_grad():
            new = original
            for module in reversed(list(self)):
                if hasattr(module, "right_inverse"):
                    try:
                        new = module.right_inverse(new)
                    except NotImplementedError:  # a right_inverse that cannot be: the identity
                        pass
        if not isinstance(new, (Tensor, Sequence)):
            raise ValueError(f"'right_inverse' must return a Tensor or a Sequence of tensors (list, tuple...). Got "
                             f"{type(new).__name__}")
        self.is_tensor = isinstance(new, Tensor)
        self.ntensors = 1 if self.is_tensor else len(new)
        if self.is_tensor:
            if new.dtype != dtype:
                raise ValueError(f"When `right_inverse` outputs one tensor, it may not change the dtype.\n"
                                 f"original.dtype: {dtype}\nright_inverse(original).dtype: {new.dtype}")
            if new.device != original.device:
                raise ValueError(f"When `right_inverse` outputs one tensor, it may not change the device.\n"
                                 f"original.device: {original.device}\nright_inverse(original).device: {new.device}")
            if new is not original:
                original.data = new.detach()  # the original keeps its identity (optimizers hold it), new values
            _register_original(self, "original", original)
        else:
            for i, part in enumerate(new):
                if not isinstance(part, Tensor):
                    raise ValueError(f"'right_inverse' must return a Tensor or a Sequence of tensors (list, tuple...). "
                                     f"Got element {i} of the sequence with type {type(part).__name__}.")
                part = part.detach()
                part = Parameter(part, original.requires_grad) if isinstance(original, Parameter) else \
                    part.requires_grad_(original.requires_grad)
                _register_original(self, f"original{i}", part)
        if not unsafe:
            _check_kept(self(), dtype, shape)

    def originals(self):
        return [self.original] if self.is_tensor else [getattr(self, f"original{i}") for i in range(self.ntensors)]

    def right_inverse(self, value):
        """Store in the originals the values whose parametrization is `value` (each module's right_inverse, last
        first)."""
        with no_grad():
            for module in reversed(list(self)):
                if not hasattr(module, "right_inverse"):
                    raise RuntimeError(f"parametrization {type(module).__name__} does not implement right_inverse.")
                value = module.right_inverse(value)
            if self.is_tensor:
                _check_dtype(value, self.original, "a tensor")
                self.original.data = value.detach()
                return
            if not isinstance(value, Sequence) or len(value) != self.ntensors:
                raise ValueError(f"'right_inverse' must return a sequence of {self.ntensors} tensors. Got "
                                 f"{type(value).__name__}.")
            for part, original in zip(value, self.originals()):
                _check_dtype(part, original, "a sequence of tensors")
                original.data = part.detach()

    def __repr__(self):
        return type(self).__name__ + super().__repr__()[len("ModuleList"):]

    def forward(self):
        modules = list(self)
        x = modules[0](*self.originals())
        for module in modules[1:]:
            x = module(x)
        return x


def _parametrized_class(cls):
    """Parametrized<cls>: where the properties live; pickling refused (state_dict is the way), deepcopy kept."""
    def __getstate__(self):
        raise RuntimeError("Serialization of parametrized modules is only supported through state_dict().")

    def __deepcopy__(self, memo):
        replica = self.__class__.__new__(self.__class__)
        memo[id(self)] = replica
        replica.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return replica

    def __setattr__(self, name, value):
        if is_parametrized(self, name) and isinstance(value, (Parameter, Module, Buffer)):
            raise KeyError(f"attribute '{name}' already exists")
        cls.__setattr__(self, name, value)

    return type(f"Parametrized{cls.__name__}", (cls,), {"__getstate__": __getstate__, "__deepcopy__": __deepcopy__,
                                                      "__setattr__": __setattr__})


def _parametrized_property(name):
    def get(module):
        parametrization = module.parametrizations[name]
        if not _cache_depth:
            return parametrization()
        key = (id(module), name)
        if key not in _cache:
            _cache[key] = parametrization()
        return _cache[key]

    def set_(module, value):
        module.parametrizations[name].right_inverse(value)

    return property(get, set_)


def register_parametrization(module, tensor_name, parametrization, *, unsafe=False):
    """Make module.<tensor_name> (a parameter, a buffer or an already parametrized tensor) the output of
    `parametrization` (a Module: forward(original) -> tensor, optionally right_inverse(tensor) -> original(s)).
    unsafe: skip the checks that the dtype and shape stay. Returns module."""
    parametrization.train(module.training)
    if is_parametrized(module, tensor_name):
        if not unsafe:
            current = getattr(module, tensor_name)
            value = parametrization(current)
            _check_kept(value, current.dtype, tuple(current.shape))
            if hasattr(parametrization, "right_inverse"):
                back = parametrization.right_inverse(value)
                if not isinstance(back, Tensor):
                    raise ValueError(f"parametrization.right_inverse must return a tensor. Got: {type(back).__name__}")
                for what in ("dtype", "shape"):
                    if getattr(back, what) != getattr(current, what):
                        raise ValueError(f"The tensor returned by parametrization.right_inverse must have the same "
                                         f"{what} as module.{tensor_name}, unless the `unsafe` flag is enabled.\n"
                                         f"module.{tensor_name}.{what}: {getattr(current, what)}\nreturned {what}: "
                                         f"{getattr(back, what)}")
        parametrizations = module.parametrizations[tensor_name]
        parametrizations.append(parametrization)
        parametrizations.unsafe |= unsafe
        return module
    if tensor_name not in module._parameters and tensor_name not in module._buffers:
        raise ValueError(f"Module '{module}' does not have a parameter, a buffer, or a parametrized element with name "
                         f"'{tensor_name}'")
    original = getattr(module, tensor_name)
    parametrizations = ParametrizationList([parametrization], original, unsafe=unsafe)
    delattr(module, tensor_name)
    if not is_parametrized(module):
        module.parametrizations = ModuleDict()
        module.__class__ = _parametrized_class(module.__class__)
    module.parametrizations[tensor_name] = parametrizations
    setattr(module.__class__, tensor_name, _parametrized_property(tensor_name))
    return module


def is_parametrized(module, tensor_name=None):
    """Whether module has a parametrization (on tensor_name, when given)."""
    parametrizations = module.__dict__.get("parametrizations")
    if not isinstance(parametrizations, ModuleDict):
        return False
    return len(parametrizations) > 0 if tensor_name is None else tensor_name in parametrizations


def remove_parametrizations(module, tensor_name, leave_parametrized=True):
    """Make module.<tensor_name> a plain parameter (or buffer) again: holding its current parametrized value
    (leave_parametrized) or the original. The original Parameter object is kept where there is one original.
    Returns module."""
    if not is_parametrized(module, tensor_name):
        raise ValueError(f"Module {module} does not have a parametrization on {tensor_name}")
    parametrizations = module.parametrizations[tensor_name]
    if parametrizations.is_tensor:
        original = parametrizations.original
        if leave_parametrized:
            with no_grad():
                original.data = getattr(module, tensor_name).detach()
    else:
        if not leave_parametrized:
            raise ValueError("Cannot leave unparametrized (`leave_parametrized=False`) a tensor that is parametrized "
                             "in terms of a sequence of tensors.")
        first = parametrizations.original0
        with no_grad():
            value = getattr(module, tensor_name).detach()
        original = Parameter(value, first.requires_grad) if isinstance(first, Parameter) else value
    delattr(module.__class__, tensor_name)
    del module.parametrizations[tensor_name]
    _register_original(module, tensor_name, original)
    if not is_parametrized(module):
        delattr(module, "parametrizations")
        module.__class__ = module.__class__.__bases__[0]
    return module


def type_before_parametrizations(module):
    """The module's class as it was before its first parametrization."""
    return module.__class__.__bases__[0] if is_parametrized(module) else type(module)
