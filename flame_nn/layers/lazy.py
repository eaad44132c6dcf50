"""Lazy modules: the input size comes from the first forward. That call builds the full module's parameters and
buffers from it and the module becomes that class (PyTorch's cls_to_become): LazyLinear, LazyBatchNorm1d / 2d / 3d.
Before it there is nothing to save or load (PyTorch's UninitializedParameter is not modelled)."""
from ..module import Module, StateDictError, to_target
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, _BatchNorm
from .linear import Linear


class _LazyModule(Module):
    cls_to_become = None

    def __init__(self, **kwargs):
        super().__init__()
        self._lazy_kwargs = kwargs                              # cls_to_become's arguments besides the input size

    def _input_size(self, input):
        raise NotImplementedError

    def to(self, *args, **kwargs):
        """Before the first forward: where and in which dtype the parameters will be made (as PyTorch's
        uninitialised parameters move); after it, Module.to."""
        if "_lazy_kwargs" in self.__dict__:
            dev, dt = to_target(args, kwargs)
            self._lazy_kwargs.update({k: v for k, v in (("device", dev), ("dtype", dt)) if v is not None})
        return super().to(*args, **kwargs)

    def forward(self, input, *args, **kwargs):
        full = self.cls_to_become(self._input_size(input), **self._lazy_kwargs)
        del self._lazy_kwargs
        for name, p in full._parameters.items():
            self.register_parameter(name, p)
        for name, b in full._buffers.items():
            self.register_buffer(name, b, persistent=name not in full._non_persistent_buffers_set)
        registered = set(full._parameters) | set(full._buffers) | set(full._modules)
        self.__dict__.update({k: v for k, v in vars(full).items()
                              if not k.startswith("_") and k not in registered and k != "training"})
        self.__class__ = self.cls_to_become
        return self.forward(input, *args, **kwargs)

    def _own_state_items(self, prefix="", keep_vars=True):
        raise StateDictError(f"{type(self).__name__}{'' if not prefix else f' ({prefix[:-1]})'} has no parameters "
                             f"before its first forward (its input size is inferred there): run it once before "
                             f"state_dict / load_state_dict")


class LazyLinear(_LazyModule):
    """Linear whose in_features is the last size of the first input."""
    cls_to_become = Linear

    def __init__(self, out_features, bias=True, device=None, dtype=None):
        super().__init__(out_features=out_features, bias=bias, device=device, dtype=dtype)
        self.in_features, self.out_features = 0, out_features

    def _input_size(self, input):
        return input.shape[-1]

    def extra_repr(self):
        return f"in_features=0, out_features={self.out_features}, bias={self._lazy_kwargs['bias']}"


class _LazyBatchNorm(_LazyModule):
    """BatchNorm whose num_features is dimension 1 of the first input."""

    def __init__(self, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None, dtype=None, *,
                 bias=True):
        super().__init__(eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.num_features, self.eps, self.momentum = 0, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats

    def _input_size(self, input):
        self.num_features = input.shape[1] if input.ndim > 1 else 0   # the channel check holds by construction
        _BatchNorm._check_input_dim(self, input)
        return input.shape[1]

    extra_repr = _BatchNorm.extra_repr


class LazyBatchNorm1d(_LazyBatchNorm):
    cls_to_become, _dims = BatchNorm1d, BatchNorm1d._dims


class LazyBatchNorm2d(_LazyBatchNorm):
    cls_to_become, _dims = BatchNorm2d, BatchNorm2d._dims


class LazyBatchNorm3d(_LazyBatchNorm):
    cls_to_become, _dims = BatchNorm3d, BatchNorm3d._dims
