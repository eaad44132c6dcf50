"""Finite-difference checks of analytic gradients (float64 central differences), as torch.autograd.gradcheck."""
import numpy as np

from ..errors import AutogradError


def _as_tuple(x):
    return x if isinstance(x, tuple) else (tuple(x) if isinstance(x, list) else (x,))


def _diff_inputs(inputs):
    from ..tensor import Tensor
    return [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]


def _outputs(fn, inputs):
    from ..tensor import Tensor
    outs = _as_tuple(fn(*inputs))
    return [o for o in outs if isinstance(o, Tensor) and o.dtype.is_floating_point]


def _numerical(fn, inputs, idx, eps):
    """Jacobian blocks d out_j / d in_idx by central differences, each (out_numel, in_numel)."""
    from ..backend import to_numpy
    x = inputs[idx]
    arr = x._data  # perturbed in place, element by element (works for non-contiguous views too)
    cols = []
    for k in np.ndindex(arr.shape):  # grad mode stays on: fn may itself differentiate (gradgradcheck)
        orig = arr[k].item()
        arr[k] = orig + eps
        plus = [to_numpy(o._data).astype(np.float64).ravel() for o in _outputs(fn, inputs)]
        arr[k] = orig - eps
        minus = [to_numpy(o._data).astype(np.float64).ravel() for o in _outputs(fn, inputs)]
        arr[k] = orig
        cols.append([(p - m) / (2 * eps) for p, m in zip(plus, minus)])
    n_out = len(cols[0]) if cols else len(_outputs(fn, inputs))
    if not cols:
        return [np.zeros((o.numel(), 0)) for o in _outputs(fn, inputs)]
    return [np.stack([c[j] for c in cols], axis=1) for j in range(n_out)]


def _analytic(fn, inputs, diff_idx):
    """Full Jacobians through backward: one vector-Jacobian product per output element."""
    from ..tensor import _wrap
    from . import grad as autograd_grad
    outs = _outputs(fn, inputs)
    xs = [inputs[i] for i in diff_idx]
    jac = {(j, i): np.zeros((o.numel(), inputs[i].numel())) for j, o in enumerate(outs) for i in diff_idx}
    for j, o in enumerate(outs):
        xp = o._xp()
        for r in range(o.numel()):
            v = xp.zeros(o.numel(), dtype=o._data.dtype)
            v[r] = 1
            gs = autograd_grad([o], xs, grad_outputs=[_wrap(v.reshape(o._data.shape))], retain_graph=True,
                               allow_unused=True)
            for i, g in zip(diff_idx, gs):
                if g is not None:
                    jac[(j, i)][r] = g.numpy().astype(np.float64).ravel()
    return outs, jac


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True, nondet_tol=0.0):
    """True when the analytic gradients of `fn` at `inputs` match central differences (inputs float64)."""
    from ..tensor import Tensor
    inputs = _as_tuple(inputs)
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad and t.dtype.name != "float64":
            raise AutogradError(f"gradcheck expects float64 inputs for precision; got {t.dtype}")
    diff_idx = _diff_inputs(inputs)
    if not diff_idx:
        raise AutogradError("gradcheck: no input requires grad")
    outs, ana = _analytic(fn, inputs, diff_idx)
    for i in diff_idx:
        num = _numerical(fn, inputs, i, eps)
        for j in range(len(outs)):
            a, n = ana[(j, i)], num[j]
            if not np.allclose(a, n, atol=atol, rtol=rtol):
                if raise_exception:
                    err = np.abs(a - n).max()
                    raise AutogradError(f"Jacobian mismatch for output {j} with respect to input {i}: max abs error "
                                        f"{err:.3g}\nnumerical:\n{n}\nanalytical:\n{a}")
                return False
    return True


def gradgradcheck(fn, inputs, grad_outputs=None, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True):
    """Checks second derivatives: gradcheck of (inputs, v) -> grad(fn(inputs), inputs, v, create_graph=True)."""
    from .. import ops
    from . import grad as autograd_grad
    inputs = _as_tuple(inputs)
    diff_idx = _diff_inputs(inputs)
    outs = _outputs(fn, inputs)
    if grad_outputs is None:
        rng = np.random.default_rng(0)
        grad_outputs = [ops.creation.tensor(rng.standard_normal(o.shape), dtype=o.dtype, device=o.device,
                                            requires_grad=True) for o in outs]
    n_in = len(inputs)

    def first_grads(*args):
        xs, vs = args[:n_in], args[n_in:]
        os_ = _outputs(fn, xs)
        gs = autograd_grad(os_, [xs[i] for i in diff_idx], grad_outputs=list(vs), create_graph=True,
                           allow_unused=True)
        return tuple(g for g in gs if g is not None)

    return gradcheck(first_grads, tuple(inputs) + tuple(grad_outputs), eps=eps, atol=atol, rtol=rtol,
                     raise_exception=raise_exception)
