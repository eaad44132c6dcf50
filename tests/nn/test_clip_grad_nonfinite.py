"""clip_grad_norm_(error_if_nonfinite=True) raises a RuntimeError subclass, as PyTorch, and leaves the gradients."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core.errors import FlameError, NonFiniteError


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_norm_raises_a_runtime_error(device, bad):
    p = nn.Parameter(flame.zeros(3, device=device))
    p.grad = flame.tensor([1.0, bad, 0.0], device=device)
    with pytest.raises(RuntimeError, match="non-finite") as e:
        nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert isinstance(e.value, NonFiniteError) and isinstance(e.value, FlameError)
    g = p.grad.numpy()
    assert g[0] == 1.0 and not np.isfinite(g[1])  # untouched
