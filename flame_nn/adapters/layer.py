"""Adapted layers: a Linear (or a Conv2d: conv_layer.py) that also runs the adapters attached to it, and the base
class of adapters.

`adapt(linear)` turns an existing Linear (any class with `weight` (out, in), optional `bias` and a forward) or Conv2d
into its adapted subclass IN PLACE (`__class__` swap): the module keeps its identity, its parent, its parameters and its
state_dict keys, so the base model still saves, loads and streams as before; `unadapt` swaps back. Adapters are kept
OUT of the module tree (a plain dict), so `model.parameters()` stays the frozen base and `adapter_parameters(model)`
(inject.py) lists what trains.

    y = base(x)                                  # the layer's own forward: bf16, fp8 storage, fused kernels...
    y[..., lo:hi] += w_a · adapter_a(x)          # every enabled, unmerged adapter, on its rows (in place)
"""
import numpy as np

import flame_core as flame
from flame_core import dtypes as flame_dtypes
from flame_core.amp import autocast_mode as _amp
from flame_core.autograd import Function, no_grad
from flame_core.errors import FlameError, ShapeError, fmt_shape
from flame_core.tensor import Tensor

from ..module import Module


class AdapterError(FlameError, ValueError):
    """Adapters asked for something they cannot do (the message names the module and adapter)."""


# ----------------------------------------------------------------------------- the in-place add of a delta
class _AddRows(Function):
    """y[..., lo:hi] += d in y's storage (y is a fresh Linear output nobody saved): no (N, out) copy per adapter."""

    @staticmethod
    def forward(ctx, y, d, lo, hi):
        full = lo == 0 and hi == y.shape[-1]
        # in place (the version counter moves: anyone who saved y would be told); the output is a new tensor over
        # y's storage that carries this node
        dt = y.dtype
        (y if full else y[..., lo:hi]).add_(d if d.dtype is dt else d.to(dt))
        ctx.lo, ctx.hi, ctx.full = lo, hi, full
        ctx.d_dtype = d.dtype
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        gd = None
        if ctx.needs_input_grad[1]:
            gd = g if ctx.full else g[..., ctx.lo:ctx.hi]
            if gd.dtype != ctx.d_dtype:
                gd = gd.to(ctx.d_dtype)
        return (g if ctx.needs_input_grad[0] else None), gd, None, None


def add_rows(y, d, lo, hi):
    if tuple(d.shape[:-1]) != tuple(y.shape[:-1]) or d.shape[-1] != hi - lo:
        raise ShapeError(f"adapter output {fmt_shape(d.shape)} does not fit rows [{lo}:{hi}] of the layer output "
                         f"{fmt_shape(y.shape)}")
    return _AddRows.apply(y, d, lo, hi)


def wide(t):
    """t in float32, or float64 when it already is (merging never loses a float64 base's precision)."""
    return t if t.dtype == flame_dtypes.float64 else t.float()


def autocast_on(x):
    return _amp.active and _amp.is_autocast_enabled("cuda" if x.is_cuda else "cpu")


def adapter_input(x, param):
    """x as the adapter's matmuls want it: under autocast the matmul casts (to bf16); otherwise the adapter's own
    dtype (float32), as PEFT does, so a bf16 base never rounds the adapter's arithmetic."""
    if autocast_on(x):
        return x
    return x if x.dtype == param.dtype else x.to(param.dtype)


# ----------------------------------------------------------------------------- adapters
class Adapter(Module):
    """An adapter on `out_features` output rows of a Linear (in_features inputs). Parameters float32 by default.

    Subclasses define `delta(x, base_rows, weight_rows)` (what to add to the layer's output rows), `delta_weight()`
    (ΔW, differentiable) and the canonical file form (`to_part` / `load_part`, see formats.py)."""

    kind = None
    needs_base = False  # True: delta() needs W·x of its rows (DoRA)

    def __init__(self, in_features, out_features):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)

    def delta(self, x, base_rows=None, weight_rows=None):
        raise NotImplementedError

    def delta_weight(self):
        raise NotImplementedError

    def merged_weight(self, weight_rows):
        """W' of the rows, float32 (float64 for a float64 base), given W of the rows. Not differentiable."""
        with no_grad():
            w = wide(weight_rows)
            return w + self.delta_weight().to(w.dtype)

    def to_part(self, rows=None):
        raise NotImplementedError

    def load_part(self, part):
        raise NotImplementedError

    # helpers for subclasses
    def _check_load(self, part, names):
        from .formats import AdapterFormatError
        if part.kind != self.kind:
            raise AdapterFormatError(f"cannot load a {part.kind} adapter into a {self.kind} adapter")
        for name, want in names.items():
            if name not in part.tensors:
                raise AdapterFormatError(f"{self.kind}: the file has no {name!r} (has {sorted(part.tensors)})")
            got = tuple(np.shape(part.tensors[name]))
            if got != tuple(want):
                raise AdapterFormatError(f"{self.kind}: {name!r} has shape {fmt_shape(got)}, the adapter expects "
                                         f"{fmt_shape(want)} (out {self.out_features}, in {self.in_features})")

    @staticmethod
    def _assign(param, value):
        with no_grad():
            param.copy_(flame.as_tensor(np.asarray(value).astype(param.dtype.np)))

    @staticmethod
    def _host(t):
        return t.detach().numpy().copy()


# ----------------------------------------------------------------------------- adapted layers
class AdaptedMixin:
    """What adapted layers share (mixed in front of the layer's class by `adapt`): attaching, weighting, merging.
    State lives in plain attributes (not registered): _adapters {name: [((lo, hi), Adapter)]}, _weights {name:
    multiplier} (the active ones), _merged {name: weight it was merged with}, adapters_enabled. Rows are output rows
    (dim 0 of the weight); a subclass defines forward and `_check_fit`."""

    def _check_fit(self, adapter, lo, hi):
        raise NotImplementedError

    def _active(self):
        """[(lo, hi, Adapter, multiplier)] that the forward adds (enabled, active, unmerged)."""
        if not self.adapters_enabled or not self._weights:
            return []
        out = []
        for name, mult in self._weights.items():
            if name in self._merged:
                continue
            for (lo, hi), ad in self._adapters[name]:
                ad.__dict__["training"] = self.training  # adapters sit outside the module tree: follow the layer
                out.append((lo, hi, ad, mult))
        return out

    # -- management
    def add_adapter(self, name, adapter, rows=None):
        out = self.weight.shape[0]
        lo, hi = (0, out) if rows is None else (int(rows[0]), int(rows[1]))
        self._check_fit(adapter, lo, hi)
        for (a, b), _ in self._adapters.get(name, []):
            if a < hi and lo < b:
                raise AdapterError(f"adapter {name!r} already covers rows [{a}:{b}], which overlap [{lo}:{hi}]")
        self._adapters.setdefault(name, []).append(((lo, hi), adapter))
        self._adapters[name].sort(key=lambda e: e[0][0])
        self._weights.setdefault(name, 1.0)
        return adapter

    def remove_adapter(self, name):
        if name in self._merged:
            self.unmerge(name)
        self._adapters.pop(name, None)
        self._weights.pop(name, None)

    def merge(self, name):
        """Fold adapter `name` (times its weight) into the base weight. The first merge keeps a host copy of the
        original weight, so unmerging (any adapter, in any order) is exact."""
        if name in self._merged or name not in self._adapters:
            return
        if self.weight.dtype is flame.float8_e4m3fn:   # (fp8 storage: rows without their scales)
            raise AdapterError(f"merge({name!r}): this Linear stores its weight in fp8, which cannot take a merged "
                               f"change; its adapters run beside it unmerged (merge into the weight before fp8 "
                               f"storage, or keep them as adapters)")
        if not self._merged:
            self.__dict__["_original"] = self.weight.detach().to("cpu", copy=True)
        self._fold(name)
        self._merged[name] = self._weights.get(name, 1.0)

    def _fold(self, name):
        mult = self._weights.get(name, 1.0)
        with no_grad():
            for (lo, hi), ad in self._adapters[name]:
                rows = self.weight[lo:hi]
                w0 = wide(rows)
                new = ad.merged_weight(rows)
                new = w0 + (new - w0) * mult if mult != 1.0 else new
                self.weight[lo:hi] = new.to(self.weight.dtype)

    def unmerge(self, name=None):
        """Take adapter `name` (all when None) out of the weight: restore the original, refold the others."""
        if name is not None and name not in self._merged:
            return
        keep = [] if name is None else [n for n in self._merged if n != name]
        orig = self.__dict__.pop("_original", None)
        if orig is None:
            return
        with no_grad():
            self.weight.copy_(orig.to(self.weight.device))
        self._merged.clear()
        for n in keep:
            self.merge(n)


def base_rows(layer, lo, hi):
    """Rows lo:hi of a Linear's base weight as values (DoRA reads them): an fp8-stored layer's dequantised into its
    compute dtype (its stored rows lack their scales), any other layer's as they are."""
    if layer.weight.dtype is flame.float8_e4m3fn and hasattr(layer, "dequantized_weight"):
        return layer.dequantized_weight(rows=(lo, hi))
    return layer.weight[lo:hi]


class AdaptedLinearMixin(AdaptedMixin):
    """The adapted Linear: y = base(x), then every active adapter's output added into its rows.

    Plain LoRAs (no dropout while training, one dtype for the adapter's arithmetic) on a layer with a fused form
    (Linear.fused_low_rank: a plain Linear with a float weight -- flame_core.ops.linear.linear_low_rank --, or an
    fp8-compute Linear -- flame_nn.offload.fp8_compute) run as one fused op instead: their rank-r products
    accumulate into the output rows and into the input's gradient inside the GEMMs, so no (N, out) delta is formed,
    added, or copied back out of the output gradient. `fuse_lora = False` (on the class or a layer) keeps the
    general path."""

    fuse_lora = True

    def _fused_factors(self, input, active):
        """[(A, B, lo, hi, scale)] when every active adapter can run fused (see the class docstring), else None."""
        from .lora import LoRA
        if not self.fuse_lora:
            return None
        base_dtype = getattr(self, "compute_dtype", self.weight.dtype)   # an fp8 layer's: what its GEMMs output
        factors = []
        for lo, hi, ad, mult in active:
            if type(ad) is not LoRA or (ad.training and (ad.dropout or ad.rank_dropout or ad.module_dropout)):
                return None   # (the dropouts act between its matmuls)
            if not autocast_on(input) and not input.dtype == base_dtype == ad.lora_A.dtype:
                return None   # outside autocast the adapter computes in its own dtype (adapter_input)
            factors.append((ad.lora_A, ad.lora_B, lo, hi, ad.scale * mult))
        return factors

    def forward(self, input):
        active = self._active()
        if not active:
            return super().forward(input)
        factors = self._fused_factors(input, active)
        if factors is not None:
            out = self.fused_low_rank(input, factors)
            if out is not None:
                return out
        y = super().forward(input)
        deltas = []
        for lo, hi, ad, mult in active:
            base = w = None
            if ad.needs_base:
                w = base_rows(self, lo, hi)
                b = None if self.bias is None else self.bias[lo:hi]
                base = y[..., lo:hi] - b if b is not None else y[..., lo:hi] * 1  # a copy: y changes below
            d = ad.delta(input, base, w)
            deltas.append((lo, hi, d if mult == 1.0 else d * mult))
        for lo, hi, d in deltas:
            y = add_rows(y, d, lo, hi)
        return y

    def forward_split(self, input, split_sizes):
        """Linear.forward_split with the adapters: fused (one node, no concatenating backward) when every active
        adapter runs fused and lies inside one part, else the adapted forward's output split."""
        active = self._active()
        factors = self._fused_factors(input, active) if active else []
        if factors is not None and not self.has_hooks():    # the fused node would bypass the hooks
            bounds, lo = [], 0
            for n in split_sizes:
                bounds.append((lo, lo + n))
                lo += n
            if all(any(p0 <= f[2] and f[3] <= p1 for p0, p1 in bounds) for f in factors):
                out = self.fused_low_rank(input, factors, split_sizes)
                if out is not None:
                    return out
        return self(input).split(list(split_sizes), dim=-1)

    def _check_fit(self, adapter, lo, hi):
        if not 0 <= lo < hi <= self.out_features or adapter.out_features != hi - lo or \
                adapter.in_features != self.in_features:
            raise AdapterError(f"adapter ({adapter.out_features} x {adapter.in_features}) does not fit rows "
                               f"[{lo}:{hi}] of a Linear ({self.out_features} x {self.in_features})")


_CLASSES = {}


def adapt(layer):
    """Make `layer` -- a Linear (any class with `weight` (out, in), optional `bias` and a forward) or a Conv2d -- an
    adapted layer in place (idempotent); returns it."""
    if isinstance(layer, AdaptedMixin):
        return layer
    from ..layers.conv import Conv2d
    d = layer.__dict__
    if isinstance(layer, Conv2d):
        from .conv_layer import AdaptedConv2dMixin, check_conv
        check_conv(layer)
        mixin = AdaptedConv2dMixin
    else:
        w = getattr(layer, "weight", None)
        if not isinstance(w, Tensor) or w.ndim != 2:
            raise AdapterError(f"{type(layer).__name__} has no 2-D weight (out, in); adapters wrap Linear and "
                               f"Conv2d layers")
        mixin = AdaptedLinearMixin
        d.setdefault("in_features", w.shape[1])
        d.setdefault("out_features", w.shape[0])
        d.setdefault("bias", None)
    cls = type(layer)
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type("Adapted" + cls.__name__, (mixin, cls), {"_base_class": cls})
    d["_adapters"], d["_weights"], d["_merged"], d["adapters_enabled"] = {}, {}, {}, True
    layer.__class__ = new
    return layer


def unadapt(layer):
    """Remove every adapter (unmerging merged ones) and give the layer back its own class."""
    if not isinstance(layer, AdaptedMixin):
        return layer
    for name in list(layer._adapters):
        layer.remove_adapter(name)
    for k in ("_adapters", "_weights", "_merged", "adapters_enabled", "_original"):
        layer.__dict__.pop(k, None)
    layer.__class__ = layer._base_class
    return layer
