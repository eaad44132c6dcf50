"""parameters_to_vector / vector_to_parameters: all parameters as one flat vector and back."""
from flame_core.autograd import no_grad
from flame_core.errors import DeviceError
from flame_core.tensor import Tensor

from .grads import as_list


def _one_device(op, params):
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise DeviceError(f"{op}: found parameters on different devices ({', '.join(sorted(map(str, devices)))})")


def parameters_to_vector(parameters):
    """All parameters flattened and concatenated into one 1-D tensor (differentiable, as in PyTorch)."""
    from flame_core.ops.shape import cat
    params = as_list(parameters)
    _one_device("parameters_to_vector", params)
    return cat([p.reshape(-1) for p in params])


def vector_to_parameters(vec, parameters):
    """Copy consecutive slices of the 1-D `vec` into the parameters, in order. (PyTorch makes each parameter a view of
    `vec`; here the values are copied into the parameters' own storage, which optimizers and the gradient pool hold
    on to.)"""
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected a Tensor for vec, but got {type(vec).__name__}")
    params = as_list(parameters)
    _one_device("vector_to_parameters", params + [vec])
    total = sum(p.numel() for p in params)
    if vec.ndim != 1 or vec.numel() != total:
        raise ValueError(f"vector_to_parameters: vec of shape {tuple(vec.shape)} must be 1-D with {total} elements "
                         f"(the parameters' total)")
    with no_grad():
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(vec[offset:offset + n].reshape(tuple(p.shape)))
            offset += n
