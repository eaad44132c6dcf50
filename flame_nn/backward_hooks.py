"""Module full backward hooks (PyTorch's register_full_backward_hook / register_full_backward_pre_hook).

A call of a module with such hooks routes its positional tensor inputs that require grad through one identity
Function and its tensor outputs through another. The outputs' node sees the gradients of the outputs first: it runs
the pre-hooks (`hook(module, grad_output)`, which may return replacements) and remembers grad_output. The inputs'
node then sees the gradients of the inputs: it runs `hook(module, grad_input, grad_output)`, whose returned tuple
replaces grad_input. Entries for tensors that need no gradient are None. When no input requires grad the hooks run
from the outputs' node with grad_input all None, as in PyTorch.
"""
from flame_core.autograd import Function, is_grad_enabled
from flame_core.tensor import Tensor


class _State:
    __slots__ = ("module", "n_inputs", "input_slots", "grad_outputs", "output_slots", "n_outputs")

    def __init__(self, module):
        self.module = module
        self.grad_outputs = None


def _apply_hooks(hooks, call, grads, what):
    """Run `call(hook, grads)` for each hook; a returned tuple replaces `grads` (PyTorch's RuntimeError when its
    length is wrong; `what` names the hook and the gradients in it)."""
    for hook in hooks:
        r = call(hook, grads)
        if r is None:
            continue
        r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
        if len(r) != len(grads):
            raise RuntimeError(f"Backward {what[0]} returned an invalid number of {what[1]}, got {len(r)}, but "
                               f"expected {len(grads)}")
        grads = r
    return grads


def _run_hooks(state, grad_inputs):
    module = state.module
    return _apply_hooks(list(module._backward_hooks.values()), lambda h, g: h(module, g, state.grad_outputs),
                        grad_inputs, ("hook", "grad_input"))


def _spread(grads, slots, n):
    """The gradients of the routed tensors at their slots among all `n` tensor arguments (None elsewhere)."""
    full = [None] * n
    for slot, g in zip(slots, grads):
        full[slot] = g
    return tuple(full)


class _Route(Function):
    """Identity on the routed tensors; the subclasses' backward runs the module's hooks on their gradients."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        out = tuple(t.detach() for t in tensors)
        return out if len(out) != 1 else out[0]


class _HookInputs(_Route):
    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        full = _run_hooks(state, _spread(grads, state.input_slots, state.n_inputs))
        return (None,) + tuple(full[slot] for slot in state.input_slots)


class _HookOutputs(_Route):
    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        module = state.module
        full = _apply_hooks(list(module._backward_pre_hooks.values()), lambda h, g: h(module, g),
                            _spread(grads, state.output_slots, state.n_outputs), ("pre hook", "grad_output"))
        state.grad_outputs = full
        if not state.input_slots and module._backward_hooks:  # no input needs a gradient: hooks run from here
            _run_hooks(state, (None,) * state.n_inputs)
        return (None,) + tuple(full[slot] for slot in state.output_slots)


def _needs_grad(t):
    return isinstance(t, Tensor) and t.requires_grad


def _route(fn, state, items):
    """(the number of tensors among `items`, the slots among them of those that require grad, `items` as a list
    with those routed through Function `fn`)."""
    tensor_pos = [i for i, a in enumerate(items) if isinstance(a, Tensor)]
    slots = [k for k, i in enumerate(tensor_pos) if items[i].requires_grad]
    items = list(items)
    if slots:
        picked = [tensor_pos[k] for k in slots]
        outs = fn.apply(state, *(items[i] for i in picked))
        for i, o in zip(picked, outs if isinstance(outs, tuple) else (outs,)):
            items[i] = o
    return len(tensor_pos), slots, items


def wrap_inputs(module, args):
    """(args with the grad-requiring tensors routed through the input node, the call's hook state) or (args, None)."""
    if not is_grad_enabled():
        return args, None
    state = _State(module)
    state.n_inputs, state.input_slots, routed = _route(_HookInputs, state, args)
    return (tuple(routed) if state.input_slots else args), state


def wrap_outputs(state, out):
    """The module's output with its grad-requiring tensors routed through the output node."""
    single = isinstance(out, Tensor)
    items = (out,) if single else tuple(out) if isinstance(out, (tuple, list)) else None
    if items is None:
        return out
    state.n_outputs, state.output_slots, items = _route(_HookOutputs, state, items)
    if not state.output_slots:
        return out
    if single:
        return items[0]
    return type(out)(items) if isinstance(out, list) or type(out) is tuple else type(out)(*items)
