"""Tape-based autograd: Function, backward/grad, grad modes, gradient checking."""
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


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, allow_unused=False):
    """Gradients of `outputs` with respect to `inputs` (a tuple), without touching `.grad`."""
    from ..tensor import Tensor
    single_out = isinstance(outputs, Tensor)
    outputs = [outputs] if single_out else list(outputs)
    if grad_outputs is not None and isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if retain_graph is None:
        retain_graph = create_graph
    grads = _make_grads(outputs, grad_outputs)
    res = run_backward(outputs, grads, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
                       allow_unused=allow_unused)
    if not create_graph:
        res = [None if r is None else r.detach() for r in res]
    return tuple(res)


__all__ = ["Function", "Node", "AccumulateGrad", "no_grad", "enable_grad", "set_grad_enabled", "inference_mode",
           "is_grad_enabled", "is_inference_mode_enabled", "backward", "grad", "gradcheck", "gradgradcheck",
           "queue_callback", "current_pass"]
