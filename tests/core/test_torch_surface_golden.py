"""PyTorch's math functions, order statistics, arranging helpers, tensor products and finding / counting functions
(flame_core.ops.math_ops, order_stats, arrangement, products, binning) against golden outputs and gradients made
with PyTorch (tests/fixtures/make_torch_surface_fixtures.py): the same case code (tests/core/torch_surface_cases.py)
runs with lib = flame_core here. Values within 1e-10 (float64), NaN where PyTorch has NaN, the same dtype kind and
shape; gradients of sum(out * go) likewise (None where PyTorch gives none)."""
import os
import sys
import types

import pytest

import flame_core as flame
import flame_nn.functional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from golden_cases import check_case  # noqa: E402
from torch_surface_cases import CASES  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "torch_surface.safetensors")


class _Flame(types.ModuleType):
    """flame_core with `nn.functional` = flame_nn.functional: the cases' `L` for FLAME (torch.nn.functional's place)."""

    def __getattr__(self, name):
        return getattr(flame, name)


LIB = _Flame("flame_surface")
LIB.nn = types.SimpleNamespace(functional=flame_nn.functional)


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    fn, names, grad, *tol = CASES[case]
    check_case(case, golden, LIB, fn, names, grad, device,
               out_tol=(tol[0] if tol else 1e-10, tol[1] if len(tol) > 1 else 1e-12),
               grad_tol=(max(1e-9, tol[0]) if tol else 1e-9, tol[1] if len(tol) > 1 else 1e-11))
