"""k-diffusion-style samplers over a denoiser D(x, σ, t) ≈ x0 and a table of sigmas (high to low).

Every sampler takes the VE latents x = x0 + σ_0·ε at sigmas[0] and returns them at sigmas[-1] (float32); `timesteps`
(one per step, from the same table) are handed to the denoiser, else it looks them up from σ. Noise for the ancestral
steps comes from `noise(i, x)` when given (tests replay a reference's draws), else from `generator`.

    euler            x ← x + (x − D)/σ · (σ' − σ)
    euler_ancestral  σ_up = min(σ', η·√(σ'²(σ² − σ'²)/σ²)), σ_down = √(σ'² − σ_up²):
                     x ← x + (x − D)/σ · (σ_down − σ) + σ_up·z
    dpmpp_2m         DPM-Solver++(2M) in λ = −log σ, first order at the first step and into σ' = 0
    ddim             DDIM with η: euler_ancestral's step on DDIM's table (η = 0: deterministic)
"""
import math

from tqdm.auto import tqdm

import flame_core as flame


def _steps(sigmas, progress, desc):
    return tqdm(range(len(sigmas) - 1), desc=desc, unit="step", disable=not progress, leave=False)


def _t(timesteps, i):
    return None if timesteps is None else float(timesteps[i])


def _noise(noise, generator, i, x):
    if noise is not None:
        return noise(i, x).float()
    return flame.randn(*x.shape, generator=generator, dtype=flame.float32, device=x.device)


def sample_euler(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    x = x.float()
    for i in _steps(sigmas, progress, "euler"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        d = (x - x0) / s
        x = x + d * (s_next - s)
        if callback is not None:
            callback(i, x, x0, s)
    return x


def ancestral_sigmas(sigma, sigma_next, eta=1.0):
    """(σ_down, σ_up) of an ancestral step from σ to σ_next."""
    if sigma_next == 0.0 or eta == 0.0:
        return sigma_next, 0.0
    up = min(sigma_next, eta * math.sqrt(sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2))
    return math.sqrt(sigma_next ** 2 - up ** 2), up


def sample_euler_ancestral(model, x, sigmas, timesteps=None, *, eta=1.0, generator=None, noise=None, callback=None,
                           progress=False):
    x = x.float()
    for i in _steps(sigmas, progress, "euler_ancestral"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        down, up = ancestral_sigmas(s, s_next, eta)
        d = (x - x0) / s
        x = x + d * (down - s)
        if up > 0.0:
            x = x + _noise(noise, generator, i, x) * up
        if callback is not None:
            callback(i, x, x0, s)
    return x


def sample_ddim(model, x, sigmas, timesteps=None, *, eta=0.0, generator=None, noise=None, callback=None,
                progress=False):
    """DDIM (Song et al. 2021) in σ form: x' = D + √(σ'² − σ_up²)·ε̂ + σ_up·z with ε̂ = (x − D)/σ and
    σ_up = η·√(σ'²(σ² − σ'²)/σ²) -- DDIMScheduler's update, divided by √ᾱ'. Use it with schedules.ddim_sigmas."""
    return sample_euler_ancestral(model, x, sigmas, timesteps, eta=eta, generator=generator, noise=noise,
                                  callback=callback, progress=progress)


def sample_dpmpp_2m(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    x = x.float()
    old_x0, h_last = None, None
    for i in _steps(sigmas, progress, "dpmpp_2m"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        if s_next == 0.0:
            x = x0                                           # the first-order step into σ = 0
        else:
            h = math.log(s) - math.log(s_next)               # λ' − λ, λ = −log σ
            if old_x0 is None:
                d = x0
            else:
                r = h_last / h
                d = x0 * (1.0 + 1.0 / (2.0 * r)) - old_x0 * (1.0 / (2.0 * r))
            x = x * (s_next / s) - d * math.expm1(-h)
            h_last = h
        old_x0 = x0
        if callback is not None:
            callback(i, x, x0, s)
    return x


SAMPLERS = {"euler": sample_euler, "euler_ancestral": sample_euler_ancestral, "dpmpp_2m": sample_dpmpp_2m,
            "ddim": sample_ddim}
