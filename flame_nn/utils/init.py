"""skip_init: build a module without initialising its parameters (PyTorch's torch.nn.utils.skip_init)."""
import inspect

from ..empty_init import empty_init
from ..module import Module


def skip_init(module_cls, *args, **kwargs):
    """module_cls(*args, **kwargs) with parameters of uninitialised storage (built as meta placeholders under
    empty_init, no random draw, then given memory on `device`); buffers are made as the module makes them. The class
    must take a `device` argument, as PyTorch requires."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, Module)):
        raise RuntimeError(f"Expected a Module; got {module_cls}")
    if "device" not in inspect.signature(module_cls).parameters:
        raise RuntimeError("Module must support a 'device' arg to skip initialization")
    device = kwargs.get("device")
    with empty_init(device=device):
        module = module_cls(*args, **kwargs)
    return module.to_empty(device=device)
