"""The discrete DDPM noise schedule of SD-family models and the sigma tables samplers walk.

    β_i = (√β_start + i/(N−1)·(√β_end − √β_start))²   ("scaled_linear", SD / SDXL: 0.00085 → 0.012, N = 1000)
    ᾱ_i = Π_{j≤i} (1 − β_j)        σ_i = √((1 − ᾱ_i) / ᾱ_i)
    x_t = √ᾱ_t · x0 + √(1 − ᾱ_t) · ε  (VP, training)  ⇔  x_t / √ᾱ_t = x0 + σ_t · ε  (VE, the samplers' x)

Host-side NumPy float64 throughout (a few thousand numbers, no device work). The inference tables follow diffusers'
EulerDiscreteScheduler (timestep_spacing, steps_offset, Karras endpoints taken from the spaced table, fractional
timesteps from log-σ interpolation; HeunDiscreteScheduler's is the same, the KDPM2 schedulers' rounds the Karras
timesteps); DDIM's follows DDIMScheduler (its last σ is that of ᾱ_0, or 0 with set_alpha_to_one); DPM-Solver's
follows DPMSolverMultistepScheduler.
"""
import math

import numpy as np

import flame_core as flame

SPACINGS = ("leading", "trailing", "linspace")
ZERO_SNR_ALPHA_CUMPROD = 2.0 ** -24   # diffusers' stand-in for ᾱ_T = 0, so that σ_T stays finite (4096)


def scaled_linear_betas(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
    return np.linspace(math.sqrt(beta_start), math.sqrt(beta_end), num_train_timesteps, dtype=np.float64) ** 2


def linear_betas(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02):
    return np.linspace(beta_start, beta_end, num_train_timesteps, dtype=np.float64)


def rescale_zero_terminal_snr(betas):
    """Betas whose last ᾱ is exactly 0 (Lin et al. 2023, Algorithm 1): √ᾱ shifted so its last value is 0 and scaled
    so its first is unchanged."""
    abar_sqrt = np.sqrt(np.cumprod(1.0 - np.asarray(betas, dtype=np.float64)))
    first, last = abar_sqrt[0], abar_sqrt[-1]
    abar_sqrt = (abar_sqrt - last) * (first / (first - last))
    abar = abar_sqrt ** 2
    alphas = np.concatenate([abar[:1], abar[1:] / abar[:-1]])
    return 1.0 - alphas


class DDPMSchedule:
    """The training schedule (betas, alphas_cumprod) and its sigmas. zero_terminal_snr: ᾱ_T = 0 for training (pure
    noise at t = T, use with v-prediction); the sigmas use 2^-24 for it, as diffusers' Euler schedulers do."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 zero_terminal_snr=False):
        if beta_schedule == "scaled_linear":
            betas = scaled_linear_betas(num_train_timesteps, beta_start, beta_end)
        elif beta_schedule == "linear":
            betas = linear_betas(num_train_timesteps, beta_start, beta_end)
        else:
            raise ValueError(f"beta_schedule must be 'scaled_linear' or 'linear', got {beta_schedule!r}")
        if zero_terminal_snr:
            betas = rescale_zero_terminal_snr(betas)
        self.num_train_timesteps = int(num_train_timesteps)
        self.zero_terminal_snr = bool(zero_terminal_snr)
        self.betas = betas
        self.alphas_cumprod = np.cumprod(1.0 - betas)
        abar = self.alphas_cumprod.copy()
        if zero_terminal_snr:
            abar[-1] = ZERO_SNR_ALPHA_CUMPROD
        self.sigmas = np.sqrt((1.0 - abar) / abar)          # (N,), increasing with t
        self.log_sigmas = np.log(self.sigmas)
        self._device_tables = {}

    @property
    def sigma_min(self):
        return float(self.sigmas[0])

    @property
    def sigma_max(self):
        return float(self.sigmas[-1])

    # ------------------------------------------------------------------ σ <-> t
    def t_to_sigma(self, t):
        """σ at (fractional) timesteps t, linear in σ between the integer steps (diffusers' interpolation)."""
        return np.interp(np.asarray(t, dtype=np.float64), np.arange(self.num_train_timesteps), self.sigmas)

    def sigma_to_t(self, sigma):
        """The fractional timestep of σ: linear in log σ between neighbouring steps, clipped to [0, N−1]
        (diffusers' `_sigma_to_t`, k-diffusion's `sigma_to_t`)."""
        sigma = np.asarray(sigma, dtype=np.float64)
        log_sigma = np.log(np.maximum(sigma, 1e-10)).reshape(-1)
        ls = self.log_sigmas
        low = np.clip(np.searchsorted(ls, log_sigma, side="right") - 1, 0, len(ls) - 2)
        w = np.clip((ls[low] - log_sigma) / (ls[low] - ls[low + 1]), 0.0, 1.0)
        t = (1.0 - w) * low + w * (low + 1)
        return t.reshape(sigma.shape) if sigma.ndim else float(t[0])

    # ------------------------------------------------------------------ training
    def _abar(self, timesteps, device):
        """√ᾱ_t and √(1−ᾱ_t) as float32 tensors (B, 1, 1, 1) on `device`. Host timesteps are range-checked; an
        integer tensor is gathered on its own device (no host round trip, so no check)."""
        shape = (-1, 1, 1, 1)
        if isinstance(timesteps, flame.Tensor):
            tables = self._device_tables.get(str(timesteps.device))
            if tables is None:
                tables = tuple(flame.tensor(v.astype(np.float32), device=timesteps.device)
                               for v in (np.sqrt(self.alphas_cumprod), np.sqrt(1.0 - self.alphas_cumprod)))
                self._device_tables[str(timesteps.device)] = tables
            idx = timesteps.reshape(-1).long()
            return tuple(flame.index_select(v, 0, idx).reshape(shape).to(device=device) for v in tables)
        t = np.asarray(timesteps).reshape(-1)
        if t.dtype.kind not in "iu" or np.any(t < 0) or np.any(t >= self.num_train_timesteps):
            raise ValueError(f"timesteps must be integers in [0, {self.num_train_timesteps}), got {t.tolist()[:8]}")
        abar = self.alphas_cumprod[t]
        return (flame.tensor(np.sqrt(abar).astype(np.float32), device=device).reshape(shape),
                flame.tensor(np.sqrt(1.0 - abar).astype(np.float32), device=device).reshape(shape))

    def add_noise(self, x0, noise, timesteps):
        """x_t = √ᾱ_t·x0 + √(1−ᾱ_t)·ε for integer timesteps (B,): host ints, or an int tensor; float32 result on
        x0's device."""
        a, s = self._abar(timesteps, x0.device)
        return a * x0.float() + s * noise.float()

    def velocity(self, x0, noise, timesteps):
        """The v-prediction target v = √ᾱ_t·ε − √(1−ᾱ_t)·x0 (float32)."""
        a, s = self._abar(timesteps, x0.device)
        return a * noise.float() - s * x0.float()

    def snr(self, timesteps):
        """ᾱ_t / (1 − ᾱ_t) for host integer timesteps, as a float64 NumPy array (0 at a zero-terminal-SNR t = T)."""
        abar = self.alphas_cumprod[np.asarray(timesteps, dtype=np.int64)]
        return abar / (1.0 - abar)

    def min_snr_weights(self, timesteps, gamma=5.0, prediction_type="epsilon"):
        """Min-SNR-γ loss weights (Hang et al. 2023) per sample: min(SNR, γ)/SNR for ε-prediction, min(SNR, γ)/(SNR+1)
        for v-prediction (diffusers' training scripts). float32 (B,) NumPy; a zero SNR gets weight 0 for ε, and
        γ·0/(0+1) = 0 for v."""
        snr = self.snr(timesteps)
        clipped = np.minimum(snr, gamma)
        if prediction_type == "epsilon":
            w = np.divide(clipped, snr, out=np.zeros_like(snr), where=snr > 0)
        elif prediction_type == "v_prediction":
            w = clipped / (snr + 1.0)
        else:
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
        return w.astype(np.float32)


# ----------------------------------------------------------------------------- inference tables
def spaced_timesteps(num_train_timesteps, steps, spacing="leading", steps_offset=0):
    """`steps` timesteps from high to low (float64), as diffusers' EulerDiscreteScheduler spaces them: 'linspace'
    (fractional: linspace(0, N−1, steps)), 'leading' (k·(N // steps) + steps_offset) or 'trailing'
    (round(N − k·N/steps) − 1)."""
    if int(steps) < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    N, n = int(num_train_timesteps), int(steps)
    if spacing == "linspace":
        return np.linspace(0, N - 1, n, dtype=np.float64)[::-1].copy()
    if spacing == "leading":
        return (np.arange(0, n) * (N // n)).round()[::-1].astype(np.float64) + steps_offset
    if spacing == "trailing":
        return np.round(np.arange(N, 0, -N / n)).astype(np.float64) - 1
    raise ValueError(f"timestep_spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")


def karras_sigmas(n, sigma_min, sigma_max, rho=7.0):
    """Karras et al. (2022): n sigmas from sigma_max down to sigma_min, evenly spaced in σ^(1/ρ)."""
    ramp = np.linspace(0, 1, int(n))
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def get_sigmas(schedule, steps, scheduler="normal", timestep_spacing="leading", steps_offset=1):
    """(sigmas (steps + 1,), timesteps (steps,)) float64, high to low, the last sigma 0: 'normal' = σ at the spaced
    timesteps; 'karras' = Karras sigmas between the spaced table's ends, at their fractional timesteps. The defaults
    are SDXL's scheduler config (leading spacing, offset 1)."""
    t = spaced_timesteps(schedule.num_train_timesteps, steps, timestep_spacing, steps_offset)
    if np.any(t > schedule.num_train_timesteps - 1) or np.any(t < 0):
        raise ValueError(f"{timestep_spacing} spacing with steps_offset={steps_offset} gives timesteps outside "
                         f"[0, {schedule.num_train_timesteps - 1}]: {t[0]}..{t[-1]}")
    sigmas = schedule.t_to_sigma(t)
    if scheduler == "karras":
        sigmas = karras_sigmas(steps, float(sigmas[-1]), float(sigmas[0]))
        t = schedule.sigma_to_t(sigmas)
    elif scheduler != "normal":
        raise ValueError(f"scheduler must be 'normal' or 'karras', got {scheduler!r}")
    return np.concatenate([sigmas, [0.0]]), np.asarray(t, dtype=np.float64)


def kdpm2_sigmas(schedule, steps, scheduler="normal", timestep_spacing="leading", steps_offset=1):
    """get_sigmas' table as diffusers' KDPM2DiscreteScheduler and KDPM2AncestralDiscreteScheduler build it: the same
    sigmas, the Karras sigmas' timesteps rounded to integers."""
    sigmas, t = get_sigmas(schedule, steps, scheduler, timestep_spacing, steps_offset)
    return sigmas, (np.round(t) if scheduler == "karras" else t)


def dpm_sigmas(schedule, steps, scheduler="normal", timestep_spacing="leading", steps_offset=1):
    """(sigmas (steps + 1,), timesteps (steps,)) float64, high to low, the last sigma 0, as diffusers'
    DPMSolverMultistepScheduler builds them (its default final_sigmas_type 'zero'): integer timesteps spaced over
    steps + 1 points with the last dropped ('linspace', 'leading' with N // (steps + 1), offset added) or 'trailing',
    σ interpolated at them; 'karras': Karras sigmas over the whole training range (σ at t = N−1 down to σ at t = 0,
    whatever the spacing) at their rounded timesteps."""
    N, n = schedule.num_train_timesteps, int(steps)
    if n < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if timestep_spacing == "linspace":
        t = np.linspace(0, N - 1, n + 1).round()[::-1][:-1].copy()
    elif timestep_spacing == "leading":
        t = (np.arange(0, n + 1) * (N // (n + 1))).round()[::-1][:-1].copy() + steps_offset
    elif timestep_spacing == "trailing":
        t = np.arange(N, 0, -N / n).round() - 1
    else:
        raise ValueError(f"timestep_spacing must be one of {', '.join(SPACINGS)}, got {timestep_spacing!r}")
    if scheduler == "karras":
        sigmas = karras_sigmas(n, schedule.sigma_min, schedule.sigma_max)
        t = np.round(schedule.sigma_to_t(sigmas))
    elif scheduler == "normal":
        if np.any(t > N - 1) or np.any(t < 0):
            raise ValueError(f"{timestep_spacing} spacing with steps_offset={steps_offset} gives timesteps outside "
                             f"[0, {N - 1}]: {t[0]}..{t[-1]}")
        sigmas = schedule.t_to_sigma(t)
    else:
        raise ValueError(f"scheduler must be 'normal' or 'karras', got {scheduler!r}")
    return np.concatenate([sigmas, [0.0]]), np.asarray(t, dtype=np.float64)


def ddim_sigmas(schedule, steps, timestep_spacing="leading", steps_offset=1, set_alpha_to_one=False):
    """(sigmas (steps + 1,), timesteps (steps,)) of DDIMScheduler: integer timesteps ('linspace' rounded), each step
    going to t − N // steps, the last one to ᾱ = 1 (σ 0) with set_alpha_to_one, else to ᾱ_0 (SD / SDXL's config).
    Spacings whose step targets are not the next timesteps (diffusers then relabels the sample between steps) are
    refused: 'leading', or 'trailing' with a step count that divides N."""
    N, n = schedule.num_train_timesteps, int(steps)
    if timestep_spacing == "linspace":
        t = np.linspace(0, N - 1, n).round()[::-1].copy()
    else:
        t = spaced_timesteps(N, n, timestep_spacing, steps_offset if timestep_spacing == "leading" else 0)
    t = t.astype(np.int64)
    if np.any(t > N - 1) or np.any(t < 0):
        raise ValueError(f"DDIM with {timestep_spacing} spacing and steps_offset={steps_offset} gives timesteps "
                         f"outside [0, {N - 1}]: {t[0]}..{t[-1]}")
    prev = t - N // n
    if np.any(prev[:-1] != t[1:]) or prev[-1] >= 0:
        raise ValueError(f"DDIM with {timestep_spacing} spacing over {n} steps goes from t to t - {N // n}, which "
                         f"is not the next timestep; use timestep_spacing='leading' (or 'trailing' with a step count "
                         f"that divides {N})")
    final = 0.0 if set_alpha_to_one else float(schedule.sigmas[0])
    return np.concatenate([schedule.sigmas[t], [final]]), t.astype(np.float64)


LCM_ORIGINAL_STEPS = 50   # LCMScheduler's original_inference_steps: the distillation schedule's length


def lcm_sigmas(schedule, steps, original_steps=LCM_ORIGINAL_STEPS):
    """(sigmas (steps + 1,), timesteps (steps,)) of LCMScheduler's standard table: the distillation schedule
    k·[1 .. original_steps] − 1 (k = N // original_steps, high to low), `steps` of them at evenly spaced indices
    (floor of linspace(0, original_steps, steps, endpoint=False)), then σ 0 (the last step returns the
    consistency output)."""
    N, n, orig = schedule.num_train_timesteps, int(steps), int(original_steps)
    if not 1 <= orig <= N:
        raise ValueError(f"lcm: original_steps must be in [1, {N}], got {original_steps}")
    if not 1 <= n <= orig:
        raise ValueError(f"lcm: steps must be in [1, original_steps = {orig}] (the table is a subset of the "
                         f"distillation schedule), got {steps}")
    origin = (np.arange(1, orig + 1) * (N // orig) - 1)[::-1]
    t = origin[np.floor(np.linspace(0, orig, num=n, endpoint=False)).astype(np.int64)]
    return np.concatenate([schedule.sigmas[t], [0.0]]), t.astype(np.float64)
