"""kohya's loss types (train.loss_type): the per-element error the objectives average, with d = pred − target:

    l2         d²                                   (the default: the MSE)
    l1         |d|
    huber      2c (√(d² + c²) − c)                  (pseudo-Huber: ≈ d² for |d| << c, ≈ 2c|d| beyond)
    smooth_l1  2 (√(d² + c²) − c)

and the threshold c per sample from its timestep (train.huber_schedule, kohya's get_huber_threshold_if_needed):

    constant     c = huber_c · huber_scale
    exponential  c = huber_c^(t / 1000) · huber_scale     (t on the 0-1000 scale: flow matching's 1000·σ, DDPM's step)
    snr          c = (1 − huber_c) / (1 + σ_t)² + huber_c   (DDPM only, σ_t = √((1 − ᾱ_t) / ᾱ_t); kohya's default)

Masks, per-sample weights and the mean over elements then batch apply as to the MSE (objective.weighted_mse).
"""
import math

import flame_core as flame

LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
NUM_TRAIN_TIMESTEPS = 1000


class ElementLoss:
    """The per-element error of `loss_type` (module docstring). threshold(t, sigma=None) gives c per sample (None
    for l2 / l1): t (B,) on the 0-1000 scale; sigma (B,) the DDPM σ_t, needed by the snr schedule."""

    def __init__(self, loss_type="l2", *, huber_c=0.1, huber_schedule="constant", huber_scale=1.0):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
        if huber_schedule not in HUBER_SCHEDULES:
            raise ValueError(f"unknown huber schedule {huber_schedule!r}; choose one of {', '.join(HUBER_SCHEDULES)}")
        if not 0 < huber_c <= 1 or not huber_scale > 0:
            raise ValueError(f"huber_c must be in (0, 1] and huber_scale > 0, got {huber_c} and {huber_scale}")
        self.loss_type, self.huber_c, self.huber_schedule = loss_type, float(huber_c), huber_schedule
        self.huber_scale = float(huber_scale)

    @property
    def is_l2(self):
        return self.loss_type == "l2"

    @property
    def needs_threshold(self):
        return self.loss_type in ("huber", "smooth_l1")

    def threshold(self, t, sigma=None):
        """(B,) float32 c, or a Python float (constant schedule), or None (l2 / l1)."""
        if not self.needs_threshold:
            return None
        if self.huber_schedule == "constant":
            return self.huber_c * self.huber_scale
        if self.huber_schedule == "exponential":
            return flame.exp(t.float() * (math.log(self.huber_c) / NUM_TRAIN_TIMESTEPS)) * self.huber_scale
        if sigma is None:
            raise ValueError("the snr huber schedule needs the DDPM sigmas (a DDPM objective)")
        s = sigma.float()
        return (1.0 - self.huber_c) / ((1.0 + s) * (1.0 + s)) + self.huber_c

    def __call__(self, d, c=None):
        """The per-element loss of the float32 difference d (B, ...), with the threshold c of `threshold`."""
        if self.loss_type == "l2":
            return d * d
        if self.loss_type == "l1":
            return d.abs()
        if c is None:
            raise ValueError(f"loss type {self.loss_type} needs its threshold: threshold(t)")
        if isinstance(c, flame.Tensor):
            c = c.reshape((d.shape[0],) + (1,) * (d.ndim - 1))
        root = (d * d + c * c).sqrt() - c
        return (2.0 * c) * root if self.loss_type == "huber" else 2.0 * root
