"""Sequential, ModuleList, ModuleDict: modules that hold other modules (children named "0", "1", ... or by key);
ParameterList, ParameterDict: modules that hold parameters the same way (state_dict keys "0", "1", ... or the keys)."""
from collections import OrderedDict

from flame_core.tensor import Tensor

from .module import Module, _addindent
from .parameter import Parameter


def _index(idx, n, what):
    if not isinstance(idx, int):
        raise TypeError(f"{what} indices must be integers or slices, not {type(idx).__name__}")
    if not -n <= idx < n:
        raise IndexError(f"index {idx} is out of range for {what} of length {n}")
    return idx % n


class _Indexed:
    """len, iteration over the modules and append() of a list container (children named "0", "1", ...)."""

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self


class Sequential(_Indexed, Module):
    """Calls its modules in order: `Sequential(a, b, c)(x) == c(b(a(x)))`; also `Sequential(OrderedDict(...))`."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], (OrderedDict, dict)):
            for k, m in args[0].items():
                self.add_module(k, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        return list(self._modules.values())[_index(idx, len(self), "Sequential")]

    def __setitem__(self, idx, module):
        key = list(self._modules)[_index(idx, len(self), "Sequential")]
        setattr(self, key, module)

    def __delitem__(self, idx):
        keys = list(self._modules)
        for k in (keys[idx] if isinstance(idx, slice) else [keys[_index(idx, len(self), "Sequential")]]):
            delattr(self, k)


class ModuleList(_Indexed, Module):
    """A list of modules, registered (their parameters are visible to the parent)."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[str(_index(idx, len(self), "ModuleList"))]

    def __setitem__(self, idx, module):
        self.add_module(str(_index(idx, len(self), "ModuleList")), module)

    def __delitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            del mods[idx]
        else:
            del mods[_index(idx, len(self), "ModuleList")]
        for k in list(self._modules):
            delattr(self, k)
        self.extend(mods)

    def extend(self, modules):
        for m in modules:
            self.append(m)
        return self

    def insert(self, index, module):
        mods = list(self._modules.values())
        mods.insert(index, module)
        for k in list(self._modules):
            delattr(self, k)
        self.extend(mods)

    def __repr__(self):
        """Runs of identical modules are folded, as PyTorch does: `(0-23): 24 x Block(...)`."""
        items = list(self._modules.items())
        if not items:
            return "ModuleList()"
        lines, start = [], 0
        reprs = [repr(m) for _, m in items]
        while start < len(items):
            end = start
            while end + 1 < len(items) and reprs[end + 1] == reprs[start]:
                end += 1
            label = f"({items[start][0]})" if end == start else f"({items[start][0]}-{items[end][0]}): " \
                                                                  f"{end - start + 1} x"
            sep = ": " if end == start else " "
            lines.append(label + sep + _addindent(reprs[start], 2))
            start = end + 1
        return "ModuleList(\n  " + "\n  ".join(lines) + "\n)"

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList is a container and has no forward; iterate over it")


class _Keyed:
    """len, iteration, `in` and keys() of a dict container, over the insertion-ordered dict `_names()` returns."""

    def __len__(self):
        return len(self._names())

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, key):
        return key in self._names()

    def keys(self):
        return self._names().keys()


class ModuleDict(_Keyed, Module):
    """A dict of modules, registered under their keys (insertion order kept)."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key):
        try:
            return self._modules[key]
        except KeyError:
            raise KeyError(f"ModuleDict has no key {key!r} (keys: {list(self._modules)})") from None

    def __setitem__(self, key, module):
        self.add_module(key, module)

    def __delitem__(self, key):
        self[key]
        delattr(self, key)

    def _names(self):
        return self._modules

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def pop(self, key):
        m = self[key]
        delattr(self, key)
        return m

    def update(self, modules):
        items = modules.items() if hasattr(modules, "items") else modules
        for k, m in items:
            self[k] = m

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleDict is a container and has no forward; index it by key")


def _as_parameter(value):
    """A plain Tensor stored in a ParameterList / ParameterDict becomes a Parameter (PyTorch's rule)."""
    if isinstance(value, Tensor) and not isinstance(value, Parameter):
        return Parameter(value)
    return value


def _param_repr(p):
    if not isinstance(p, Tensor):
        return f"Object of type: {type(p).__name__}"
    kind = "Parameter" if isinstance(p, Parameter) else "Tensor"
    return f"{kind} containing: [{p.dtype} of size {'x'.join(str(s) for s in p.shape)} on {p.device}]"


class ParameterList(Module):
    """A list of parameters, registered under "0", "1", ... (plain Tensors are wrapped in Parameter)."""

    def __init__(self, values=None):
        super().__init__()
        self._size = 0
        if values is not None:
            self.extend(values)

    def __len__(self):
        return self._size

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ParameterList([self[i] for i in range(self._size)[idx]])
        return getattr(self, str(_index(idx, self._size, "ParameterList")))

    def __setitem__(self, idx, param):
        setattr(self, str(_index(idx, self._size, "ParameterList")), _as_parameter(param))

    def __iter__(self):
        return (self[i] for i in range(self._size))

    def __iadd__(self, parameters):
        return self.extend(parameters)

    def append(self, value):
        i = self._size
        self._size += 1
        setattr(self, str(i), _as_parameter(value))
        return self

    def extend(self, values):
        if isinstance(values, Tensor) or not hasattr(values, "__iter__"):
            raise TypeError(f"ParameterList.extend should be called with an iterable, but got "
                            f"{type(values).__name__}")
        for v in values:
            self.append(v)
        return self

    def extra_repr(self):
        return "\n".join(f"({i}): {_param_repr(p)}" for i, p in enumerate(self))

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ParameterList is a container and has no forward; iterate over it")


class ParameterDict(_Keyed, Module):
    """A dict of parameters, registered under their (string) keys in insertion order."""

    def __init__(self, parameters=None):
        super().__init__()
        self._keys = {}
        if parameters is not None:
            self.update(parameters)

    def _check_key(self, key):
        if not isinstance(key, str):
            raise TypeError(f"ParameterDict keys must be strings, got {type(key).__name__}")

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(f"ParameterDict has no key {key!r} (keys: {list(self._keys)})")
        return getattr(self, key)

    def __setitem__(self, key, value):
        self._check_key(key)
        self._keys[key] = None
        setattr(self, key, _as_parameter(value))

    def __delitem__(self, key):
        self[key]
        del self._keys[key]
        delattr(self, key)

    def _names(self):
        return self._keys

    def values(self):
        return [self[k] for k in self._keys]

    def items(self):
        return [(k, self[k]) for k in self._keys]

    def get(self, key, default=None):
        return self[key] if key in self._keys else default

    def pop(self, key):
        v = self[key]
        del self[key]
        return v

    def clear(self):
        for k in list(self._keys):
            del self[k]

    def update(self, parameters):
        items = parameters.items() if hasattr(parameters, "items") else parameters
        for j, kv in enumerate(items):
            if not hasattr(parameters, "items") and len(kv) != 2:
                raise ValueError(f"ParameterDict update sequence element #{j} has length {len(kv)}; 2 is required")
            self[kv[0]] = kv[1]

    def extra_repr(self):
        return "\n".join(f"({k}): {_param_repr(p)}" for k, p in self.items())

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ParameterDict is a container and has no forward; index it by key")
