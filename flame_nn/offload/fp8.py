"""fp8 storage of frozen Linear weights: float8_e4m3fn values with one fp32 scale per output channel (row), turned
back into the compute dtype right before each matmul (the fp8 dequantisation kernel on cuda, its NumPy reference on
cpu). Half the memory and half the host->device transfer of bf16 weights.

    quantize_linear_weights_(model.double_blocks)     # every frozen Linear inside; LoRA-adapted ones included

A quantised Linear keeps its module identity and its parameter names: `weight` becomes the fp8 values and a buffer
`weight_scale` (out_features,) holds the scales, so w ~= weight * weight_scale[:, None]. Adapters keep working on top
(the base output is computed from the dequantised weight). The dequantised weight lives for one matmul.

Memory: the dequantised weight never becomes a tensor of its own. Each call writes it into one scratch buffer per
(device, dtype), sized once for the largest quantised Linear there and reused by every layer, forward and backward
(released once no fp8 Linear lives any more, and shrunk by `trim_scratch` when the largest ones are gone):
the base product is a custom autograd op (`Float8Linear`) that keeps the fp8 bytes, not the dequantised weight, and
dequantises again in backward for the input gradient. Why: a weight-sized temporary per layer (18 to 126 MiB each on
Flux-dev, of several sizes), kept alive through a block's recompute, makes the pool's layout drift under a memory
limit until a later step cannot find room its first step found (tests/offload/test_autofit_drift.py replays it).

Error: e4m3 keeps 3 mantissa bits; with the scale chosen per row from the row's largest magnitude, every weight is
off by at most 1/17 of its own magnitude, 2.6% rms over a Gaussian weight matrix (bf16: 0.17%); a layer's output
moves by about that (tests/offload/test_fp8_storage.py). Scales that minimise the squared error instead gain only
1.4% of it (e4m3's rounding error is relative whatever the scale), and keeping the adaLN modulation Linears in bf16
(4.3% -> 3.6% output error on a tiny Flux) would cost 3.2 of Flux-dev's 11.9 B parameters in bf16: neither is done.
BlockStreamer(quantize='fp8') quantises the blocks only: the embedders and the final layer, outside them, keep their
dtype.

fp8 compute (opt-in: `quantize_linear_weights_(module, compute="fp8")`, `use_fp8_compute_`): one scale per weight
tensor and the matmuls on the e4m3 tensor cores, the activations quantised too (fp8_compute.py).
"""
import weakref

import numpy as np

from flame_core import Tensor, as_tensor, backend
from flame_core import cat as _cat
from flame_core import dtypes as D
from flame_core.amp import autocast_mode as _amp
from flame_core.autograd import Function, no_grad
from flame_core.autograd.grad_mode import is_grad_enabled
from flame_core.cuda.graphs import hold_while_captured
from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.kernels import fp8 as _K
from flame_core.kernels import fp8_tensor as _KT
from flame_core.kernels.loader import dtype_name as _dtype_name
from flame_core.ops.fp8 import quantize_fp8, requantize_fp8_per_tensor
from flame_core.ops.linalg import mm_arrays

from ..layers.linear import Linear
from ..parameter import Parameter
from .fp8_compute import Float8ComputeLinear
from .host import OffloadError

_FP8_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")

# ----------------------------------------------------------------------------- the dequantisation scratch
_scratch = {}    # (device key, dtype name) -> Tensor (1-D) the dequantised weights are written into
_largest = {}    # device key -> elements of the largest quantised weight there (sizes the scratch once)
_views = {}      # (device key, dtype name) -> {shape: view of that scratch buffer} (dropped with the buffer)
_stale = False   # an fp8 Linear died since `_largest` was counted from the live ones
_nd = backend.cupy.ndarray if backend.cupy is not None else None  # (None: no array is of it)
# A CUDA graph that captured a layer holds the scratch view it used (hold_while_captured): the buffers here can be
# dropped at any time without a replay writing into freed memory.


def _device_key(arr):
    if type(arr) is _nd:  # (the eager per-layer call: no Device object made)
        return ("cuda", arr.data.device_id)
    return ("cuda", arr.device.id) if backend.is_cuda_array(arr) else ("cpu", 0)


def _note_size(arr):
    key = _device_key(arr)
    _largest[key] = max(_largest.get(key, 0), int(arr.size))


class Registry:
    """The fp8 Linears made that still live (`live`; they size the scratch, released with the last) and how many
    (`n`, counted here: inside a finalizer the WeakSet may still count the dying layer). One is current
    (`registry`); a layer's death counts in the registry it was made in (a test may start a fresh one)."""

    def __init__(self):
        self.live = weakref.WeakSet()
        self.n = 0


registry = Registry()


def _register(linear, scratch_elems=0):
    """Count `linear` among the live fp8 Linears; `scratch_elems`: the scratch it needs when more than its weight (a
    stacked weight it is a row block of)."""
    if scratch_elems:
        linear.__dict__["_fp8_scratch_elems"] = int(scratch_elems)
    reg = registry
    if linear not in reg.live:
        reg.live.add(linear)
        reg.n += 1
        a = linear.weight.array
        weakref.finalize(linear, _layer_gone, reg, _device_key(a), max(int(a.size), int(scratch_elems)))


def _layer_gone(reg, key, elems):
    """A registered fp8 Linear died: the last one releases the scratch; one as large as the largest there trims it
    to the layers left (a model freed while another keeps fp8 layers)."""
    global _stale
    reg.n -= 1
    if reg is not registry:   # (a registry no longer current sizes nothing)
        return
    if reg.n <= 0:  # nothing will read the scratch again
        reg.n = 0
        release_scratch()
    elif elems >= _largest.get(key, 0):
        trim_scratch()
    else:
        _stale = True  # (its size may have changed since it was registered -- moved, stacked: the next allocation
        #  counts the live ones again)


def _live_largest():
    """{device key: elements} the live fp8 Linears need (their weights' devices now: a model may have moved)."""
    out = {}
    for m in list(registry.live):
        w = m.__dict__.get("_parameters", {}).get("weight")
        if w is None or w.is_meta:
            continue
        a = w.array
        key = _device_key(a)
        out[key] = max(out.get(key, 0), int(a.size), m.__dict__.get("_fp8_scratch_elems", 0))
    return out


def trim_scratch():
    """Size the scratch buffers for the fp8 Linears that still live: drop those of devices where none is left, and
    those larger than the largest live layer needs (the next call allocates one of the right size). Called by
    `free_model`; safe at any time (a captured graph holds the buffers it uses). Returns the bytes dropped."""
    global _stale
    _stale = False
    need = _live_largest()
    _largest.clear()
    _largest.update(need)
    dropped = 0
    for key, buf in list(_scratch.items()):
        if buf.array.size > need.get(key[0], 0):
            dropped += buf.array.nbytes
            del _scratch[key]
            _views.pop(key, None)
    return dropped


def scratch_buffers():
    """{(device, dtype name): bytes} of the dequantisation scratch buffers (one per device and compute dtype)."""
    return {(f"{k[0][0]}:{k[0][1]}" if k[0][0] == "cuda" else "cpu", k[1]): t.array.nbytes
            for k, t in list(_scratch.items())}


def release_scratch():
    """Drop the scratch buffers and forget the layer sizes seen so far (layers quantised from now on size the next
    buffers). Safe at any time: a captured CUDA graph holds the buffers it uses."""
    global _stale
    _stale = False
    _scratch.clear()
    _largest.clear()
    _views.clear()


def _scratch_view(q, dtype, shape):
    """A `shape` view of `dtype` into the scratch buffer of q's device (q.size elements)."""
    key = (_device_key(q), _dtype_name(dtype))
    n = int(q.size)
    buf = _scratch.get(key)
    if buf is None or buf.array.size < n:
        if _stale:  # size the new buffer for the layers that live, not for those gone
            trim_scratch()
        size = max(n, _largest.get(key[0], 0))
        xp = backend.xp_of(q)
        if backend.is_cuda_array(q):
            with backend.cupy.cuda.Device(q.device.id):
                arr = xp.empty(size, dtype=dtype)
        else:
            arr = np.empty(size, dtype=dtype)
        _views.pop(key, None)  # views of the buffer replaced
        buf = _scratch[key] = as_tensor(arr)  # a Tensor: the memory accounting counts it
    return buf.array[:n].reshape(shape)


def transposed_into_scratch(q):
    """q (out, in) e4m3 values transposed to (in, out), written into the byte scratch buffer of q's device (the fp8
    GEMM's K-major operand for the input gradient): a view valid until the next call on that device."""
    if not backend.is_cuda_array(q):
        return np.ascontiguousarray(q.T)
    qb = q if q.dtype == np.uint8 else q.view(np.uint8)
    out = _scratch_view(qb, np.dtype(np.uint8), (q.shape[1], q.shape[0]))
    hold_while_captured(out)  # (a no-op outside a capture)
    return _KT.transpose_fp8(qb, out=out)


def _dequantize_into_scratch(q, scales, dtype):
    """q (uint8 bytes or float8 values, (out, in)) * scales[:, None] as `dtype`, written into the scratch buffer of
    q's device: a view valid until the next call on that device (enqueue its reader before the next call). The view
    of each weight shape is kept with its buffer, so the eager per-layer call makes none (and the kernel wrapper's
    launch for a reused output is packed once per address set)."""
    dtype = np.dtype(dtype)
    shape = q.shape
    skey = (_device_key(q), _dtype_name(dtype))
    views = _views.get(skey)
    out = views.get(shape) if views is not None else None
    if out is None:
        out = _scratch_view(q, dtype, shape)  # (may replace the buffer: its views are then dropped)
        views = _views.setdefault(skey, {})
        if len(views) >= 64:  # many weight shapes: keep the dict small
            views.clear()
        views[shape] = out
    hold_while_captured(out)  # (a no-op outside a capture)
    if q.size:
        _K.dequantize_per_row(q, scales, dtype, out=out)
    return out


class Float8Linear(Function):
    """y = x @ dequantise(q, scales)^T + b with the dequantised weight in the scratch buffer; backward keeps the fp8
    bytes (no weight-sized tensor outlives the call) and dequantises again for the input gradient. The weight is
    frozen (no weight gradient); the bias gets one when it requires grad. No double backward."""

    @staticmethod
    def forward(ctx, x, q, scales, b, dtype):
        a = x.array
        w = _dequantize_into_scratch(q.array, scales.array, dtype)
        y = mm_arrays(a.reshape(-1, a.shape[-1]), w.T)  # enqueued before the next layer overwrites the scratch
        if b is not None:
            y += b.array
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(q, scales)
        ctx.x_shape, ctx.dtype = x.shape, dtype
        return as_tensor(y.reshape(tuple(x.shape[:-1]) + (q.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        nx, _, _, nb, _ = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        dx = db = None
        if nx:
            q, scales = ctx.saved_tensors
            w = _dequantize_into_scratch(q.array, scales.array, ctx.dtype)
            ga = g2.array if g2.array.dtype == w.dtype else g2.array.astype(w.dtype)
            dx = as_tensor(mm_arrays(ga, w).reshape(tuple(ctx.x_shape)))
        if nb:
            db = g2.sum(0)
        return dx, None, None, db, None


class Float8LinearMixin:
    """Mixed in front of a Linear class: `weight` holds float8_e4m3fn values, `weight_scale` the row scales. With
    `fp8_compute` (use_fp8_compute_) the scales are one per tensor and the matmuls run in fp8 (fp8_compute.py) when
    the compute dtype is bfloat16, float16 or float32 (float64, for gradient checks, keeps the dequantising path)."""

    fp8_compute = False
    _keep_dtype = ("weight", "weight_scale")   # Module.to(dtype) keeps the storage format, changes compute_dtype

    def _prepare_state_(self, state_dict, prefix, errors):
        """load_state_dict's entries for this layer: a weight in a float dtype (the model's own checkpoint) is
        quantised as the layer stores it (per row; per tensor for fp8 compute), its scales put beside it; float8
        values come with their `weight_scale` or are refused (their scales unknown). They were copied into the fp8
        storage as they were, the scales left as they were."""
        k, ks = prefix + "weight", prefix + "weight_scale"
        if k not in state_dict:
            return
        v = state_dict[k]
        t = v if isinstance(v, Tensor) else as_tensor(v)
        if t.dtype is D.float8_e4m3fn:
            if ks not in state_dict:
                errors.append(f"{k}: float8 values without {ks} (their scales) for an fp8-stored Linear")
            return
        if not t.dtype.is_floating_point or tuple(t.shape) != tuple(self.weight.shape):
            return   # (load_state_dict names the dtype / shape)
        with no_grad():
            q, scales = quantize_fp8(t.to(self.weight.device), per_tensor=self.fp8_compute)
        state_dict[k], state_dict[ks] = q, scales

    def _dtype_changed_(self, dtype):
        """Module.to(dtype): a float dtype becomes the layer's compute dtype (its fp8 weight and scales stay)."""
        if dtype.is_floating_point and dtype is not D.float8_e4m3fn:
            self.__dict__["compute_dtype"] = dtype

    def dequantized_weight(self, dtype=None, rows=None):
        """The weight -- or its rows `rows` = (lo, hi) -- as a new tensor of `dtype` (default: the layer's compute
        dtype). Not differentiable. (The layer's own forward does not call this: it dequantises into a shared scratch;
        a DoRA adapter reads its rows through it.)"""
        dt = D.dtype(dtype) if dtype is not None else self.compute_dtype
        q, s = self.weight.array, self.weight_scale.array
        if rows is not None:
            q, s = q[rows[0]:rows[1]], s[rows[0]:rows[1]]
        return as_tensor(_K.dequantize_per_row(q, s, dt.np))

    def _compute_inputs(self, input):
        """(compute dtype, input, bias) as the matmul takes them: under autocast its dtype (the dequantised weight
        would be cast to it anyway), the input and bias cast to it; checked against the weight."""
        dt = self.compute_dtype
        bias = self.bias
        if _amp.active:
            dev = "cuda" if input.is_cuda else "cpu"
            if _amp.is_autocast_enabled(dev):
                dt = _amp.get_autocast_dtype(dev)
                input, bias = _amp.cast_inputs("lower", input, bias)
        w = self.weight
        if input.ndim < 1 or input.shape[-1] != w.shape[1]:
            raise ShapeError(f"linear: input {fmt_shape(input.shape)} and weight {fmt_shape(w.shape)} do not fit "
                             f"(expected weight (out_features, {input.shape[-1] if input.ndim else '?'}))")
        if input.dtype != dt or (bias is not None and bias.dtype != dt):
            raise DTypeError(f"linear: input ({input.dtype})" + (f" and bias ({bias.dtype})" if bias is not None
                                                                 else "")
                             + f" must have the dtype of the fp8 layer's compute dtype ({dt}); cast them, or use "
                               f"flame.amp.autocast")
        return dt, input, bias

    def forward(self, input):
        dt, input, bias = self._compute_inputs(input)
        if self.fp8_compute and dt.name in _FP8_COMPUTE_DTYPES:
            return Float8ComputeLinear.apply(input, self.weight, self.weight_scale, bias, dt.np,
                                             self.__dict__.get("_fp8_sites"), self.__dict__.get("_fp8_wt"))
        return Float8Linear.apply(input, self.weight, self.weight_scale, bias, dt.np)

    def fused_low_rank(self, input, factors, splits=None):
        """Linear.fused_low_rank for fp8 compute (fp8_compute.Float8ComputeLowRank, when fp8_compute.FUSED), else
        None (the dequantising path has no fused form: the caller runs forward and adds / splits)."""
        from . import fp8_compute as FC
        if not (self.fp8_compute and FC.FUSED):
            return None
        dt, input, bias = self._compute_inputs(input)
        if dt.name not in _FP8_COMPUTE_DTYPES:
            return None
        return FC.fp8_linear_low_rank(input, self.weight, self.weight_scale, bias, dt.np, factors, splits,
                                      self.__dict__.get("_fp8_sites"), self.__dict__.get("_fp8_wt"))

    def _cat2_inputs(self, a, b):
        """(compute dtype, a, b, bias) for a fused node over cat((a, b), -1) -- under autocast cast to its dtype --
        or None where the layer has none: not fp8 compute, fp8_compute.FUSED off, adapted (its adapters need the
        joined input) or inputs of another dtype (forward then runs on the concatenation, with its checks)."""
        from ..adapters.layer import AdaptedMixin
        from . import fp8_compute as FC
        if not (self.fp8_compute and FC.FUSED) or isinstance(self, AdaptedMixin):
            return None
        dt, bias = self.compute_dtype, self.bias
        if _amp.active:
            dev = "cuda" if a.is_cuda else "cpu"
            if _amp.is_autocast_enabled(dev):
                dt = _amp.get_autocast_dtype(dev)
                a, b, bias = _amp.cast_inputs("lower", a, b, bias)
        if dt.name not in _FP8_COMPUTE_DTYPES or a.dtype != dt or b.dtype != dt or (bias is not None
                                                                                  and bias.dtype != dt):
            return None
        return dt, a, b, bias

    def fused_cat2(self, a, b):
        """Linear.fused_cat2 for fp8 compute (fp8_compute.Float8ComputeCat2; see _cat2_inputs), else None."""
        from . import fp8_compute as FC
        got = self._cat2_inputs(a, b)
        if got is None:
            return None
        dt, a, b, bias = got
        return FC.fp8_linear_cat2(a, b, self.weight, self.weight_scale, bias, dt.np, self.__dict__.get("_fp8_sites"),
                                  self.__dict__.get("_fp8_wt"))

    def fused_cat2_gelu(self, a, h, approximate):
        """Linear.fused_cat2_gelu for fp8 compute with delayed scaling (fp8_compute.Float8ComputeCat2Gelu, when
        fp8_compute.FUSED_MLP too; see _cat2_inputs), else None."""
        from . import fp8_compute as FC
        sites = self.__dict__.get("_fp8_sites")
        if sites is None or not FC.FUSED_MLP or approximate not in ("none", "tanh"):
            return None
        got = self._cat2_inputs(a, h)
        if got is None:
            return None
        dt, a, h, bias = got
        return FC.fp8_linear_cat2_gelu(a, h, self.weight, self.weight_scale, bias, dt.np, sites,
                                       self.__dict__.get("_fp8_wt"), approximate)

    def fused_gelu_mlp(self, input, fc2, approximate):
        """Linear.forward_gelu_mlp's fused node (fp8_compute.Float8ComputeGeluMlp) when this layer and fc2 are both
        fp8-compute Linears with delayed scaling (set_fp8_scaling_), neither adapted nor subclassed with its own
        forward (hooks: forward_gelu_mlp's check), of one compute dtype, their biases frozen (or no gradient
        recorded), and fp8_compute.FUSED and FUSED_MLP; else None (forward_gelu_mlp calls the layers)."""
        from . import fp8_compute as FC
        layers = (self, fc2)
        if not (FC.FUSED and FC.FUSED_MLP) or approximate not in ("none", "tanh") or any(
                type(m).forward is not Float8LinearMixin.forward or not m.fp8_compute
                or m.__dict__.get("_fp8_sites") is None for m in layers):
            return None
        dt, input, b1 = self._compute_inputs(input)
        dt2, b2 = fc2.compute_dtype, fc2.bias
        if _amp.active and _amp.is_autocast_enabled("cuda" if input.is_cuda else "cpu"):
            dt2 = dt
            (b2,) = _amp.cast_inputs("lower", b2)
        if dt.name not in _FP8_COMPUTE_DTYPES or dt2 != dt or (b2 is not None and b2.dtype != dt):
            return None
        if is_grad_enabled() and any(b is not None and b.requires_grad for b in (b1, b2)):
            return None   # a trained bias needs the pre-activation gradient in the compute dtype
        return FC.fp8_gelu_mlp(input, self, fc2, dt.np, approximate, (b1, b2))

    def extra_repr(self):
        if self.fp8_compute:
            delayed = ", delayed scaling" if self.__dict__.get("_fp8_sites") is not None else ""
            return super().extra_repr() + ", weight=float8_e4m3fn (per-tensor scale), fp8 compute" + delayed
        return super().extra_repr() + ", weight=float8_e4m3fn (per-channel scales)"


_CLASSES = {}


def _fp8_class(cls):
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type("Float8" + cls.__name__, (Float8LinearMixin, cls), {})
    return new


def is_fp8_linear(module):
    return isinstance(module, Float8LinearMixin)


def set_fp8_weight_(linear, q, scales, compute_dtype):
    """Give a plain frozen `Linear` (a meta one built under empty_init too) fp8 storage from values that are already
    quantised: q float8_e4m3fn (out_features, in_features), scales float32 (out_features,), w ~= q * scales[:, None],
    computed in `compute_dtype`. For fp8 weights read from a file: no round trip through the compute dtype. The
    layer then is what `quantize_linear_weights_` makes. Returns the layer."""
    from ..adapters.layer import AdaptedLinearMixin
    if not isinstance(linear, Linear) or isinstance(linear, (Float8LinearMixin, AdaptedLinearMixin)):
        raise OffloadError(f"set_fp8_weight_: expects a plain Linear, got {type(linear).__name__}")
    out_features, in_features = tuple(linear.weight.shape)
    if q.dtype is not D.float8_e4m3fn or tuple(q.shape) != (out_features, in_features):
        raise OffloadError(f"set_fp8_weight_: q must be float8_e4m3fn of shape {(out_features, in_features)}, got "
                           f"{q.dtype} {fmt_shape(q.shape)}")
    if scales.dtype is not D.float32 or tuple(scales.shape) != (out_features,) or scales.device != q.device:
        raise OffloadError(f"set_fp8_weight_: scales must be float32 of shape ({out_features},) on {q.device}, got "
                           f"{scales.dtype} {fmt_shape(scales.shape)} on {scales.device}")
    compute_dtype = D.dtype(compute_dtype)
    if not compute_dtype.is_floating_point or compute_dtype is D.float8_e4m3fn:
        raise OffloadError(f"set_fp8_weight_: compute_dtype must be a float dtype, got {compute_dtype}")
    _note_size(q.array)
    linear.__dict__["compute_dtype"] = compute_dtype
    linear.__class__ = _fp8_class(type(linear))
    linear.weight = Parameter(q, requires_grad=False)
    linear.register_buffer("weight_scale", scales)
    _register(linear)
    return linear


def stack_fp8_weights_(linears):
    """Re-point fp8-storage Linears (per-row scales, not fp8 compute) of one input width, compute dtype and device at
    consecutive row blocks of ONE stacked fp8 weight and ONE scale vector, and return those two tensors: layers that
    read the same input (q, k, v) can then run as one `fp8_linear` over them -- one dequantisation and one GEMM
    instead of one of each per layer. The weights are not copied twice: each layer's weight and scales become views
    of the stacked tensors (the separate ones are released). The scratch buffer is sized for the stacked weight.
    Raises OffloadError for layers that cannot be stacked."""
    linears = list(linears)
    if not linears or not all(isinstance(m, Float8LinearMixin) and not m.fp8_compute for m in linears):
        raise OffloadError("stack_fp8_weights_: expects fp8-storage Linears (per-row scales, not fp8 compute)")
    first = linears[0]
    for m in linears[1:]:
        if (m.weight.shape[1] != first.weight.shape[1] or m.compute_dtype != first.compute_dtype
                or m.weight.device != first.weight.device):
            raise OffloadError(f"stack_fp8_weights_: layers of input width {m.weight.shape[1]} / "
                               f"{first.weight.shape[1]}, compute dtypes {m.compute_dtype} / {first.compute_dtype}, "
                               f"devices {m.weight.device} / {first.weight.device} do not stack")
    with no_grad():
        q = _cat([m.weight.detach() for m in linears], 0)
        scales = _cat([m.weight_scale for m in linears], 0)
        lo = 0
        for m in linears:
            hi = lo + m.weight.shape[0]
            m.weight = Parameter(q[lo:hi], requires_grad=False)
            m.weight_scale = scales[lo:hi]
            _register(m, q.shape[0] * q.shape[1])
            lo = hi
    _note_size(q.array)
    return q, scales


def fp8_linear(x, q, scales, bias, compute_dtype):
    """x @ (q * scales[:, None])^T + bias in `compute_dtype` through the dequantisation scratch (the fp8-storage
    Linear's own op, for stacked weights: `stack_fp8_weights_`). x and bias must be of `compute_dtype`."""
    return Float8Linear.apply(x, q, scales, bias, D.dtype(compute_dtype).np)


def _check_compute(compute, where):
    if compute not in (None, "fp8"):
        raise OffloadError(f"{where}: compute must be None (dequantise to the compute dtype) or 'fp8', got "
                           f"{compute!r}")


def use_fp8_compute_(module, enabled=True):
    """Run the matmuls of every fp8 Linear in `module` (itself included) on the fp8 tensor cores (fp8_compute.py),
    or, with enabled=False, dequantise again. Row-scaled weights are requantised to one scale per tensor first (once;
    the storage format is unchanged: `weight_scale` keeps its shape). Returns the names of the layers switched."""
    done = []
    with no_grad():
        for name, m in module.named_modules():
            if not isinstance(m, Float8LinearMixin):
                continue
            if enabled and not m.fp8_compute:
                if m.weight.is_meta:
                    raise OffloadError(f"use_fp8_compute_: {name or type(m).__name__}.weight has no data yet "
                                       f"(empty_init): load the weights first")
                q, scales = requantize_fp8_per_tensor(m.weight, m.weight_scale)
                if q is not m.weight:
                    m.weight = Parameter(q, requires_grad=False)
                    m.weight_scale = scales
            m.__dict__["fp8_compute"] = bool(enabled)
            done.append(name)
    return done


def set_fp8_scaling_(module, scaling="delayed", history=None):
    """How every fp8-compute Linear in `module` (itself included) scales the activations it quantises: "current"
    (the default: each call's own amax, two passes and a grid-wide wait) or "delayed" (TransformerEngine's recipe:
    the scale of a layer's input and of its output gradient from the amaxes of their last `history` calls, default
    flame_core.kernels.fp8_tensor.HISTORY; one pass; values beyond that range saturate to +-448; the first call of a
    site scales by its own amax). A checkpointed recompute repeats its forward's scale. A split projection's output
    gradient parts and Linear.forward_cat2's two inputs are one site each (one amax over the parts). Returns the
    names of the layers set; raises OffloadError when `module` has no fp8-compute Linear (the option would do
    nothing)."""
    from flame_core.kernels.fp8_tensor import HISTORY

    from .fp8_compute import SCALINGS, Fp8Sites
    if scaling not in SCALINGS:
        raise OffloadError(f"set_fp8_scaling_: scaling must be one of {SCALINGS}, got {scaling!r}")
    history = HISTORY if history is None else int(history)
    if history < 1:
        raise OffloadError(f"set_fp8_scaling_: history must be >= 1, got {history}")
    done = []
    for name, m in module.named_modules():
        if isinstance(m, Float8LinearMixin) and m.fp8_compute:
            m.__dict__["_fp8_sites"] = Fp8Sites(history) if scaling == "delayed" else None
            done.append(name)
    if not done:
        raise OffloadError("set_fp8_scaling_: no fp8-compute Linear in the module (quantize_linear_weights_(..., "
                           "compute='fp8') or use_fp8_compute_ first)")
    return done


def quantize_linear_weights_(module, dtype="float8_e4m3fn", *, include_trainable=False, compute=None):
    """Store the weight of every frozen `Linear` in `module` (itself included) as fp8 with per-output-channel scales,
    in place, on the weight's device. Returns the names of the converted layers. LoRA/LoKr/LoHa-adapted Linears are
    converted too (their base weight is frozen); DoRA needs the base weight's rows and is refused; layers with
    merged adapters are refused (unmerge first). Quantise the block stacks, where the bytes are, rather than a whole
    model: a model may read its compute dtype from a Linear's weight (Flux reads `img_in.weight.dtype`).
    compute="fp8": one scale per tensor instead, and the layers' matmuls in fp8 (use_fp8_compute_); fp8 Linears
    already in `module` are switched too."""
    if D.dtype(dtype) is not D.float8_e4m3fn:
        raise OffloadError(f"quantize_linear_weights_: only float8_e4m3fn storage is available, got {dtype!r}")
    _check_compute(compute, "quantize_linear_weights_")
    from ..adapters.layer import AdaptedLinearMixin, adapt
    done = []
    with no_grad():
        for name, m in module.named_modules():
            if isinstance(m, Float8LinearMixin) and compute == "fp8" and not m.fp8_compute:
                use_fp8_compute_(m)
                continue
            if not isinstance(m, Linear) or isinstance(m, Float8LinearMixin):
                continue
            w = m.weight
            if w.requires_grad and not include_trainable:
                continue
            if w.is_meta:
                raise OffloadError(f"quantize_linear_weights_: {name or type(m).__name__}.weight has no data yet "
                                   f"(empty_init): load the weights first")
            if not w.dtype.is_floating_point or w.dtype is D.float8_e4m3fn:
                continue
            adapted = isinstance(m, AdaptedLinearMixin)
            if adapted and m._merged:
                raise OffloadError(f"{name}: merged adapters {list(m._merged)}; unmerge them before quantising")
            q, scales = quantize_fp8(w, per_tensor=compute == "fp8")
            _note_size(q.array)
            d = m.__dict__
            d["compute_dtype"] = w.dtype
            d["fp8_compute"] = compute == "fp8"
            if adapted:
                state = {k: d[k] for k in ("_adapters", "_weights", "_merged", "adapters_enabled")}
                m.__class__ = _fp8_class(m._base_class)
                adapt(m)
                d.update(state)
            else:
                m.__class__ = _fp8_class(type(m))
            m.weight = Parameter(q, requires_grad=False)
            m.register_buffer("weight_scale", scales)
            _register(m)
            done.append(name)
    return done
