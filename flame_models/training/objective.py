"""Training objectives: what a trainer step does between the clean latents and the loss. The loop calls, per
micro-batch (see family.py):

    t     = objective.sample_timesteps(B, generator=, num_tokens=, device=)   on the host side, from a CPU generator
    noise = objective.sample_noise(shape, generator=, device=)                 on the device, from the run's generator
    x_t   = objective.noisy(x0, noise, t)            \\
    pred  = family.forward(model, x_t, t, cond)       | inside the captured region: device work only (no host
    loss  = objective.loss(pred, objective.target(x0, noise, t), t)   /  synchronisation, no random draws)

This file: the rectified-flow objective (Flux, SD3) and what both objectives share (noise, per-sample weighted MSE).
The DDPM objective of ε / v-prediction models (SDXL) is ddpm_objective.py.

    x_t = (1 − σ)·x0 + σ·ε        (σ = 0: data, σ = 1: noise)
    v   = ε − x0                  (the velocity the transformer predicts)
    L   = mean_b(w(σ_b) · mean((v̂ − v)²))   (MSE in float32; w = 1 unless a loss weighting is chosen)

loss(..., mask=, sample_weights=) also takes a loss mask m (per element: the datasets' masks on the latent grid) and
further per-sample weights r_b (regularisation images' reg_weight): L = mean_b(w_b · r_b · mean(m · (v̂ − v)²))
(training/loss_weights.py makes both from a batch).

Loss weightings (train.weighting_scheme; diffusers' compute_loss_weighting_for_sd3 and kohya's names):
    none / uniform  w = 1
    sigma_sqrt      w = σ^-2
    cosmap          w = 2 / (π (1 − 2σ + 2σ²))
    logit_normal, mode   w = 1: in diffusers and kohya these name the timestep density, which FLAME draws by
                    train.timestep_type (the config makes them agree)
"""
import math

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape

WEIGHTING_SCHEMES = ("none", "uniform", "sigma_sqrt", "logit_normal", "mode", "cosmap")
# the schemes that choose the timestep density in diffusers / kohya (FLAME: timestep_type of the same name)
DENSITY_SCHEMES = ("logit_normal", "mode")


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


def weighted_mse(pred, target, weights, mask=None, element=None, threshold=None):
    """mean_b(w_b · mean over sample b's elements of m · (pred − target)²), in float32; weights (B,) or None (= 1);
    mask: per-element weights m broadcastable to pred (a loss mask on the latent grid), or None (= 1). element: a
    loss_types.ElementLoss in place of the square (None or l2: the square), with its `threshold`."""
    if element is not None and element.is_l2:
        element = None
    if weights is None and mask is None and element is None:
        return flow_matching_loss(pred, target)
    if pred.shape != target.shape:
        raise ShapeError(f"prediction {fmt_shape(pred.shape)} and target {fmt_shape(target.shape)} differ in shape")
    d = pred.float() - target.float()
    sq = d * d if element is None else element(d, threshold)
    if mask is not None:
        if mask.ndim != sq.ndim or any(m not in (1, s) for m, s in zip(mask.shape, sq.shape)):
            raise ShapeError(f"loss mask {fmt_shape(mask.shape)} does not broadcast to the prediction "
                             f"{fmt_shape(sq.shape)}")
        sq = sq * mask.float()
    per_sample = sq.reshape(d.shape[0], -1).mean(dim=1)                            # (B,)
    return (per_sample * weights.float()).mean() if weights is not None else per_sample.mean()


def combined_weights(weights, sample_weights):
    """An objective's per-sample weights (B,) or None times further per-sample weights (B,) or None."""
    if sample_weights is None:
        return weights
    return sample_weights.float() if weights is None else weights.float() * sample_weights.float()


def sd3_loss_weights(scheme, sigma):
    """The per-sample loss weights of `scheme` at σ (B,) as a float32 tensor, or None for weight 1 (diffusers'
    compute_loss_weighting_for_sd3)."""
    if scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"unknown weighting scheme {scheme!r}; choose one of {', '.join(WEIGHTING_SCHEMES)}")
    s = sigma.float()
    if scheme == "sigma_sqrt":
        return 1.0 / (s * s)
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s * s))
    return None


class Objective:
    """What every objective shares: the noise (Gaussian, plus kohya's / ai-toolkit's noise offset: a per-sample,
    per-channel constant offset·N(0, 1) added to it)."""
    name = None
    noise_offset = 0.0

    def sample_noise(self, shape, *, generator, device):
        """ε of `shape` (B, C, ...) float32 on `device`, drawn from `generator` (the offset's draw follows the noise
        draw, so a run without offset draws exactly what it did before offsets existed)."""
        noise = flame.randn(*shape, generator=generator, dtype=flame.float32, device=device)
        if self.noise_offset:
            offset = flame.randn(shape[0], shape[1], *([1] * (len(shape) - 2)), generator=generator,
                                 dtype=flame.float32, device=device)
            noise = noise + self.noise_offset * offset
        return noise


class FlowMatching(Objective):
    """The rectified-flow objective as the trainer uses it (see family.py for the Objective interface):
    σ drawn by `timestep_type` (timesteps.py), x_t = (1 − σ)x0 + σε, target v = ε − x0, MSE in float32 weighted
    by `weighting_scheme` (see the module docstring)."""
    name = "flow_matching"

    def __init__(self, timestep_type="sigmoid", *, shift=3.0, sigmoid_scale=1.0, logit_mean=0.0, logit_std=1.0,
                 mode_scale=1.29, weighting_scheme="none", noise_offset=0.0, element=None, bias="balanced"):
        from .timesteps import TIMESTEP_TYPES
        if timestep_type not in TIMESTEP_TYPES:
            raise ValueError(f"unknown timestep type {timestep_type!r}; choose one of {', '.join(TIMESTEP_TYPES)}")
        if weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"unknown weighting scheme {weighting_scheme!r}; choose one of "
                             f"{', '.join(WEIGHTING_SCHEMES)}")
        if weighting_scheme in DENSITY_SCHEMES and timestep_type != weighting_scheme:
            raise ValueError(f"weighting scheme {weighting_scheme!r} draws timesteps by its density: use timestep "
                             f"type {weighting_scheme!r} with it (got {timestep_type!r})")
        if noise_offset < 0:
            raise ValueError(f"noise_offset must be >= 0, got {noise_offset}")
        if element is not None and element.needs_threshold and element.huber_schedule == "snr":
            raise ValueError("the snr huber schedule is the DDPM objective's (its ᾱ); flow matching takes constant "
                             "or exponential")
        self.timestep_type, self.weighting_scheme, self.noise_offset = timestep_type, weighting_scheme, noise_offset
        self.element = element
        self.kwargs = dict(shift=shift, sigmoid_scale=sigmoid_scale, logit_mean=logit_mean, logit_std=logit_std,
                           mode_scale=mode_scale, bias=bias)

    def sample_timesteps(self, batch_size, *, generator, num_tokens, device):
        """(B,) σ in [0, 1], drawn on the CPU from `generator` (the same sequence on every device)."""
        from .timesteps import sample_sigmas
        return sample_sigmas(self.timestep_type, batch_size, generator=generator, num_tokens=num_tokens,
                             device=device, **self.kwargs)

    def noisy(self, x0, noise, t):
        return noisy_latents(x0, noise, t)

    def target(self, x0, noise, t):
        return velocity_target(x0, noise)

    def weights(self, t):
        """(B,) loss weights at σ = t, or None (all 1)."""
        return sd3_loss_weights(self.weighting_scheme, t)

    def loss(self, pred, target, t=None, *, mask=None, sample_weights=None):
        """The weighted MSE; `t` (the σ of each sample) is needed by the weighting schemes that depend on σ.
        mask: per-element loss weights broadcastable to pred; sample_weights: (B,), times the scheme's."""
        el = self.element
        if t is None:
            if self.weights_depend_on_t or (el is not None and el.needs_threshold and
                                            el.huber_schedule != "constant"):
                raise ValueError(f"weighting scheme {self.weighting_scheme!r} / the loss's threshold needs the "
                                 f"timesteps: loss(pred, target, t)")
            return weighted_mse(pred, target, combined_weights(None, sample_weights), mask, el,
                                None if el is None else el.threshold(None))
        c = el.threshold(t.float() * 1000.0) if el is not None and el.needs_threshold else None
        return weighted_mse(pred, target, combined_weights(self.weights(t), sample_weights), mask, el, c)

    @property
    def weights_depend_on_t(self):
        return self.weighting_scheme in ("sigma_sqrt", "cosmap")
