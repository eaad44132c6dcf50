"""PyTorch's activations as modules: ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LeakyReLU, ELU, Softplus, Mish,
Hardswish, Hardtanh, ReLU6, Hardsigmoid, LogSigmoid, Softsign, Tanhshrink, SELU, CELU, Threshold, Hardshrink,
Softshrink, Softmin, GLU, PReLU, LogSoftmax, Softmax2d, RReLU."""
import flame_core as flame

from .. import functional as F
from ..empty_init import new_parameter
from ..module import Module


class _Inplace(Module):
    """An activation without parameters whose only option is `inplace`."""
    fn = None

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):
        return type(self).fn(input, inplace=self.inplace)

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""


class _Plain(Module):
    """An activation without options."""
    fn = None

    def forward(self, input):
        return type(self).fn(input)


class ReLU(_Inplace):
    fn = staticmethod(F.relu)


class SiLU(_Inplace):
    fn = staticmethod(F.silu)


class Mish(_Inplace):
    fn = staticmethod(F.mish)


class Hardswish(_Inplace):
    fn = staticmethod(F.hardswish)


class Tanh(_Plain):
    fn = staticmethod(F.tanh)


class Sigmoid(_Plain):
    fn = staticmethod(F.sigmoid)


class GELU(Module):
    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input):
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate='{self.approximate}'"


class Softmax(Module):
    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.softmax(input, -1 if self.dim is None else self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LeakyReLU(Module):
    def __init__(self, negative_slope=0.01, inplace=False):
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, input):
        return F.leaky_relu(input, self.negative_slope, self.inplace)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace else "")


class RReLU(Module):
    """Randomized leaky ReLU: a random slope in [lower, upper] for each x <= 0 in training, their mean in eval."""

    def __init__(self, lower=1.0 / 8, upper=1.0 / 3, inplace=False):
        super().__init__()
        self.lower, self.upper, self.inplace = lower, upper, inplace

    def forward(self, input):
        return F.rrelu(input, self.lower, self.upper, self.training, self.inplace)

    def extra_repr(self):
        return f"lower={self.lower}, upper={self.upper}" + (", inplace=True" if self.inplace else "")


class ELU(Module):
    def __init__(self, alpha=1.0, inplace=False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, input):
        return F.elu(input, self.alpha, self.inplace)

    def extra_repr(self):
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class Softplus(Module):
    def __init__(self, beta=1.0, threshold=20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, input):
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self):
        return f"beta={self.beta}, threshold={self.threshold}"


class Hardtanh(Module):
    def __init__(self, min_val=-1.0, max_val=1.0, inplace=False):
        super().__init__()
        if min_val > max_val:
            raise ValueError(f"Hardtanh: min_val ({min_val}) must not be greater than max_val ({max_val})")
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, input):
        return F.hardtanh(input, self.min_val, self.max_val, self.inplace)

    def extra_repr(self):
        return f"min_val={self.min_val}, max_val={self.max_val}" + (", inplace=True" if self.inplace else "")


class ReLU6(_Inplace):
    fn = staticmethod(F.relu6)


class Hardsigmoid(_Inplace):
    fn = staticmethod(F.hardsigmoid)


class SELU(_Inplace):
    fn = staticmethod(F.selu)


class LogSigmoid(_Plain):
    fn = staticmethod(F.logsigmoid)


class Softsign(_Plain):
    fn = staticmethod(F.softsign)


class Tanhshrink(_Plain):
    fn = staticmethod(F.tanhshrink)


class CELU(Module):
    def __init__(self, alpha=1.0, inplace=False):
        super().__init__()
        if alpha == 0:
            raise ValueError("CELU: alpha must not be 0")
        self.alpha, self.inplace = alpha, inplace

    def forward(self, input):
        return F.celu(input, self.alpha, self.inplace)

    def extra_repr(self):
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class Threshold(Module):
    def __init__(self, threshold, value, inplace=False):
        super().__init__()
        self.threshold, self.value, self.inplace = threshold, value, inplace

    def forward(self, input):
        return F.threshold(input, self.threshold, self.value, self.inplace)

    def extra_repr(self):
        return f"threshold={self.threshold}, value={self.value}" + (", inplace=True" if self.inplace else "")


class Hardshrink(Module):
    def __init__(self, lambd=0.5):
        super().__init__()
        self.lambd = lambd

    def forward(self, input):
        return F.hardshrink(input, self.lambd)

    def extra_repr(self):
        return f"{self.lambd}"


class Softshrink(Hardshrink):
    def forward(self, input):
        return F.softshrink(input, self.lambd)


class Softmin(Module):
    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.softmin(input, -1 if self.dim is None else self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class GLU(Module):
    def __init__(self, dim=-1):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.glu(input, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class PReLU(Module):
    """x where x > 0, else a * x with a learned slope `weight`: one shared (num_parameters=1) or one per channel."""

    def __init__(self, num_parameters=1, init=0.25, device=None, dtype=None):
        super().__init__()
        if num_parameters < 1:
            raise ValueError(f"PReLU: num_parameters must be >= 1, got {num_parameters}")
        self.num_parameters, self.init = num_parameters, float(init)
        self.weight = new_parameter((num_parameters,), dtype, device)
        if not self.weight.is_meta:
            with flame.no_grad():
                self.weight.fill_(self.init)

    def forward(self, input):
        return F.prelu(input, self.weight)

    def extra_repr(self):
        return f"num_parameters={self.num_parameters}"


class LogSoftmax(Module):
    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.log_softmax(input, -1 if self.dim is None else self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class Softmax2d(Module):
    """Softmax over the channels of (N, C, H, W) or (C, H, W)."""

    def forward(self, input):
        if input.ndim not in (3, 4):
            raise ValueError(f"Softmax2d: expected a 3-D or 4-D input, got shape {tuple(input.shape)}")
        return F.softmax(input, -3)
