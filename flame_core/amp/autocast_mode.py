"""autocast: regions where matmul-class ops run in bf16/fp16 and precision-sensitive ops in float32.

Ops opt in with one line that costs a module-attribute check when no autocast region is active:

    if _amp.active: a, b = _amp.cast_inputs("lower", a, b)     # _amp = flame_core.amp.autocast_mode

Categories (the op lists below are the documented policy; README.md beside this file lists who calls what):
- "lower":   float32/float16/bfloat16 tensors are cast to the region's dtype (float64 is left alone, as in PyTorch).
- "fp32":    float16/bfloat16 tensors are cast to float32 (the op then returns float32).
- "promote": all floating tensors are cast to the widest floating dtype among them.
- "native":  nothing is cast: FLAME's fused norm kernels read float16/bfloat16 directly, compute their statistics
             and the normalisation in float32 registers and write the input's dtype (a cast to float32 and back
             would be two extra passes over the activation for the same arithmetic).
Tensors on a device type whose autocast is off, integer/bool tensors, float8 storage and non-tensors pass unchanged.
"""
import functools
import warnings
import weakref

from .. import backend
from .. import dtypes as D
from ..autograd.grad_mode import state as _grad_state
from ..errors import DeviceError, DTypeError

# ----------------------------------------------------------------------------- the op policy
LOWER_PRECISION_OPS = ("matmul", "mm", "bmm", "dot", "einsum", "linear", "conv2d", "scaled_dot_product_attention",
                       "qkv_attention")
FP32_OPS = ("softmax", "log_softmax", "sum", "mean", "cross_entropy", "nll_loss", "mse_loss", "l1_loss")
PROMOTE_OPS = ("cat", "stack")  # they promote mixed inputs to the widest dtype by themselves (no cast needed)
NATIVE_OPS = ("layer_norm", "rms_norm", "joint_rms_norm", "group_norm", "group_norm_silu")

_CATEGORY = {**{n: "lower" for n in LOWER_PRECISION_OPS}, **{n: "fp32" for n in FP32_OPS},
             **{n: "promote" for n in PROMOTE_OPS}, **{n: "native" for n in NATIVE_OPS}}


def category_of(op_name):
    """The autocast category of an op name ("lower", "fp32", "promote", "native"), or None when autocast leaves it
    alone."""
    return _CATEGORY.get(op_name)


# ----------------------------------------------------------------------------- state
_LOW = (D.float16, D.bfloat16)
_DEFAULT_DTYPE = {"cuda": D.float16, "cpu": D.bfloat16}  # PyTorch's defaults


class _DeviceState:
    __slots__ = ("enabled", "dtype", "cache_enabled")

    def __init__(self, dtype):
        self.enabled, self.dtype, self.cache_enabled = False, dtype, True


_STATES = {"cpu": _DeviceState(D.bfloat16), "cuda": _DeviceState(D.float16)}
active = False  # any device type enabled: the flag ops test before calling cast_inputs
_depth = [0]    # nesting of autocast contexts; the cast cache is cleared when the outermost one exits
_cache = {}     # (id(leaf), grad_enabled) -> (weakref(leaf), version, cast tensor)


def _refresh_active():
    global active
    active = _STATES["cpu"].enabled or _STATES["cuda"].enabled


def _check_device_type(device_type):
    if device_type not in _STATES:
        raise DeviceError(f"autocast: device_type must be 'cuda' or 'cpu', got {device_type!r}")
    return device_type


def is_autocast_enabled(device_type="cuda"):
    return _STATES[_check_device_type(device_type)].enabled


def get_autocast_dtype(device_type="cuda"):
    return _STATES[_check_device_type(device_type)].dtype


def is_autocast_cache_enabled(device_type="cuda"):
    return _STATES[_check_device_type(device_type)].cache_enabled


def clear_autocast_cache():
    _cache.clear()


def get_autocast_state():
    """A snapshot of every device type's (enabled, dtype, cache_enabled); `flame_core.checkpoint` replays it."""
    return {k: (s.enabled, s.dtype, s.cache_enabled) for k, s in _STATES.items()}


class restore_autocast_state:
    """Context manager that runs its body under a snapshot from `get_autocast_state()` (nesting as autocast)."""

    def __init__(self, snapshot):
        self._snap = snapshot

    def __enter__(self):
        self._prev = get_autocast_state()
        _set_state(self._snap)
        _depth[0] += 1
        return self

    def __exit__(self, *exc):
        _depth[0] -= 1
        if _depth[0] == 0:
            _cache.clear()
        _set_state(self._prev)
        return False


def _set_state(snap):
    for k, (en, dt, ce) in snap.items():
        s = _STATES[k]
        s.enabled, s.dtype, s.cache_enabled = en, dt, ce
    _refresh_active()


# ----------------------------------------------------------------------------- the context manager
class autocast:
    """`with autocast("cuda", dtype=flame.bfloat16):` or `@autocast("cpu")`. PyTorch semantics:

    - entering sets this device type's state, exiting restores the previous one (so nesting and
      `autocast(..., enabled=False)` regions inside enabled ones work; ops inside a disabled region see their
      inputs' dtypes, so cast there by hand);
    - within the outermost region, casts of float32 leaf tensors that require grad (the weights) are cached,
      so a weight used by several ops is cast once; the cache is cleared when the outermost region exits;
    - only tensors of the given device type are affected.
    """

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self.device = _check_device_type(device_type)
        if dtype is None:
            dtype = _DEFAULT_DTYPE[device_type]
        self.fast_dtype = D.dtype(dtype)
        if self.fast_dtype not in _LOW:
            raise DTypeError(f"autocast: dtype must be flame.bfloat16 or flame.float16, got {self.fast_dtype}")
        self._enabled = bool(enabled)
        self._cache_enabled = True if cache_enabled is None else bool(cache_enabled)
        if self._enabled and device_type == "cuda" and not backend.cuda_available():
            warnings.warn("autocast: device_type 'cuda' was given but CuPy sees no GPU; disabling autocast",
                          stacklevel=2)
            self._enabled = False

    def __enter__(self):
        s = _STATES[self.device]
        self._prev = (s.enabled, s.dtype, s.cache_enabled)
        s.enabled = self._enabled
        if self._enabled:  # a disabled region keeps the outer dtype (what get_autocast_dtype reports)
            s.dtype, s.cache_enabled = self.fast_dtype, self._cache_enabled
        _depth[0] += 1
        _refresh_active()
        return self

    def __exit__(self, *exc):
        _depth[0] -= 1
        if _depth[0] == 0:
            _cache.clear()
        s = _STATES[self.device]
        s.enabled, s.dtype, s.cache_enabled = self._prev
        _refresh_active()
        return False

    def __call__(self, fn):
        args = (self.device, self.fast_dtype, self._enabled, self._cache_enabled)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            with autocast(*args):  # a fresh context per call: recursion and re-entrance are safe
                return fn(*a, **kw)
        return wrapper


# ----------------------------------------------------------------------------- the hook ops call
def _device_type(t):
    return "cuda" if backend.is_cuda_array(t._data) else "cpu"


def cast_inputs(category, *tensors):
    """`tensors` cast per the active autocast state for an op of `category`; always a tuple of the same length."""
    from ..tensor import Tensor
    st = None
    for t in tensors:
        if isinstance(t, Tensor):
            st = _STATES[_device_type(t)]
            break
    if st is None or not st.enabled:
        return tensors
    if category == "lower":
        target = st.dtype
        return tuple(_cast_lower(t, target, st.cache_enabled) if isinstance(t, Tensor) else t for t in tensors)
    if category == "fp32":
        return tuple(t.to(D.float32) if isinstance(t, Tensor) and t.dtype in _LOW else t for t in tensors)
    if category == "promote":
        floats = [t.dtype for t in tensors if isinstance(t, Tensor) and t.dtype.is_floating_point]
        if not floats:
            return tensors
        widest = functools.reduce(D.promote_types, floats)
        return tuple(t.to(widest) if isinstance(t, Tensor) and t.dtype.is_floating_point else t for t in tensors)
    raise ValueError(f"cast_inputs: unknown autocast category {category!r}; expected 'lower', 'fp32' or 'promote'")


def _cast_lower(t, target, cache_enabled):
    dt = t.dtype
    if dt is target or not (dt is D.float32 or dt in _LOW):
        return t
    if not (cache_enabled and dt is D.float32 and t._requires_grad and t._grad_fn is None):
        return t.to(target)
    key = (id(t), _grad_state.enabled)
    hit = _cache.get(key)
    if hit is not None:
        ref, version, cast = hit
        fn = cast._grad_fn
        if ref() is t and version == t._version[0] and cast.dtype is target and not (fn is not None and fn._freed):
            return cast
    cast = t.to(target)
    _cache[key] = (weakref.ref(t), t._version[0], cast)
    return cast


# ----------------------------------------------------------------------------- custom Functions
def custom_fwd(fwd=None, *, device_type, cast_inputs=None):
    """Decorator for a `Function.forward` (under `@staticmethod`), as `torch.amp.custom_fwd`.

    Records the autocast state so `custom_bwd` runs backward under the same one. With `cast_inputs=dtype`, when
    autocast is on, floating tensor arguments are cast to that dtype and forward runs with autocast off.
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    _check_device_type(device_type)
    to = D.dtype(cast_inputs) if cast_inputs is not None else None

    @functools.wraps(fwd)
    def wrapper(ctx, *args, **kwargs):
        from ..tensor import Tensor
        st = _STATES[device_type]
        ctx._amp_dtype = st.dtype
        if to is None or not st.enabled:
            ctx._amp_fwd_used = st.enabled
            ctx._amp_in_dtypes = None
            return fwd(ctx, *args, **kwargs)
        ctx._amp_fwd_used = False
        ctx._amp_in_dtypes = tuple(a.dtype if isinstance(a, Tensor) else None for a in args)

        def cast(a):
            if isinstance(a, Tensor) and a.dtype.is_floating_point and a.dtype is not D.float64:
                return a.to(to)
            return a
        with autocast(device_type, enabled=False):
            return fwd(ctx, *[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
    return wrapper


def custom_bwd(bwd=None, *, device_type):
    """Decorator for a `Function.backward`: runs it under the autocast state its forward saw (see custom_fwd);
    gradients of inputs that custom_fwd cast are cast back to the inputs' dtypes."""
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)
    _check_device_type(device_type)

    @functools.wraps(bwd)
    def wrapper(ctx, *grads):
        with autocast(device_type, dtype=ctx._amp_dtype, enabled=ctx._amp_fwd_used):
            res = bwd(ctx, *grads)
        dts = ctx._amp_in_dtypes
        if dts is None:
            return res
        single = not isinstance(res, tuple)
        res = (res,) if single else res
        res = tuple(g.to(dt) if g is not None and dt is not None and g.dtype is not dt else g
                    for g, dt in zip(res, dts))
        return res[0] if single else res
    return wrapper
