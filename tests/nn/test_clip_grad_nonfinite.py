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


def test_the_2_norm_makes_no_temporary_the_size_of_the_gradients():
    # a pool at its budget after the backward (SD3.5-Large under 4 GiB) had no room for acc * acc of the LoRA's
    # 45 MiB flat gradient buffer; the norm is a dot product now
    import tracemalloc
    p = nn.Parameter(flame.zeros(1 << 20))
    p.grad = flame.tensor(np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32))
    want = float(np.sqrt((p.grad.numpy().astype(np.float64) ** 2).sum()))
    tracemalloc.start()
    try:
        norm = nn.utils.clip_grad_norm_([p], 1e9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20)  # the gradient is 4 MiB
    np.testing.assert_allclose(float(norm), want, rtol=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf"), -float("inf"), 0.0])
def test_a_large_gradient_is_reduced_slice_by_slice_to_the_same_norm(device, monkeypatch, norm_type):
    """Gradients above clip_grad._CHUNK elements are reduced a slice at a time (bounded temporaries): the norm is
    the whole array's."""
    import math

    from flame_nn.utils import clip_grad as C
    rng = np.random.default_rng(0)
    g = rng.standard_normal(1000).astype(np.float32)
    g[rng.random(1000) < 0.3] = 0
    p = flame.zeros(1000, device=device, requires_grad=True)
    p.grad = flame.tensor(g, device=device)
    want = float(nn.utils.get_total_norm([p.grad], norm_type))
    monkeypatch.setattr(C, "_CHUNK", 64)
    got = float(nn.utils.get_total_norm([p.grad], norm_type))
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)
