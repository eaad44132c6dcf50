"""functional_call: run a module with some of its parameters and buffers replaced for one call (torch.func's
functional_call semantics; also torch.nn.utils.stateless' name). The replacements go into the module's registries
and attributes and the originals come back afterwards, even when the call raises."""
from .parametrize import is_parametrized

_MISSING = object()  # the attribute did not exist before the call


def _tied_groups(module):
    """name -> every name (parameters and buffers, duplicates kept) that refers to the same tensor."""
    by_id = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _merge(parameter_and_buffer_dicts):
    dicts = [parameter_and_buffer_dicts] if isinstance(parameter_and_buffer_dicts, dict) else \
        list(parameter_and_buffer_dicts)
    merged = {}
    for d in dicts:
        repeated = [k for k in d if k in merged]
        if repeated:
            raise ValueError(f"{repeated} appeared in multiple dictionaries; behavior of functional call is ambiguous")
        merged.update(d)
    return merged


def _expand_tied(values, groups):
    """values with every name tied to a given one added (ValueError when tied names were given different values)."""
    out = dict(values)
    for key, value in values.items():
        for other in groups.get(key, ()):
            if other in values and values[other] is not value:
                given = sorted(set(groups[key]) & set(values))
                raise ValueError(f"functional_call got multiple values for keys {given}, which are tied. Consider "
                                 f"using tie_weights=False")
            out[other] = value
    return out


def _swap(module, path, value):
    """Put `value` at `path` (a.b.name); returns how to undo it."""
    owner = module
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise AttributeError(f"{type(owner).__name__} has no attribute `{part}`")
        owner = getattr(owner, part)
    if is_parametrized(owner, name):
        raise ValueError(f"functional_call: '{path}' is parametrized; pass its original(s) "
                         f"('...parametrizations.{name}.original') to replace it")
    d = owner.__dict__
    registry = next((r for r in (d["_parameters"], d["_buffers"]) if name in r), None)
    undo = (owner, name, registry, d.get(name, _MISSING))
    if registry is not None:
        registry[name] = value
    d[name] = value
    return undo


def functional_call(module, parameter_and_buffer_dicts, args=None, kwargs=None, *, tie_weights=True, strict=False):
    """module(*args, **kwargs) with the parameters and buffers named in `parameter_and_buffer_dicts` (a dict or a
    sequence of dicts with distinct keys, state_dict names) replaced by the given tensors for this call. tie_weights:
    a value given for one of several names of one tensor replaces it under all of them. strict: every parameter and
    buffer must be given and no other name; else names the module lacks become attributes for the call."""
    values = _merge(parameter_and_buffer_dicts)
    groups = _tied_groups(module)
    if tie_weights:
        values = _expand_tied(values, groups)
    if strict:
        unexpected = [k for k in values if k not in groups]
        missing = [k for k in groups if k not in values]
        if unexpected or missing:
            lines = [f"{what} key(s): {', '.join(repr(k) for k in keys)}."
                     for what, keys in (("Unexpected", unexpected), ("Missing", missing)) if keys]
            raise RuntimeError(f"Error(s) in reparametrizing for {module._get_name()}:\n\t" + "\n\t".join(lines))
    args = () if args is None else args if isinstance(args, tuple) else (args,)
    undo = []
    try:
        for path, value in values.items():
            undo.append(_swap(module, path, value))
        return module(*args, **(kwargs or {}))
    finally:
        for owner, name, registry, old in reversed(undo):
            if registry is not None:
                registry[name] = old
            if old is _MISSING:
                del owner.__dict__[name]
            else:
                owner.__dict__[name] = old
