"""k-diffusion-style samplers over a denoiser D(x, σ, t) ≈ x0 and a table of sigmas (high to low).

Every sampler takes the VE latents x = x0 + σ_0·ε at sigmas[0] and returns them at sigmas[-1] (float32); `timesteps`
(one per step, from the same table) are handed to the denoiser, else it looks them up from σ. Noise for the stochastic
samplers (STOCHASTIC) comes from `noise(i, x)` when given (tests replay a reference's draws), else from `generator`.
With d = (x − D)/σ, σ → σ' a step:

    euler            x ← x + d·(σ' − σ)
    euler_ancestral  σ_up = min(σ', η·√(σ'²(σ² − σ'²)/σ²)), σ_down = √(σ'² − σ_up²):
                     x ← x + d·(σ_down − σ) + σ_up·z
    heun             x̃ = x + d·(σ' − σ), d̃ = (x̃ − D(x̃, σ', t'))/σ' with t' the next step's timestep:
                     x ← x + ½(d + d̃)·(σ' − σ); Euler into σ' = 0 (2 model calls a step, 1 for the last)
    dpm_2            σ_m = exp(½(log σ + log σ')), x_m = x + d·(σ_m − σ), d_m = (x_m − D(x_m, σ_m))/σ_m at σ_m's
                     fractional timestep: x ← x + d_m·(σ' − σ); Euler into σ' = 0
    dpm_2_ancestral  dpm_2's step to σ_down (σ_m between σ and σ_down), then + σ_up·z (η = 0: dpm_2)
    dpmpp_2m         DPM-Solver++(2M) in λ = −log σ, first order at the first step and into σ' = 0:
                     x ← (σ'/σ)·x − expm1(−h)·D̂, h = λ' − λ, D̂ = D + (D − D_prev)·h/(2h_prev) (D̂ = D first)
    dpmpp_2m_sde     x ← (σ'/σ)·e^(−ηh)·x − expm1(−h − ηh)·D̂ + σ'·√(−expm1(−2ηh))·z (η = 1: DPM-Solver++(2M)
                     SDE, diffusers' sde-dpmsolver++ with the midpoint solver; η = 0: dpmpp_2m)
    ddim             DDIM with η: euler_ancestral's step on DDIM's table (η = 0: deterministic)
    unipc            UniPC (bh2, order 2: predictor, then the UniC corrector with the next step's model output; see
                     sample_unipc), diffusers' UniPCMultistepScheduler's defaults
    lcm              Latent Consistency Models' multistep sampling (Luo et al. 2023, diffusers' LCMScheduler) on
                     schedules.lcm_sigmas' table: the boundary-condition output at the integer timestep t,
                     D̃ = c_out(t)·D + c_skip(t)·x/√(σ² + 1) with c_skip = σ_d²/((st)² + σ_d²),
                     c_out = st/√((st)² + σ_d²) (s = 10, σ_d = 0.5), then x ← D̃ + σ'·z; the last step returns D̃
"""
import math

from tqdm.auto import tqdm

import flame_core as flame


def _steps(sigmas, progress, desc):
    return tqdm(range(len(sigmas) - 1), desc=desc, unit="step", disable=not progress, leave=False)


def _t(timesteps, i):
    """The table's timestep of step i; None (the denoiser looks it up) without a table or past its end."""
    return None if timesteps is None or i >= len(timesteps) else float(timesteps[i])


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


def sample_ddpm(model, x, sigmas, timesteps=None, *, generator=None, noise=None, callback=None, progress=False):
    """DDPM's ancestral sampling (DDPMScheduler, variance_type fixed_small): each step draws x_{t'} from the
    posterior q(x_{t'} | x_t, x0 = D), which is DDIM's update with η = 1 (Song et al. 2021, §4.1) -- here in σ
    form. Use it with schedules.ddim_sigmas(..., set_alpha_to_one=True): DDPMScheduler's last step goes to ᾱ = 1
    (σ 0: the sample is D), without noise."""
    return sample_euler_ancestral(model, x, sigmas, timesteps, eta=1.0, generator=generator, noise=noise,
                                  callback=callback, progress=progress)


def sample_heun(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    x = x.float()
    for i in _steps(sigmas, progress, "heun"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        d = (x - x0) / s
        x_euler = x + d * (s_next - s)
        if s_next == 0.0:
            x = x_euler
        else:
            d_next = (x_euler - model(x_euler, s_next, _t(timesteps, i + 1))) / s_next
            x = x + (d + d_next) * (0.5 * (s_next - s))
        if callback is not None:
            callback(i, x, x0, s)
    return x


def sample_dpm_2_ancestral(model, x, sigmas, timesteps=None, *, eta=1.0, generator=None, noise=None, callback=None,
                           progress=False):
    """DPM-Solver-2 (Karras et al. 2022, Algorithm 2's midpoint) with ancestral noise; the midpoint's timestep is the
    denoiser's lookup of σ_m, as diffusers' KDPM2 schedulers interpolate it."""
    x = x.float()
    for i in _steps(sigmas, progress, "dpm_2_ancestral" if eta else "dpm_2"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        down, up = ancestral_sigmas(s, s_next, eta)
        d = (x - x0) / s
        if down == 0.0:
            x = x + d * (down - s)
        else:
            s_mid = math.exp(0.5 * (math.log(s) + math.log(down)))
            x_mid = x + d * (s_mid - s)
            d_mid = (x_mid - model(x_mid, s_mid)) / s_mid
            x = x + d_mid * (down - s)
        if up > 0.0:
            x = x + _noise(noise, generator, i, x) * up
        if callback is not None:
            callback(i, x, x0, s)
    return x


def sample_dpm_2(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    """DPM-Solver-2: dpm_2_ancestral without noise (η = 0)."""
    return sample_dpm_2_ancestral(model, x, sigmas, timesteps, eta=0.0, callback=callback, progress=progress)


def sample_dpmpp_2m_sde(model, x, sigmas, timesteps=None, *, eta=1.0, generator=None, noise=None, callback=None,
                        progress=False):
    x = x.float()
    old_x0, h_last = None, None
    for i in _steps(sigmas, progress, "dpmpp_2m_sde" if eta else "dpmpp_2m"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        if s_next == 0.0:
            x = x0                                           # the first-order step into σ = 0
        else:
            h = math.log(s) - math.log(s_next)               # λ' − λ, λ = −log σ
            eta_h = eta * h
            if old_x0 is None:
                d = x0
            else:
                r = h_last / h
                d = x0 * (1.0 + 1.0 / (2.0 * r)) - old_x0 * (1.0 / (2.0 * r))
            x = x * (s_next / s * math.exp(-eta_h)) - d * math.expm1(-h - eta_h)
            if eta_h > 0.0:
                x = x + _noise(noise, generator, i, x) * (s_next * math.sqrt(-math.expm1(-2.0 * eta_h)))
            h_last = h
        old_x0 = x0
        if callback is not None:
            callback(i, x, x0, s)
    return x


def sample_dpmpp_2m(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    """DPM-Solver++(2M): dpmpp_2m_sde without noise (η = 0)."""
    return sample_dpmpp_2m_sde(model, x, sigmas, timesteps, eta=0.0, callback=callback, progress=progress)


def _unipc_b(h):
    """(φ, B) of a UniPC step of λ-length h with data prediction: φ = expm1(−h) (the first-order term's factor) and
    B(h), which bh2 takes as the same expm1(−h)."""
    phi = math.expm1(-h)
    return phi, phi


def unipc_rhos_c2(h, r1):
    """The order-2 corrector's (ρ_1, ρ_t): the solution of [[1, 1], [r1, 1]] ρ = b with b_k = k!·φ_k(hh)/B(h),
    φ_1 = expm1(hh)/hh − 1, φ_2 = φ_1/hh − 1/2 (hh = −h; UniC's linear system for bh2). In λ of any schedule (the
    flow samplers' too); r1 = ±inf (the previous λ infinite: a table from σ_max or s = 1) gives its limit ρ_1 = 0."""
    hh = -h
    phi, B = _unipc_b(h)
    p1 = phi / hh - 1.0
    b1 = p1 / B
    b2 = (p1 / hh - 0.5) * 2.0 / B
    # [[1, 1], [r1, 1]] (ρ1, ρt) = (b1, b2)
    rho1 = (b1 - b2) / (1.0 - r1)
    return rho1, b1 - rho1


def sample_unipc(model, x, sigmas, timesteps=None, *, callback=None, progress=False):
    """UniPC (Zhao et al. 2023) as diffusers' UniPCMultistepScheduler runs it by default: data prediction, B(h) of
    bh2, order 2 with the first step and the last at order 1, the corrector UniC after every step but the last (its
    model output is the next step's own: no extra call). In λ = −log σ, with D the denoiser's x0 at σ_i:
    predictor  x' = (σ'/σ)·x − φ·D − B·½·(D_prev − D)/r,  φ = B = expm1(−h), h = λ' − λ, r = (λ_prev − λ)/h
    corrector  x ← (σ/σ_prev)·x_prev − φ·D_prev − B·(ρ_1·(D_prev2 − D_prev)/r + ρ_t·(D − D_prev))  (order 1: ρ_t = ½)
    (the corrector's h, r at the previous step's sigmas; order 2's ρ from UniC's 2 × 2 system). Into σ' = 0: x' = D."""
    x = x.float()
    lam = [math.inf if float(v) == 0.0 else -math.log(float(v)) for v in sigmas]
    n = len(sigmas) - 1
    outs = []                  # the model outputs (x0) so far
    last = None                # the sample the previous predictor started from
    prev_order = 0
    for i in _steps(sigmas, progress, "unipc"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = model(x, s, _t(timesteps, i))
        if last is not None:   # UniC: correct the previous step's result with this model output
            sp = float(sigmas[i - 1])
            h = lam[i] - lam[i - 1]
            phi, B = _unipc_b(h)
            m0 = outs[-1]
            base = last * (s / sp) - m0 * phi
            if prev_order == 1:
                x = base - (x0 - m0) * (B * 0.5)
            else:
                r1 = (lam[i - 2] - lam[i - 1]) / h
                rho1, rho_t = unipc_rhos_c2(h, r1)
                x = base - ((outs[-2] - m0) * (rho1 / r1) + (x0 - m0) * rho_t) * B
        outs = (outs + [x0])[-2:]
        order = min(2, n - i, i + 1)
        last = x
        if s_next == 0.0:
            x = x0
        else:
            h = lam[i + 1] - lam[i]
            phi, B = _unipc_b(h)
            x = x * (s_next / s) - x0 * phi
            if order == 2:
                r1 = (lam[i - 1] - lam[i]) / h
                x = x - (outs[0] - x0) * (B * 0.5 / r1)
        prev_order = order
        if callback is not None:
            callback(i, x, x0, s)
    return x


LCM_TIMESTEP_SCALING, LCM_SIGMA_DATA = 10.0, 0.5


def lcm_scalings(timestep):
    """(c_skip, c_out) of LCM's boundary condition at an integer timestep."""
    st = LCM_TIMESTEP_SCALING * float(timestep)
    d2 = LCM_SIGMA_DATA * LCM_SIGMA_DATA
    return d2 / (st * st + d2), st / math.sqrt(st * st + d2)


def sample_lcm(model, x, sigmas, timesteps, *, generator=None, noise=None, callback=None, progress=False):
    """LCM's multistep sampler (see the module docstring); `timesteps`: schedules.lcm_sigmas' (c_skip and c_out read
    the integer timestep)."""
    if timesteps is None or len(timesteps) != len(sigmas) - 1:
        raise ValueError("sample_lcm: needs the table's timesteps, one per step (schedules.lcm_sigmas)")
    x = x.float()
    for i in _steps(sigmas, progress, "lcm"):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        t = float(timesteps[i])
        x0 = model(x, s, t)
        c_skip, c_out = lcm_scalings(t)
        x = x0 * c_out + x * (c_skip / math.sqrt(s * s + 1.0))     # D̃: the boundary condition on the VP sample
        if i < len(sigmas) - 2:
            x = x + _noise(noise, generator, i, x) * s_next
        if callback is not None:
            callback(i, x, x0, s)
    return x


SAMPLERS = {"euler": sample_euler, "euler_ancestral": sample_euler_ancestral, "heun": sample_heun,
            "dpm_2": sample_dpm_2, "dpm_2_ancestral": sample_dpm_2_ancestral, "dpmpp_2m": sample_dpmpp_2m,
            "dpmpp_2m_sde": sample_dpmpp_2m_sde, "ddim": sample_ddim, "lcm": sample_lcm, "unipc": sample_unipc,
            "ddpm": sample_ddpm}
STOCHASTIC = ("euler_ancestral", "dpm_2_ancestral", "dpmpp_2m_sde", "ddim")   # they take eta, generator and noise
DRAWS_NOISE = STOCHASTIC + ("lcm", "ddpm")   # they take generator and noise (lcm, ddpm: no eta, the method's noise)
