"""The DDPM objective of ε- and v-prediction models (SDXL), as kohya sd-scripts and diffusers train them:

    t   ~ U{min_timestep, ..., max_timestep − 1}       integer timesteps (passed to the model as floats)
    x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε                         (scaled-linear betas 0.00085 → 0.012, 1000 steps)
    target = ε (epsilon)  or  v = √ᾱ_t·ε − √(1 − ᾱ_t)·x0 (v_prediction)
    L   = mean_b(w_b · mean((pred − target)²))         w = 1, or min-SNR-γ (Hang et al. 2023):
          min(SNR_t, γ)/SNR_t for ε, min(SNR_t, γ)/(SNR_t + 1) for v, with SNR_t = ᾱ_t / (1 − ᾱ_t)

zero_terminal_snr rescales the betas so that ᾱ at t = 999 is 0 (Lin et al. 2023; pure noise at the last step,
meant for v-prediction). noise_offset adds offset·N(0, 1) per sample and channel to ε (Objective.sample_noise).
The schedule's tables live on the device: noising, targets and weights gather them by t without leaving it.
"""
import numpy as np

import flame_core as flame
from flame_models.samplers import DDPMSchedule, check_prediction_type

from .objective import Objective, combined_weights, weighted_mse


class DDPM(Objective):
    name = "ddpm"

    def __init__(self, prediction_type="epsilon", *, zero_terminal_snr=False, min_snr_gamma=None, min_timestep=0,
                 max_timestep=1000, noise_offset=0.0, num_train_timesteps=1000, element=None):
        check_prediction_type(prediction_type)
        if not 0 <= min_timestep < max_timestep <= num_train_timesteps:
            raise ValueError(f"timesteps must satisfy 0 <= min_timestep < max_timestep <= {num_train_timesteps}, got "
                             f"[{min_timestep}, {max_timestep})")
        if min_snr_gamma is not None and not min_snr_gamma > 0:
            raise ValueError(f"min_snr_gamma must be > 0 (or None: no weighting), got {min_snr_gamma}")
        if noise_offset < 0:
            raise ValueError(f"noise_offset must be >= 0, got {noise_offset}")
        self.prediction_type = prediction_type
        self.schedule = DDPMSchedule(num_train_timesteps, zero_terminal_snr=zero_terminal_snr)
        self.min_snr_gamma, self.noise_offset = min_snr_gamma, float(noise_offset)
        self.min_timestep, self.max_timestep = int(min_timestep), int(max_timestep)
        self._weight_tables = {}
        self.element = element      # loss_types.ElementLoss (None: the square)

    def sample_timesteps(self, batch_size, *, generator, num_tokens=None, device="cpu"):
        """(B,) integer timesteps in [min_timestep, max_timestep) as float32 on `device`, drawn on the CPU from
        `generator` (one uniform draw per sample: the same sequence on every device)."""
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(f"timestep sampling draws on the CPU; got a generator on {generator.device}")
        u = flame.rand(batch_size, generator=generator, dtype=flame.float64, device="cpu").numpy()
        lo, hi = self.min_timestep, self.max_timestep
        t = np.minimum(np.floor(lo + u * (hi - lo)), hi - 1)
        return flame.tensor(t.astype(np.float32), device=device)

    def noisy(self, x0, noise, t):
        return self.schedule.add_noise(x0, noise, t)

    def target(self, x0, noise, t):
        if self.prediction_type == "epsilon":
            return noise.float()
        return self.schedule.velocity(x0, noise, t)

    def weights(self, t):
        """(B,) min-SNR-γ weights at timesteps t, or None (all 1)."""
        if self.min_snr_gamma is None:
            return None
        key = str(t.device)
        table = self._weight_tables.get(key)
        if table is None:
            w = self.schedule.min_snr_weights(np.arange(self.schedule.num_train_timesteps), self.min_snr_gamma,
                                              self.prediction_type)
            table = self._weight_tables[key] = flame.tensor(w, device=t.device)
        return flame.index_select(table, 0, t.reshape(-1).long())

    def loss(self, pred, target, t=None, *, mask=None, sample_weights=None):
        """The (min-SNR-weighted) MSE; mask and sample_weights as FlowMatching.loss takes them."""
        if t is None and self.min_snr_gamma is not None:
            raise ValueError("min-SNR weighting needs the timesteps: loss(pred, target, t)")
        w = None if t is None else self.weights(t)
        el, c = self.element, None
        if el is not None and el.needs_threshold:
            if t is None and el.huber_schedule != "constant":
                raise ValueError("the loss's threshold needs the timesteps: loss(pred, target, t)")
            c = el.threshold(t, self._sigmas(t) if el.huber_schedule == "snr" else None)
        return weighted_mse(pred, target, combined_weights(w, sample_weights), mask, el, c)

    def _sigmas(self, t):
        """(B,) σ_t = √((1 − ᾱ_t) / ᾱ_t) gathered on t's device (the snr huber schedule)."""
        key = ("sigma", str(t.device))
        table = self._weight_tables.get(key)
        if table is None:
            abar = np.asarray(self.schedule.alphas_cumprod, dtype=np.float64)
            sig = np.sqrt((1.0 - abar) / np.maximum(abar, 1e-30)).astype(np.float32)
            table = self._weight_tables[key] = flame.tensor(sig, device=t.device)
        return flame.index_select(table, 0, t.reshape(-1).long())
