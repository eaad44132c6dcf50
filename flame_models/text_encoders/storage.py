"""Packed parameter storage: the loaded parameters of a model (or of one streamed block) as views of one flat
buffer per dtype, and fused views over sibling weights that sit back to back in it.

Why: the memory pool rounds every tensor of 10 MiB or more up to 2 MiB; CLIP-G's 64 MLP weights of 12.5 MiB
would each lose 1.5 MiB (96 MiB, 7% of the model). One buffer rounds once. And since siblings are laid out next to
each other -- the q, k, v projections' weights, then their biases -- the three projections can run as ONE matmul
over a (3H, H) view of the buffer (`FusedProjections`): fewer, larger launches for layers too small to keep a GPU
busy on their own (77 tokens).

Layout: parameters are grouped by (grandparent module, leaf name) -- e.g. every `weight` of `...self_attn.*_proj`
-- in registration order; a group starts 256-byte aligned, its members follow each other at 16-byte alignment.
A fused view is made only over members that are exactly contiguous, and used only while the layers still hold
those views (checked by address on every call: `.to()`, a reload, fp8 storage, adapters or a BlockStreamer that
rebinds a parameter turn it off) and no gradient is wanted for them. Layers loaded into fp8 storage get the same from
`FusedFp8Projections`: their fp8 rows and scales stacked (the layers then hold row views of them), one
dequantisation and one GEMM per group.
"""
import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_nn.offload import Float8LinearMixin, OffloadError, fp8_linear, stack_fp8_weights_

GROUP_ALIGN = 256
MEMBER_ALIGN = 16


def _aligned(n, step):
    return (n + step - 1) // step * step


class Packed:
    """Flat buffers for some parameters of a module: `views` {local name: uninitialised view of the parameter's
    shape} to fill (copy_) and assign, and `stacked(names)` for fused views."""

    def __init__(self, module, targets):
        """targets: {local parameter name: dtype}; each parameter keeps its device."""
        params = dict(module.named_parameters())
        groups = {}
        for name, dtype in targets.items():
            parent, _, leaf = name.rpartition(".")
            grand = parent.rpartition(".")[0]
            key = (str(params[name].device), flame.dtypes.dtype(dtype).name, grand, leaf)
            groups.setdefault(key, []).append(name)
        layouts = {}  # (device, dtype) -> ([(name, element offset)], [size in elements])
        for (dev, dt, _, _), names in groups.items():
            itemsize = flame.dtypes.dtype(dt).itemsize
            entries, size = layouts.setdefault((dev, dt), ([], [0]))
            off = _aligned(size[0] * itemsize, GROUP_ALIGN) // itemsize
            for name in names:
                off = _aligned(off * itemsize, MEMBER_ALIGN) // itemsize
                entries.append((name, off))
                off += params[name].numel()
            size[0] = off
        self.views, self._where = {}, {}
        for (dev, dt), (entries, size) in layouts.items():
            flat = flame.empty(max(size[0], 1), dtype=dt, device=dev)
            for name, off in entries:
                shape = tuple(params[name].shape)
                self.views[name] = flat[off:off + params[name].numel()].view(*shape)
                self._where[name] = (flat, off, params[name].numel())

    def stacked(self, names):
        """One view over the parameters `names` stacked on dim 0, when they are back to back in one buffer."""
        if not all(n in self._where for n in names):
            return None
        flat, start, _ = self._where[names[0]]
        off = start
        first = self.views[names[0]]
        for n in names:
            f, o, numel = self._where[n]
            if f is not flat or o != off or tuple(self.views[n].shape[1:]) != tuple(first.shape[1:]):
                return None
            off += numel
        rows = sum(self.views[n].shape[0] for n in names)
        return flat[start:off].view(rows, *first.shape[1:])


def _grad_wanted(linears):
    """Whether a gradient is to be recorded for a parameter of these layers (they then run one by one)."""
    return flame.is_grad_enabled() and any(p is not None and p.requires_grad for m in linears
                                           for p in (m.weight, m.bias))


class FusedProjections:
    """Linear layers reading the same input (q, k, v) run as one matmul over their stacked weights (and biases)."""

    def __init__(self, linears, weight, bias):
        self.linears, self.weight, self.bias = tuple(linears), weight, bias
        # where each layer's weight and bias must start for the stacked views to be theirs (while this holds the
        # buffer, no other array can take those addresses)
        step = weight.element_size()
        w0, b0 = weight.data_ptr(), bias.data_ptr() if bias is not None else None
        self._expect = []
        self._seen = None   # the layers' (weight, bias) arrays when `matches` last passed
        for m in linears:
            self._expect.append((m, w0, b0))
            w0 += m.weight.numel() * step
            if b0 is not None:
                b0 += m.bias.numel() * step

    @classmethod
    def make(cls, module, names, packed, path):
        """For the child Linears `names` of `module` (at `path` in the packed unit), freshly assigned from
        `packed`; None when they cannot be fused."""
        linears = [getattr(module, n) for n in names]
        if any(type(m) is not flame_nn.Linear for m in linears):
            return None
        p = f"{path}." if path else ""
        weight = packed.stacked([f"{p}{n}.weight" for n in names])
        has_bias = [m.bias is not None for m in linears]
        bias = packed.stacked([f"{p}{n}.bias" for n in names]) if all(has_bias) else None
        if weight is None or (any(has_bias) and bias is None):
            return None
        return cls(linears, weight, bias)

    def matches(self):
        """The layers are still plain Linears whose weights and biases are the views this was made over. The arrays
        that last passed are remembered: the same array objects again (an array's address never changes) pass
        without reading the addresses (the per-call case)."""
        seen = self._seen
        if seen is not None:
            for (m, _, _), (wa, ba) in zip(self._expect, seen):
                if type(m) is not flame_nn.Linear or m.weight.array is not wa or (
                        ba is not None and (m.bias is None or m.bias.array is not ba)):
                    break
            else:
                return True
        for m, w, b in self._expect:
            if type(m) is not flame_nn.Linear or m.weight.data_ptr() != w:
                return False
            if b is not None and (m.bias is None or m.bias.data_ptr() != b):
                return False
        self._seen = tuple((m.weight.array, None if b is None else m.bias.array) for m, _, b in self._expect)
        return True

    def __call__(self, x):
        """The layers' outputs concatenated on the last dim, or None when they must run one by one (a gradient is
        wanted for their parameters, or they no longer match: see `matches`)."""
        if _grad_wanted(self.linears):
            return None
        return F.linear(x, self.weight, self.bias) if self.matches() else None


class FusedFp8Projections:
    """FusedProjections for Linears in fp8 storage (a file's fp8 weights, or quantize="fp8"): their fp8 rows and
    scales stacked into one tensor each (`stack_fp8_weights_`, the layers re-pointed at row views of them), run as
    ONE dequantisation and ONE GEMM (`fp8_linear`) instead of one of each per layer. The same contract as
    FusedProjections: `__call__` gives None when the layers must run one by one (a gradient wanted, or they no longer
    hold the stacked views, or an input or bias of another dtype: their own checks then speak)."""

    def __init__(self, linears, q, scales, bias):
        self.linears, self.q, self.scales, self.bias = tuple(linears), q, scales, bias
        self._cls = type(linears[0])
        self._arrays = tuple((m.weight.array, m.weight_scale.array, None if m.bias is None else m.bias.array)
                             for m in linears)

    @classmethod
    def make(cls, module, names, packed, path):
        """For the child Linears `names` of `module`, in fp8 storage (per-row scales) and without fp8 compute, of
        one class, input width, compute dtype and device, their biases (if any) back to back in `packed`; None
        otherwise."""
        linears = [getattr(module, n) for n in names]
        first = linears[0]
        if not (isinstance(first, Float8LinearMixin) and type(first).forward is Float8LinearMixin.forward) \
                or any(type(m) is not type(first) for m in linears):
            return None
        has_bias = [m.bias is not None for m in linears]
        bias = None
        if any(has_bias):  # the biases were just assigned from `packed`: back to back when it stacks them
            p = f"{path}." if path else ""
            bias = packed.stacked([f"{p}{n}.bias" for n in names]) if all(has_bias) else None
            if bias is None:
                return None
        try:
            q, scales = stack_fp8_weights_(linears)  # (its checks: fp8 compute, width, compute dtype, device)
        except OffloadError:
            return None
        return cls(linears, q, scales, bias)

    def matches(self):
        """The layers are still of their class, without fp8 compute, holding the stacked views (and biases) that
        this was made over (array identity: an array's address never changes)."""
        for m, (w, s, b) in zip(self.linears, self._arrays):
            if (type(m) is not self._cls or m.fp8_compute or m.weight.array is not w or m.weight_scale.array is not s
                    or (b is not None and (m.bias is None or m.bias.array is not b))):
                return False
        return True

    def __call__(self, x):
        ms = self.linears
        if _grad_wanted(ms) or not self.matches():
            return None
        dt = ms[0].compute_dtype
        if flame.amp.is_autocast_enabled("cuda" if x.is_cuda else "cpu"):
            return None  # (the layers' own path casts under autocast)
        if x.dtype != dt or (self.bias is not None and self.bias.dtype != dt):
            return None
        return fp8_linear(x, self.q, self.scales, self.bias, dt)


def fuse_fp8_projections_(module, packed):
    """FusedFp8Projections on every submodule of `module` whose class declares `fusable_projections` and that has
    no FusedProjections (its Linears are in fp8 storage), where they can be stacked."""
    for path, m in module.named_modules():
        names = getattr(type(m), "fusable_projections", None)
        if names and m.__dict__.get("fused_projections") is None:
            m.__dict__["fused_projections"] = FusedFp8Projections.make(m, names, packed, path)


def fuse_projections_(module, packed):
    """Attach FusedProjections to every submodule of `module` (the unit `packed` was made for) whose class declares
    `fusable_projections` (names of child Linears), where they lie back to back."""
    for path, m in module.named_modules():
        names = getattr(type(m), "fusable_projections", None)
        if names:
            m.__dict__["fused_projections"] = FusedProjections.make(m, names, packed, path)


def drop_stale_fusions_(module):
    """Forget the fused views whose layers no longer hold them (after `.to()`, a reload...), so that the buffer they
    point into can be freed."""
    for m in module.modules():
        f = m.__dict__.get("fused_projections")
        if f is not None and not f.matches():
            m.__dict__["fused_projections"] = None


def project_heads(attn, x, num_heads, head_dim):
    """q, k, v (B, heads, L, D) of x (B, L, width) through `attn`'s fused q|k|v matmul when it has one, else through
    its three projections (CLIP's q_proj / k_proj / v_proj, T5's q / k / v: `fusable_projections`)."""
    B, L, _ = x.shape
    fused = attn.fused_projections
    qkv = fused(x) if fused is not None else None
    if qkv is not None:
        qkv = qkv.reshape(B, L, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)              # (3, B, heads, L, D)
        return qkv[0], qkv[1], qkv[2]
    return tuple(getattr(attn, n)(x).reshape(B, L, num_heads, head_dim).transpose(1, 2)
                 for n in attn.fusable_projections)
