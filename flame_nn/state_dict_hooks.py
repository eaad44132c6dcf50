"""The hooks and extra state of Module.state_dict / load_state_dict, PyTorch's API:

  register_state_dict_pre_hook(hook(module, prefix, keep_vars))          before a module's entries are saved
  register_state_dict_post_hook(hook(module, state_dict, prefix, meta))  after them (and its children's); None back
  _register_state_dict_hook(hook(...))                                   the same, and a returned dict replaces it
  register_load_state_dict_pre_hook(hook(module, state_dict, prefix, meta, strict, missing_keys, unexpected_keys,
                                         error_msgs))                    before loading: may rename keys in place
  _register_load_state_dict_pre_hook(hook, with_module=False)            the same without the module argument
  register_load_state_dict_post_hook(hook(module, incompatible_keys))    after loading: may clear reported keys
  get_extra_state() / set_extra_state(state)                             a module's non-tensor state, saved under
                                                                         "<prefix>_extra_state"
The pre-hooks of load_state_dict run for every module (parent before children, each with its prefix) on a copy of
the given dict; an error message a hook appends fails the load. `meta` is {} (FLAME keeps no per-module versions)."""
from collections import OrderedDict

EXTRA_STATE = "_extra_state"
KINDS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def hooks(module, kind):
    """The module's hooks of `kind` (empty when none was ever registered)."""
    return module.__dict__.get(kind) or {}


def add(module, kind, hook, handle_cls):
    d = module.__dict__.get(kind)
    if d is None:
        d = module.__dict__[kind] = OrderedDict()
    h = handle_cls(d)
    d[h.id] = hook
    return h


def has_extra_state(module):
    from .module import Module
    return type(module).get_extra_state is not Module.get_extra_state


def save(module, dest, prefix, keep_vars):
    """module's entries (and its children's) into dest, with the hooks and extra state; returns dest (a private
    post-hook may replace it)."""
    for hook in list(hooks(module, "_state_dict_pre_hooks").values()):
        hook(module, prefix, keep_vars)
    for k, v in module._own_state_items(prefix, keep_vars):
        dest[k] = v
    if has_extra_state(module):
        dest[prefix + EXTRA_STATE] = module.get_extra_state()
    for name, child in module._modules.items():
        if child is not None:
            dest = save(child, dest, prefix + name + ".", keep_vars)
    for hook in list(hooks(module, "_state_dict_hooks").values()):
        out = hook(module, dest, prefix, {})
        if getattr(hook, "_public", False):
            if out is not None:
                raise RuntimeError("a state_dict post-hook must return None (it may change the state_dict in "
                                   "place)")
        elif out is not None:
            dest = out
    return dest


def run_load_pre_hooks(module, state_dict, strict):
    """Every module's load pre-hooks on `state_dict` (changed in place); returns (missing, unexpected, errors) the
    hooks added."""
    missing, unexpected, errors = [], [], []
    for prefix, m in module.named_modules(remove_duplicate=False):
        own = getattr(type(m), "_prepare_state_", None)   # a layer class's own entries (an fp8 Linear's)
        if own is not None:
            own(m, state_dict, prefix + "." if prefix else "", errors)
        for hook in list(hooks(m, "_load_state_dict_pre_hooks").values()):
            hook(m, state_dict, prefix + "." if prefix else "", {}, strict, missing, unexpected, errors)
    return missing, unexpected, errors


def extra_state_keys(module):
    """{key: module} of the modules with extra state."""
    return {(p + "." if p else "") + EXTRA_STATE: m for p, m in module.named_modules(remove_duplicate=False)
            if has_extra_state(m)}


def has_load_post_hooks(module):
    return any(hooks(m, "_load_state_dict_post_hooks") for m in module.modules())


def run_load_post_hooks(module, incompatible):
    for m in module.modules():
        for hook in list(hooks(m, "_load_state_dict_post_hooks").values()):
            if hook(m, incompatible) is not None:
                raise RuntimeError("a load_state_dict post-hook must return None (it may change the incompatible "
                                   "keys in place)")
