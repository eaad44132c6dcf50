"""Grad recording switches: no_grad, enable_grad, set_grad_enabled, inference_mode (context managers and decorators)."""
import functools


class _State:
    enabled = True
    inference = False
    anomaly = False       # anomaly detection (anomaly_mode.py): forward stacks recorded, backward errors annotated
    anomaly_nan = False   # ... and backward results checked for NaN


state = _State()


def is_grad_enabled():
    return state.enabled


def is_inference_mode_enabled():
    return state.inference


class _Mode:
    """Base: a context manager that is also a decorator (as in PyTorch), with or without parentheses:
    `@no_grad()` and `@no_grad` both work."""

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and cls is not set_grad_enabled:  # bare: @no_grad
            return cls()(args[0])
        return super().__new__(cls)

    def __call__(self, fn):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}() used as a decorator needs a function, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__(*self._args):
                return fn(*args, **kwargs)
        return wrapper

    _args = ()


class set_grad_enabled(_Mode):
    def __init__(self, mode=True):
        self._args = (mode,)
        self._prev = state.enabled
        state.enabled = bool(mode)  # PyTorch: takes effect at construction too

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        state.enabled = self._prev
        return False

    def __call__(self, fn):
        state.enabled = self._prev  # used as a decorator: undo the construction-time switch
        return super().__call__(fn)


class _Switch(_Mode):
    """Grad recording set to `_enabled` inside the block and restored after it."""
    _enabled = None

    def __enter__(self):
        self._prev = state.enabled
        state.enabled = self._enabled
        return self

    def __exit__(self, *exc):
        state.enabled = self._prev
        return False


class no_grad(_Switch):
    _enabled = False


class enable_grad(_Switch):
    _enabled = True


class inference_mode(_Mode):
    """Like no_grad (is_inference_mode_enabled() is True inside). The tensors made inside are not marked as PyTorch's
    inference tensors: they behave as tensors made under no_grad (usable in autograd afterwards)."""

    def __init__(self, mode=True):
        self._args = (mode,)
        self._mode = mode

    def __enter__(self):
        self._prev = (state.enabled, state.inference)
        if self._mode:
            state.enabled, state.inference = False, True
        return self

    def __exit__(self, *exc):
        state.enabled, state.inference = self._prev
        return False
