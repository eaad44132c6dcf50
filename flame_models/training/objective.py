"""The rectified-flow (flow-matching) objective (Flux, SD3).

    x_t = (1 − σ)·x0 + σ·ε        (σ = 0: data, σ = 1: noise)
    v   = ε − x0                  (the velocity the transformer predicts)
    L   = mean((v̂ − v)²)          (MSE over every element, computed in float32)
"""
from flame_core.errors import ShapeError, fmt_shape


def _per_sample(sigma, like):
    """σ of shape (B,) broadcast against `like` (B, ...) and cast to its dtype."""
    if sigma.ndim != 1 or sigma.shape[0] != like.shape[0]:
        raise ShapeError(f"sigma must have shape ({like.shape[0]},) for latents of shape {fmt_shape(like.shape)}, "
                         f"got {fmt_shape(sigma.shape)}")
    return sigma.to(like.dtype).reshape((like.shape[0],) + (1,) * (like.ndim - 1))


def noisy_latents(x0, noise, sigma):
    """x_t = (1 − σ)·x0 + σ·ε, per sample."""
    if x0.shape != noise.shape:
        raise ShapeError(f"latents {fmt_shape(x0.shape)} and noise {fmt_shape(noise.shape)} differ in shape")
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def velocity_target(x0, noise):
    """v = ε − x0: the same for every σ on the straight path from data to noise."""
    return noise - x0


def flow_matching_loss(pred, target):
    """Mean squared error over all elements, in float32 (bf16 predictions are upcast first)."""
    if pred.shape != target.shape:
        raise ShapeError(f"prediction {fmt_shape(pred.shape)} and target {fmt_shape(target.shape)} differ in shape")
    d = pred.float() - target.float()
    return (d * d).mean()


class FlowMatching:
    """The rectified-flow objective as the trainer uses it (see family.py for the Objective interface):
    σ drawn by `timestep_type` (timesteps.py), x_t = (1 − σ)x0 + σε, target v = ε − x0, MSE in float32."""
    name = "flow_matching"

    def __init__(self, timestep_type="sigmoid", *, shift=3.0, sigmoid_scale=1.0, logit_mean=0.0, logit_std=1.0):
        from .timesteps import TIMESTEP_TYPES
        if timestep_type not in TIMESTEP_TYPES:
            raise ValueError(f"unknown timestep type {timestep_type!r}; choose one of {', '.join(TIMESTEP_TYPES)}")
        self.timestep_type = timestep_type
        self.kwargs = dict(shift=shift, sigmoid_scale=sigmoid_scale, logit_mean=logit_mean, logit_std=logit_std)

    def sample_timesteps(self, batch_size, *, generator, num_tokens, device):
        """(B,) σ in [0, 1], drawn on the CPU from `generator` (the same sequence on every device)."""
        from .timesteps import sample_sigmas
        return sample_sigmas(self.timestep_type, batch_size, generator=generator, num_tokens=num_tokens,
                             device=device, **self.kwargs)

    def noisy(self, x0, noise, t):
        return noisy_latents(x0, noise, t)

    def target(self, x0, noise, t):
        return velocity_target(x0, noise)

    def loss(self, pred, target):
        return flow_matching_loss(pred, target)
