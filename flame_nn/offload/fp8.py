"""fp8 storage of frozen Linear weights: float8_e4m3fn values with one fp32 scale per output channel (row), turned
back into the compute dtype right before each matmul (the fp8 dequantisation kernel on cuda, its NumPy reference on
cpu). Half the memory and half the host->device transfer of bf16 weights.

    quantize_linear_weights_(model.double_blocks)     # every frozen Linear inside; LoRA-adapted ones included

A quantised Linear keeps its module identity and its parameter names: `weight` becomes the fp8 values and a buffer
`weight_scale` (out_features,) holds the scales, so w ~= weight * weight_scale[:, None]. Adapters keep working on top
(the base output is computed from the dequantised weight). The dequantised weight is a temporary of one layer.

Error: e4m3 keeps 3 mantissa bits; with the scale chosen per row from the row's largest magnitude, every weight is
off by at most 1/17 of its own magnitude (half an ulp; tiny weights by half the row's subnormal step instead), by 2.6%
rms over a Gaussian weight matrix (bf16: 0.17%). A layer's output moves by about that rms relative error;
tests/offload/test_fp8_storage.py measures it (README: fp8 storage).
"""
from flame_core import dtypes as D
from flame_core.amp import autocast_mode as _amp
from flame_core.autograd import no_grad
from flame_core.kernels import fp8 as _K
from flame_core.ops.fp8 import quantize_fp8
from flame_core.tensor import _wrap

from .. import functional as F
from ..layers.linear import Linear
from ..parameter import Parameter
from .host import OffloadError


class Float8LinearMixin:
    """Mixed in front of a Linear class: `weight` holds float8_e4m3fn values, `weight_scale` the row scales."""

    def dequantized_weight(self, dtype=None):
        """The weight as `dtype` (default: the dtype the layer had before quantisation). Not differentiable."""
        dt = D.dtype(dtype) if dtype is not None else self.compute_dtype
        w = self.weight
        return _wrap(_K.dequantize_per_row(w._data, self.weight_scale._data, dt.np))

    def forward(self, input):
        dt = self.compute_dtype
        if _amp.active:  # dequantise straight to the autocast dtype (the matmul would cast to it anyway)
            dev = "cuda" if input.is_cuda else "cpu"
            if _amp.is_autocast_enabled(dev):
                dt = _amp.get_autocast_dtype(dev)
        return F.linear(input, self.dequantized_weight(dt), self.bias)

    def extra_repr(self):
        return super().extra_repr() + ", weight=float8_e4m3fn (per-channel scales)"


_CLASSES = {}


def _fp8_class(cls):
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type("Float8" + cls.__name__, (Float8LinearMixin, cls), {})
    return new


def is_fp8_linear(module):
    return isinstance(module, Float8LinearMixin)


def quantize_linear_weights_(module, dtype="float8_e4m3fn", *, include_trainable=False):
    """Store the weight of every frozen `Linear` in `module` (itself included) as fp8 with per-output-channel scales,
    in place, on the weight's device. Returns the names of the converted layers. LoRA/LoKr/LoHa-adapted Linears are
    converted too (their base weight is frozen); DoRA needs the base weight's rows and is refused; layers with
    merged adapters are refused (unmerge first). Quantise the block stacks, where the bytes are, rather than a whole
    model: a model may read its compute dtype from a Linear's weight (Flux reads `img_in.weight.dtype`)."""
    if D.dtype(dtype) is not D.float8_e4m3fn:
        raise OffloadError(f"quantize_linear_weights_: only float8_e4m3fn storage is available, got {dtype!r}")
    from ..adapters.layer import AdaptedLinearMixin, adapt
    done = []
    with no_grad():
        for name, m in module.named_modules():
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
            if adapted:
                if m._merged:
                    raise OffloadError(f"{name}: merged adapters {list(m._merged)}; unmerge them before quantising")
                for entries in m._adapters.values():
                    for _, ad in entries:
                        if ad.needs_base:
                            raise OffloadError(f"{name}: a {ad.kind} adapter needs the base weight's rows; fp8 "
                                               f"storage supports LoRA, LoKr and LoHa adapters")
            q, scales = quantize_fp8(w)
            d = m.__dict__
            d["compute_dtype"] = w.dtype
            if adapted:
                state = {k: d[k] for k in ("_adapters", "_weights", "_merged", "adapters_enabled")}
                m.__class__ = _fp8_class(m._base_class)
                adapt(m)
                d.update(state)
            else:
                m.__class__ = _fp8_class(type(m))
            m.weight = Parameter(q, requires_grad=False)
            m.register_buffer("weight_scale", scales)
            done.append(name)
    return done
