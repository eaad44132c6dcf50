"""flame_core.kernels, the launch API for fused ops written above flame_core: Tensors in, kernels of cuda_src out."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional as F
from flame_core import kernels


def test_use_kernel_takes_tensors_and_says_no_off_the_gpu():
    x = flame.randn(8, device="cpu")
    assert kernels.use_kernel(x) is False            # a cpu tensor: the caller takes its reference path
    assert kernels.use_kernel(x, None) is False
    with kernels.reference():
        assert kernels.enabled() is False


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [flame.float32, flame.bfloat16])
def test_a_fused_op_through_the_public_api_matches_the_library(dt):
    """The fused-op recipe of docs/INTERNALS.md: a kernel of cuda_src launched on Tensors gives F.silu's bits."""
    x = flame.randn(3, 1000, device="cuda").to(dt)
    assert kernels.use_kernel(x)
    y = flame.empty_like(x)
    n = x.numel()
    k = kernels.get_function("activations", "silu_fwd<{T}, 1>", x.dtype)   # a flame dtype
    kernels.launch(k, kernels.grid_1d(n // (16 // x.element_size()), 256), (256,), (x, y, kernels.i64(n)))
    want = F.silu(x)
    np.testing.assert_array_equal(y.float().numpy(), want.float().numpy())
