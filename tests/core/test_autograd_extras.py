"""Anomaly detection (flame_core.autograd.anomaly_mode) and the autograd.functional / grad options' behaviour beyond
the values the golden test checks against PyTorch (test_torch_surface_golden.py: the af_* and grad_* cases)."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import autograd
from flame_core.autograd import functional as AF


def test_anomaly_mode_names_the_op_and_the_line_that_made_nan(device):
    x = flame.tensor([0.0, 1.0], device=device, requires_grad=True)
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        mode = autograd.detect_anomaly()
    with mode:
        assert autograd.is_anomaly_enabled() and autograd.is_anomaly_check_nan_enabled()
        y = flame.sqrt(x)   # the line the error must name
        with pytest.raises(RuntimeError, match=r"Function 'SqrtBackward' returned nan values in its 0th output"
                                               r"(.|\n)*y = flame.sqrt\(x\)"):
            (y * 0).sum().backward()
    assert not autograd.is_anomaly_enabled()
    flame.sqrt(x).mul(0).sum().backward()   # off: NaN passes silently, as PyTorch's
    assert np.isnan(x.grad.cpu().numpy()).any()


def test_anomaly_mode_annotates_errors_of_a_backward(device):
    class Broken(autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            raise ValueError("broken backward")

    x = flame.ones(2, device=device, requires_grad=True)
    with autograd.set_detect_anomaly(True, check_nan=False):
        assert autograd.is_anomaly_enabled() and not autograd.is_anomaly_check_nan_enabled()
        y = Broken.apply(x)
        with pytest.raises(ValueError, match="broken backward") as info:
            y.sum().backward()
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Error detected in BrokenBackward" in notes and "y = Broken.apply(x)" in notes


def test_anomaly_mode_as_a_decorator_and_for_graphs_made_before(device):
    x = flame.tensor([0.0], device=device, requires_grad=True)
    y = flame.sqrt(x) * 0   # recorded while anomaly detection was off: no forward trace

    @autograd.set_detect_anomaly(True)
    def run():
        assert autograd.is_anomaly_enabled()
        y.sum().backward()

    with pytest.raises(RuntimeError, match="recorded before anomaly detection was enabled"):
        run()
    assert not autograd.is_anomaly_enabled()


def test_functional_checks_and_modes(device):
    x = flame.tensor([1.0, 2.0], dtype=flame.float64, device=device)
    with pytest.raises(RuntimeError, match="independent of input 1"):
        AF.jacobian(lambda a, b: a * 2, (x, x.clone()), strict=True)
    j = AF.jacobian(lambda a, b: a * 2, (x, x.clone()))
    assert not j[1].cpu().numpy().any() and j[0].cpu().numpy().tolist() == [[2.0, 0.0], [0.0, 2.0]]
    with pytest.raises(NotImplementedError, match="vmap"):
        AF.jacobian(lambda a: a, x, vectorize=True)
    with pytest.raises(NotImplementedError, match="reverse-mode only"):
        AF.jacobian(lambda a: a, x, strategy="forward-mode")
    with pytest.raises(flame.ShapeError, match="v can be left out only"):
        AF.vjp(lambda a: a * 2, x)
    out, g = AF.vjp(lambda a: (a * a).sum(), x)
    assert g.cpu().numpy().tolist() == [2.0, 4.0] and not out.requires_grad and not g.requires_grad
    with pytest.raises(flame.ShapeError, match="single one-element tensor"):
        AF.hessian(lambda a: a * 2, x)
    h = AF.hessian(lambda a: (a ** 3).sum(), x)
    np.testing.assert_allclose(h.cpu().numpy(), np.diag([6.0, 12.0]))


def test_grad_batched_and_materialized_checks(device):
    x = flame.tensor([1.0, 2.0], dtype=flame.float64, device=device, requires_grad=True)
    y = flame.tensor([3.0], dtype=flame.float64, device=device, requires_grad=True)
    out = x * x
    eye = flame.eye(2, dtype=flame.float64, device=device)
    (rows,) = autograd.grad(out, x, eye, retain_graph=True, is_grads_batched=True)   # the Jacobian, row by row
    np.testing.assert_array_equal(rows.cpu().numpy(), np.diag([2.0, 4.0]))
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        autograd.grad(out, (x, y), eye, retain_graph=True, is_grads_batched=True)
    gx, gy = autograd.grad(out.sum(), (x, y), materialize_grads=True)
    assert gy.cpu().numpy().tolist() == [0.0] and gx.cpu().numpy().tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="allow_unused"):
        autograd.grad((x * 2).sum(), (x, y), allow_unused=False, materialize_grads=True)


def test_anomaly_mode_checks_half_precision_gradients(device):
    x = flame.tensor([0.0, 1.0], dtype=flame.bfloat16, device=device, requires_grad=True)
    with autograd.set_detect_anomaly(True):
        y = flame.sqrt(x)
        with pytest.raises(RuntimeError, match="returned nan values"):
            (y * 0).sum().backward()
