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


def _run_hooks(state, grad_inputs):
    module = state.module
    for hook in list(module._backward_hooks.values()):
        r = hook(module, grad_inputs, state.grad_outputs)
        if r is None:
            continue
        r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
        if len(r) != len(grad_inputs):
            raise RuntimeError(f"Backward hook returned an invalid number of grad_input, got {len(r)}, but expected "
                               f"{len(grad_inputs)}")
        grad_inputs = r
    return grad_inputs


class _HookInputs(Function):
    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        out = tuple(t.detach() for t in tensors)
        return out if len(out) != 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        full = [None] * state.n_inputs
        for slot, g in zip(state.input_slots, grads):
            full[slot] = g
        full = _run_hooks(state, tuple(full))
        return (None,) + tuple(full[slot] for slot in state.input_slots)


class _HookOutputs(Function):
    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        out = tuple(t.detach() for t in tensors)
        return out if len(out) != 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        module = state.module
        full = [None] * state.n_outputs
        for slot, g in zip(state.output_slots, grads):
            full[slot] = g
        full = tuple(full)
        for hook in list(module._backward_pre_hooks.values()):
            r = hook(module, full)
            if r is None:
                continue
            r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
            if len(r) != len(full):
                raise RuntimeError(f"Backward pre hook returned an invalid number of grad_output, got {len(r)}, but "
                                   f"expected {len(full)}")
            full = r
        state.grad_outputs = full
        if not state.input_slots and module._backward_hooks:  # no input needs a gradient: hooks run from here
            _run_hooks(state, (None,) * state.n_inputs)
        return (None,) + tuple(full[slot] for slot in state.output_slots)


def _needs_grad(t):
    return isinstance(t, Tensor) and t.requires_grad


def wrap_inputs(module, args):
    """(args with the grad-requiring tensors routed through the input node, the call's hook state) or (args, None)."""
    if not is_grad_enabled():
        return args, None
    state = _State(module)
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    state.n_inputs = len(tensor_pos)
    state.input_slots = [k for k, i in enumerate(tensor_pos) if args[i].requires_grad]
    if state.input_slots:
        picked = [tensor_pos[k] for k in state.input_slots]
        outs = _HookInputs.apply(state, *(args[i] for i in picked))
        outs = outs if isinstance(outs, tuple) else (outs,)
        args = list(args)
        for i, o in zip(picked, outs):
            args[i] = o
        args = tuple(args)
    return args, state


def wrap_outputs(state, out):
    """The module's output with its grad-requiring tensors routed through the output node."""
    single = isinstance(out, Tensor)
    items = (out,) if single else tuple(out) if isinstance(out, (tuple, list)) else None
    if items is None:
        return out
    tensor_pos = [i for i, o in enumerate(items) if isinstance(o, Tensor)]
    state.n_outputs = len(tensor_pos)
    state.output_slots = [k for k, i in enumerate(tensor_pos) if items[i].requires_grad]
    if not state.output_slots:
        return out
    picked = [tensor_pos[k] for k in state.output_slots]
    wrapped = _HookOutputs.apply(state, *(items[i] for i in picked))
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    items = list(items)
    for i, w in zip(picked, wrapped):
        items[i] = w
    if single:
        return items[0]
    return type(out)(items) if isinstance(out, list) or type(out) is tuple else type(out)(*items)
