"""convert_conv2d_weight_memory_format: lay the weights of a module's Conv2d / ConvTranspose2d layers out in a memory
format (flame.channels_last or flame.contiguous_format), as PyTorch's torch.nn.utils.memory_format. The values and
shapes stay; the parameters keep their identity."""
import flame_core as flame
from flame_core import memory_formats

from ..layers import Conv2d, ConvTranspose2d


def convert_conv2d_weight_memory_format(module, memory_format):
    """Every Conv2d / ConvTranspose2d weight in `module` (itself included) re-laid in `memory_format`. Returns
    module."""
    memory_formats.check(memory_format, "convert_conv2d_weight_memory_format", allow_preserve=False)
    for m in module.modules():
        if isinstance(m, (Conv2d, ConvTranspose2d)):
            m.weight.data = flame.clone(m.weight.detach(), memory_format=memory_format)
    return module
