"""torch.autograd.functional: vjp, jvp, jacobian, hessian, vhp and hvp of a function of tensors, on FLAME's
reverse-mode autograd (jvp and hvp by the double-backward trick: the vjp's linear dependence on its cotangent is
differentiated once more). `inputs` and the function's outputs are a Tensor or a tuple of Tensors, and results nest
as PyTorch's. create_graph=True keeps the results differentiable; strict=True raises where an output does not depend
on an input (else its part is zeros). The Jacobians are built row by row: vectorize=True (PyTorch's vmap path) and
the forward-mode strategies are not available."""
from ..errors import AutogradError, ShapeError
from ..tensor import Tensor
from .grad_mode import enable_grad


def _as_tuple(x, what):
    single = isinstance(x, Tensor)
    xs = (x,) if single else tuple(x)
    if not all(isinstance(t, Tensor) for t in xs):
        raise TypeError(f"The {what} must be a Tensor or a tuple of Tensors")
    return xs, single


def _prepare(inputs, create_graph):
    """Inputs that require grad: views keeping their history (create_graph) or detached copies of the values."""
    return tuple(t.view_as(t) if create_graph and t.requires_grad else t.detach().requires_grad_() for t in inputs)


def _grads(outputs, inputs, grad_outputs, create_graph, strict, what):
    from . import grad
    live = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not live:
        res = (None,) * len(inputs)
    else:
        res = grad([o for o, _ in live], inputs, [g for _, g in live], retain_graph=True, create_graph=create_graph,
                   allow_unused=True)
    out = []
    for i, (r, x) in enumerate(zip(res, inputs)):
        if r is None:
            if strict:
                raise AutogradError(f"The output of the user-provided function is independent of input {i}. This is "
                                    f"not allowed in strict mode{what}.")
            r = x.detach() * 0
        out.append(r)
    return tuple(out)


def _check_v(v, like, name):
    vs, _ = _as_tuple(v, name)
    if len(vs) != len(like):
        raise ShapeError(f"v has {len(vs)} tensors but the {name} have {len(like)}")
    for a, b in zip(vs, like):
        if tuple(a.shape) != tuple(b.shape):
            raise ShapeError(f"v has a tensor of shape {tuple(a.shape)} where the {name} have {tuple(b.shape)}")
    return vs


def _call(func, xs, create_graph):
    with enable_grad():
        out = func(*xs)
    outs, single = _as_tuple(out, "outputs of the user-provided function")
    return outs, single


def _finish(t, create_graph):
    return tuple(x if create_graph else x.detach() for x in t)


def vjp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T J): the vector-Jacobian product; v may be left out for a one-element output."""
    xs, single_in = _as_tuple(inputs, "inputs")
    xs = _prepare(xs, create_graph)
    outs, single_out = _call(func, xs, create_graph)
    if v is None:
        if len(outs) != 1 or outs[0].numel() != 1:
            raise ShapeError("vjp: v can be left out only when the function returns a single one-element tensor")
        vs = (outs[0].detach() * 0 + 1,)
    else:
        vs = _check_v(v, outs, "outputs")
    res = _finish(_grads(outs, xs, vs, create_graph, strict, ""), create_graph)
    outs = _finish(outs, create_graph)
    return (outs[0] if single_out else outs), (res[0] if single_in else res)


def jvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), J v): the Jacobian-vector product (v may be left out for a one-element input)."""
    xs, single_in = _as_tuple(inputs, "inputs")
    xs = _prepare(xs, create_graph)
    outs, single_out = _call(func, xs, create_graph)
    if v is None:
        if len(xs) != 1 or xs[0].numel() != 1:
            raise ShapeError("jvp: v can be left out only when the input is a single one-element tensor")
        vs = (xs[0].detach() * 0 + 1,)
    else:
        vs = _check_v(v, xs, "inputs")
    with enable_grad():
        us = tuple((o.detach() * 0).requires_grad_() for o in outs)   # the cotangents the vjp is linear in
        g = _grads(outs, xs, us, True, strict, "")
    from . import grad
    live = [(gi, vi) for gi, vi in zip(g, vs) if gi.requires_grad]
    res = grad([a for a, _ in live], us, [b for _, b in live], create_graph=create_graph, allow_unused=True) \
        if live else (None,) * len(us)
    res = _finish(tuple(r if r is not None else o.detach() * 0 for r, o in zip(res, outs)), create_graph)
    outs = _finish(outs, create_graph)
    return (outs[0], res[0]) if single_out else (outs, res)


def _reject(vectorize, strategy):
    if vectorize:
        raise NotImplementedError("vectorize=True needs vmap, which FLAME does not have; vectorize=False builds the "
                                  "same Jacobian row by row")
    if strategy != "reverse-mode":
        raise NotImplementedError(f"strategy {strategy!r}: FLAME's autograd is reverse-mode only")


def jacobian(func, inputs, create_graph=False, strict=False, vectorize=False, strategy="reverse-mode"):
    """The Jacobian of func at inputs: for each output and input, a tensor of shape output.shape + input.shape
    (nested in tuples as the outputs and inputs are)."""
    _reject(vectorize, strategy)
    xs, single_in = _as_tuple(inputs, "inputs")
    xs = _prepare(xs, create_graph)
    outs, single_out = _call(func, xs, create_graph)
    from ..ops.shape import stack
    per_out = []
    for o in outs:
        flat = o.reshape(-1)
        rows = [[] for _ in xs]
        for k in range(flat.shape[0]):
            onehot = flat.detach() * 0
            onehot[k] = 1
            for j, r in enumerate(_grads((flat,), xs, (onehot,), create_graph, strict, " for jacobian")):
                rows[j].append(r)
        jac = tuple((stack(r) if r else xs[j].new_zeros((0,) + tuple(xs[j].shape))).reshape(
            tuple(o.shape) + tuple(xs[j].shape)) for j, r in enumerate(rows))
        per_out.append(_finish(jac, create_graph))
    per_out = [p[0] if single_in else p for p in per_out]
    return per_out[0] if single_out else tuple(per_out)


def hessian(func, inputs, create_graph=False, strict=False, vectorize=False, outer_jacobian_strategy="reverse-mode"):
    """The Hessian of a function returning one element: for each pair of inputs, input_i.shape + input_j.shape."""
    _reject(vectorize, outer_jacobian_strategy)
    xs, single_in = _as_tuple(inputs, "inputs")

    def gradient(*args):
        outs, _ = _call(func, args, True)
        if len(outs) != 1 or outs[0].numel() != 1:
            raise ShapeError("hessian: the function must return a single one-element tensor")
        return _grads(outs, args, (outs[0].detach() * 0 + 1,), True, strict, " for hessian")

    h = jacobian(gradient, xs, create_graph=create_graph, strict=strict)
    return h[0][0] if single_in else h


def vhp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T H) for a function returning one element."""
    xs, single_in = _as_tuple(inputs, "inputs")
    xs = _prepare(xs, True)
    outs, _ = _call(func, xs, True)
    if len(outs) != 1 or outs[0].numel() != 1:
        raise ShapeError("vhp / hvp: the function must return a single one-element tensor")
    g = _grads(outs, xs, (outs[0].detach() * 0 + 1,), True, strict, "")
    vs = _check_v(v, xs, "inputs") if v is not None else None
    if vs is None:
        if len(xs) != 1 or xs[0].numel() != 1:
            raise ShapeError("vhp / hvp: v can be left out only for a single one-element input")
        vs = (xs[0].detach() * 0 + 1,)
    res = _finish(_grads(g, xs, vs, create_graph, strict, " (double backward)"), create_graph)
    out = outs[0] if create_graph else outs[0].detach()
    return out, (res[0] if single_in else res)


def hvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), H v) for a function returning one element (H is symmetric: the same numbers as vhp)."""
    return vhp(func, inputs, v, create_graph, strict)
