"""Identity, Linear, Bilinear, Flatten, Unflatten."""
import math

import flame_core as flame
from flame_core.ops.linear import linear_cat2, linear_low_rank

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module

FUSED_DTYPES = (flame.float32, flame.float16, flame.bfloat16, flame.float64)   # the fused GEMM paths' weight dtypes


class Identity(Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):
        return input


class Linear(Module):
    """y = x W^T + b with W (out_features, in_features); PyTorch's default init (kaiming_uniform a=sqrt(5))."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_parameter((out_features, in_features), dtype, device)
        self.bias = new_parameter((out_features,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)

    def forward_split(self, input, split_sizes):
        """self(input).split(split_sizes, -1) for a fused projection whose output parts feed different ops (Flux's
        single-block linear1: q | k | v | mlp): one GEMM whose parts come back as views, and whose backward takes
        the parts' gradients as they are instead of concatenating them first (a copy of the whole output gradient,
        held next to the parts). Subclasses with their own forward and no fused form (fused_low_rank) keep that
        forward."""
        out = None if self.has_hooks() else self.fused_low_rank(input, [], split_sizes)   # hooks: the call
        return out if out is not None else self(input).split(list(split_sizes), dim=-1)

    def forward_cat2(self, a, b):
        """self(cat((a, b), -1)) without building the concatenation where the layer has a fused form (a plain Linear:
        flame_core.ops.linear.linear_cat2; an fp8-compute Linear: flame_nn.offload.fp8_compute), else through the
        layer's own forward (adapted, streamed...) and when the layer has hooks (they see the joined input)."""
        out = None if self.has_hooks() else self.fused_cat2(a, b)
        return out if out is not None else self(flame.cat((a, b), dim=-1))

    def forward_gelu_mlp(self, input, fc2, approximate="none"):
        """fc2(gelu(self(input), approximate)) -- an MLP's two Linears around its GELU -- as one fused node where the
        layers have one (fp8-compute Linears with delayed scaling, not adapted, no hooks: flame_nn.offload.
        fp8_compute.Float8ComputeGeluMlp, the same numbers without the GELU's output in the compute dtype), else
        through the layers' own calls."""
        out = None if self.has_hooks() or fc2.has_hooks() else self.fused_gelu_mlp(input, fc2, approximate)
        return out if out is not None else fc2(F.gelu(self(input), approximate=approximate))

    def fused_gelu_mlp(self, input, fc2, approximate):
        """forward_gelu_mlp's fused node, or None where this layer has none (only fp8-compute Linears define one)."""
        return None

    def forward_cat2_gelu(self, a, h, approximate="none"):
        """self(cat((a, gelu(h, approximate)), -1)) (Flux's single-block linear2 over attention | GELU(MLP)): one
        fused node where the layer has one (an fp8-compute Linear with delayed scaling, not adapted, no hooks:
        flame_nn.offload.fp8_compute.Float8ComputeCat2Gelu, gelu(h) never written in the compute dtype), else
        forward_cat2 of (a, gelu(h))."""
        out = None if self.has_hooks() else self.fused_cat2_gelu(a, h, approximate)
        return out if out is not None else self.forward_cat2(a, F.gelu(h, approximate=approximate))

    def fused_cat2_gelu(self, a, h, approximate):
        """forward_cat2_gelu's fused node, or None where this layer has none (only fp8-compute Linears define one)."""
        return None

    def fused_cat2(self, a, b):
        """forward_cat2's fused node, or None where this layer's class has none (any subclass with its own forward,
        adapted layers included: their adapters need the joined input)."""
        if type(self) is Linear and self.weight.dtype in FUSED_DTYPES:
            return linear_cat2(a, b, self.weight, self.bias)
        return None

    def fused_low_rank(self, input, factors, splits=None):
        """This layer's product with low-rank updates of output-row blocks (`factors` [(A, B, lo, hi, scale)]) and /
        or its output as column-block views (`splits`), as one fused node (flame_core.ops.linear.linear_low_rank),
        or None where the layer has no fused form: a subclass with its own forward (streamed...), or a weight
        dtype the GEMMs do not take. fp8 Linears define their own (flame_nn.offload.fp8)."""
        if getattr(self, "_base_class", type(self)) is Linear and self.weight.dtype in FUSED_DTYPES:
            return linear_low_rank(input, self.weight, self.bias, factors, splits=splits)
        return None

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bilinear(Module):
    """y = x1^T W x2 + b with W (out_features, in1_features, in2_features); init uniform(+-1/sqrt(in1_features))."""

    def __init__(self, in1_features, in2_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in1_features, self.in2_features, self.out_features = in1_features, in2_features, out_features
        self.weight = new_parameter((out_features, in1_features, in2_features), dtype, device)
        self.bias = new_parameter((out_features,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1 / math.sqrt(self.weight.shape[1])
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input1, input2):
        return F.bilinear(input1, input2, self.weight, self.bias)

    def extra_repr(self):
        return (f"in1_features={self.in1_features}, in2_features={self.in2_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class Flatten(Module):
    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self):
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    def __init__(self, dim, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input):
        return input.unflatten(self.dim, self.unflattened_size)

    def extra_repr(self):
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"
