"""Anomaly detection, PyTorch's torch.autograd.detect_anomaly / set_detect_anomaly: while it is on, every recorded
op keeps the stack of the code that made it, and backward names that code when a node's backward raises (a note on
the exception); with check_nan (the default) backward also raises as soon as a node's backward returns a gradient
holding NaN, naming the node and that code. For debugging: recording the stacks makes every op much slower."""
import traceback
import warnings

from ..errors import AutogradError
from .grad_mode import _Mode, state


def _switch(mode, check_nan):
    prev = (state.anomaly, state.anomaly_nan)
    state.anomaly, state.anomaly_nan = bool(mode), bool(mode and check_nan)
    return prev


class detect_anomaly(_Mode):
    """Context manager (and decorator) turning anomaly detection on."""

    def __init__(self, check_nan=True):
        self._args = (check_nan,)
        self.check_nan = check_nan
        warnings.warn("Anomaly Detection has been enabled. This mode will increase the runtime and should only be "
                      "enabled for debugging.", stacklevel=2)

    def __enter__(self):
        self._prev = _switch(True, self.check_nan)
        return self

    def __exit__(self, *exc):
        state.anomaly, state.anomaly_nan = self._prev
        return False


class set_detect_anomaly(_Mode):
    """Anomaly detection on or off (mode), from construction until the context ends (as set_grad_enabled)."""

    def __init__(self, mode, check_nan=True):
        self._args = (mode, check_nan)
        self._prev = _switch(mode, check_nan)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        state.anomaly, state.anomaly_nan = self._prev
        return False

    def __call__(self, fn):
        state.anomaly, state.anomaly_nan = self._prev   # used as a decorator: undo the construction-time switch
        return super().__call__(fn)


def is_anomaly_enabled():
    return state.anomaly


def is_anomaly_check_nan_enabled():
    return state.anomaly_nan


def forward_stack():
    """The stack of the code recording an op now (this function's and Function.apply's frames left out)."""
    return "".join(traceback.format_stack()[:-2])


def _where(node):
    trace = getattr(node, "_forward_stack", None)
    return (f"Traceback of the forward call that created {node.name()}:\n{trace}" if trace else
            f"{node.name()} was recorded before anomaly detection was enabled (no forward trace)")


def annotate(error, node):
    """Add the node's forward trace to an exception its backward raised."""
    error.add_note(f"Error detected in {node.name()}. " + _where(node))


def check_nan(node, grads):
    """Raise if a gradient that node's backward returned holds NaN."""
    for i, g in enumerate(grads):
        if g is None or not g.dtype.is_floating_point:
            continue
        a = g._data if g._data.dtype.itemsize >= 4 else g._data.astype("float32")   # (no 16-bit isnan on CuPy)
        if bool(g._xp().isnan(a).any()):
            raise AutogradError(f"Function '{node.name()}' returned nan values in its {i}th output.\n{_where(node)}")
