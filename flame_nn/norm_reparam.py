"""PyTorch's weight reparameterisations of torch.nn.utils (the hook-based forms whose state_dict keys old checkpoints
carry): weight_norm / remove_weight_norm (weight = g * v / ||v||, parameters `<name>_g` and `<name>_v`) and
spectral_norm / remove_spectral_norm (weight = W / sigma(W), sigma by power iteration; parameter `<name>_orig`,
buffers `<name>_u` and `<name>_v`, one power iteration per forward in training mode). The weight is recomputed by a
forward pre-hook, so the module's own forward is unchanged."""
import flame_core as flame
from flame_core.autograd import no_grad

from . import functional as F
from .parameter import Parameter


def _norm_except_dim(v, dim):
    """||v|| over every dim but `dim` (shape kept, ones elsewhere); dim=None or -1: the norm of all of v."""
    if dim is None or dim == -1:
        return (v * v).sum().sqrt()
    dim %= v.ndim
    axes = tuple(d for d in range(v.ndim) if d != dim)
    return (v * v).sum(axes, keepdim=True).sqrt() if axes else v.abs()


class _WeightNorm:
    def __init__(self, name, dim):
        self.name, self.dim = name, dim

    def compute_weight(self, module):
        g, v = getattr(module, self.name + "_g"), getattr(module, self.name + "_v")
        return v * (g / _norm_except_dim(v, self.dim))

    def __call__(self, module, inputs):
        setattr(module, self.name, self.compute_weight(module))


def weight_norm(module, name="weight", dim=0):
    """Replaces module.<name> by g * v / ||v|| (norm over every dim but `dim`; dim=None: over all), with the new
    parameters <name>_g (the norms) and <name>_v (the direction), recomputed before every forward. Returns module."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _WeightNorm) and hook.name == name:
            raise RuntimeError(f"cannot register two weight_norm hooks on the same parameter {name}")
    weight = getattr(module, name)
    if dim is None:
        dim = -1
    fn = _WeightNorm(name, dim)
    delattr(module, name)
    with no_grad():
        module.register_parameter(name + "_g", Parameter(_norm_except_dim(weight, dim).detach().clone()))
        module.register_parameter(name + "_v", Parameter(weight.detach().clone()))
    setattr(module, name, fn.compute_weight(module))
    module.register_forward_pre_hook(fn)
    return module


def _pop_hook(module, kind, name, what):
    """Removes and returns the `kind` pre-hook of parameter `name` (ValueError when there is none)."""
    for hid, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, kind) and hook.name == name:
            del module._forward_pre_hooks[hid]
            return hook
    raise ValueError(f"{what} of '{name}' not found in {module}")


def _fold(module, name, weight, parts):
    """module.<name> becomes a plain Parameter holding `weight`; the reparameterisation's `parts` go."""
    delattr(module, name)
    for part in parts:
        delattr(module, name + part)
    module.register_parameter(name, Parameter(weight))
    return module


def remove_weight_norm(module, name="weight"):
    """Folds the weight norm back into a plain parameter <name>. Returns module."""
    hook = _pop_hook(module, _WeightNorm, name, "weight_norm")
    with no_grad():
        weight = hook.compute_weight(module).detach().clone()
    return _fold(module, name, weight, ("_g", "_v"))


class _SpectralNorm:
    def __init__(self, name, n_power_iterations, dim, eps):
        if n_power_iterations <= 0:
            raise ValueError(f"Expected n_power_iterations to be positive, but got n_power_iterations="
                             f"{n_power_iterations}")
        self.name, self.n_power_iterations, self.dim, self.eps = name, n_power_iterations, dim, eps

    def matrix(self, weight):
        w = weight
        if self.dim != 0:
            w = w.permute(self.dim, *[d for d in range(w.ndim) if d != self.dim])
        return w.reshape(w.shape[0], -1)

    def compute_weight(self, module, do_power_iteration):
        weight = getattr(module, self.name + "_orig")
        u, v = getattr(module, self.name + "_u"), getattr(module, self.name + "_v")
        mat = self.matrix(weight)
        if do_power_iteration:
            with no_grad():
                m = mat.detach()
                for _ in range(self.n_power_iterations):
                    v.copy_(F.normalize(m.mT @ u, dim=0, eps=self.eps))
                    u.copy_(F.normalize(m @ v, dim=0, eps=self.eps))
            u, v = u.clone(), v.clone()
        sigma = (u * (mat @ v)).sum()
        return weight / sigma

    def __call__(self, module, inputs):
        setattr(module, self.name, self.compute_weight(module, do_power_iteration=module.training))


def spectral_norm(module, name="weight", n_power_iterations=1, eps=1e-12, dim=None, generator=None):
    """Replaces module.<name> by W / sigma(W), sigma W's largest singular value estimated by power iteration (u and
    v kept as buffers <name>_u, <name>_v; `n_power_iterations` steps per forward in training, none in eval); the
    original weight becomes <name>_orig. dim: the output dim (default 1 for transposed convolutions, else 0).
    Returns module."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _SpectralNorm) and hook.name == name:
            raise RuntimeError(f"cannot register two spectral_norm hooks on the same parameter {name}")
    if dim is None:
        dim = 1 if type(module).__name__.startswith("ConvTranspose") else 0
    fn = _SpectralNorm(name, n_power_iterations, dim, eps)
    weight = getattr(module, name)
    with no_grad():
        mat = fn.matrix(weight)
        h, w = mat.shape
        u = F.normalize(flame.randn(h, dtype=weight.dtype, device=weight.device, generator=generator), dim=0, eps=eps)
        v = F.normalize(flame.randn(w, dtype=weight.dtype, device=weight.device, generator=generator), dim=0, eps=eps)
    delattr(module, name)
    module.register_parameter(name + "_orig", weight if isinstance(weight, Parameter) else Parameter(weight))
    setattr(module, name, weight.detach())
    module.register_buffer(name + "_u", u)
    module.register_buffer(name + "_v", v)
    module.register_forward_pre_hook(fn)
    return module


def remove_spectral_norm(module, name="weight"):
    """Folds the spectral norm back into a plain parameter <name> (the current W / sigma). Returns module."""
    hook = _pop_hook(module, _SpectralNorm, name, "spectral_norm")
    with no_grad():
        weight = hook.compute_weight(module, do_power_iteration=False).detach().clone()
    return _fold(module, name, weight, ("_orig", "_u", "_v"))
