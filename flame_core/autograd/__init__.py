"""Tape-based autograd: Function, backward/grad, grad modes, gradient checking."""
from ..errors import AutogradError
from . import functional
from .anomaly_mode import detect_anomaly, is_anomaly_check_nan_enabled, is_anomaly_enabled, set_detect_anomaly
from .engine import current_pass, queue_callback, run_backward
from .function import AccumulateGrad, Function, Node
from .grad_mode import (
    enable_grad,
    inference_mode,
    is_grad_enabled,
    is_inference_mode_enabled,
    no_grad,
    set_grad_enabled,
)
from .gradcheck import gradcheck, gradgradcheck


def _make_grads(outputs, grad_outputs):
    from ..errors import AutogradError, ShapeError, fmt_shape
    from ..tensor import Tensor, _wrap
    grads = []
    for k, o in enumerate(outputs):
        g = grad_outputs[k] if grad_outputs is not None else None
        if g is None:
            if o.numel() != 1:
                raise AutogradError(f"grad can be implicitly created only for scalar outputs; output {k} has shape "
                                    f"{fmt_shape(o.shape)} (pass gradient=... of that shape)")
            xp = o._xp()
            g = _wrap(xp.ones(o._data.shape, dtype=o._data.dtype))
        elif not isinstance(g, Tensor):
            g = _wrap(o._xp().asarray(g, dtype=o._data.dtype))
        if g.shape != o.shape:
            raise ShapeError(f"gradient of shape {fmt_shape(g.shape)} does not match output of shape "
                             f"{fmt_shape(o.shape)}")
        grads.append(g)
    return grads


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    from ..tensor import Tensor
    if isinstance(tensors, Tensor):
        tensors = [tensors]
        if grad_tensors is not None and not isinstance(grad_tensors, (list, tuple)):
            grad_tensors = [grad_tensors]
    tensors = list(tensors)
    if retain_graph is None:
        retain_graph = create_graph
    grads = _make_grads(tensors, grad_tensors)
    run_backward(tensors, grads, retain_graph=retain_graph, create_graph=create_graph)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
         allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """Gradients of `outputs` with respect to `inputs` (a tuple), without touching `.grad`. is_grads_batched: each
    grad_outputs tensor has a leading batch dim and the results get one (one backward per batch entry);
    materialize_grads: inputs the outputs do not depend on get zeros instead of None (allow_unused implied)."""
    from ..tensor import Tensor
    if not only_inputs:
        raise AutogradError("grad: only_inputs=False is not supported (it was deprecated and ignored by PyTorch)")
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when materialize_grads=True, but got: "
                         "allow_unused=False.")
    allow_unused = bool(allow_unused) or materialize_grads
    single_out = isinstance(outputs, Tensor)
    outputs = [outputs] if single_out else list(outputs)
    if grad_outputs is not None and isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if retain_graph is None:
        retain_graph = create_graph
    if is_grads_batched:
        return _batched_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                             materialize_grads)
    grads = _make_grads(outputs, grad_outputs)
    res = run_backward(outputs, grads, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
                       allow_unused=allow_unused)
    if not create_graph:
        res = [None if r is None else r.detach() for r in res]
    if materialize_grads:
        res = [x.detach() * 0 if r is None else r for r, x in zip(res, inputs)]
    return tuple(res)


def _batched_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads):
    """grad with a leading batch dim on every grad_outputs tensor: one pass per entry, the results stacked."""
    from ..ops.shape import stack
    if grad_outputs is None:
        raise AutogradError("grad: is_grads_batched=True needs grad_outputs")
    n = {g.shape[0] if g.ndim else None for g in grad_outputs}
    if len(n) != 1 or None in n:
        raise AutogradError("grad: with is_grads_batched=True every grad_outputs tensor needs the same leading batch "
                            "dim")
    n = n.pop()
    rows = [grad(outputs, inputs, [g[k] for g in grad_outputs], retain_graph=retain_graph or k < n - 1,
                 create_graph=create_graph, allow_unused=True, materialize_grads=materialize_grads)
            for k in range(n)]
    out = []
    for i, x in enumerate(inputs):
        col = [r[i] for r in rows]
        if any(c is None for c in col):
            if not allow_unused:
                raise AutogradError(f"One of the differentiated Tensors (input {i}) appears to not have been used in "
                                    f"the graph. Set allow_unused=True if this is the desired behavior.")
            out.append(None)
        else:
            out.append(stack(col) if n else x.detach().new_zeros((0,) + tuple(x.shape)))
    return tuple(out)


__all__ = ["Function", "Node", "AccumulateGrad", "no_grad", "enable_grad", "set_grad_enabled", "inference_mode",
           "is_grad_enabled", "is_inference_mode_enabled", "backward", "grad", "gradcheck", "gradgradcheck",
           "queue_callback", "current_pass", "functional", "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
           "is_anomaly_check_nan_enabled"]
