"""The steps of flow-matching samplers (SD3, Flux, Chroma, Kontext, Qwen-Image) over a velocity field v(x, t) on a
table of sigmas (high to 0):

    euler     x <- x + (s' - s) v(x, s)
    heun      x_e = x + (s' - s) v(x, s);  x <- x + (s' - s) (v(x, s) + v(x_e, s')) / 2;  Euler into s' = 0
              (diffusers' FlowMatchHeunDiscreteScheduler: 2 model calls a step, 1 for the last)
    dpmpp_2m  DPM-Solver++(2M), midpoint, on the data prediction m = x - s v with alpha = 1 - s, sigma = s
              (diffusers' DPMSolverMultistepScheduler with use_flow_sigmas and prediction_type "flow_prediction", its
              defaults: solver_order 2, lower_order_final, final_sigmas_type "zero"), along the family's own sigmas:
              lambda = log(alpha / sigma), h = lambda' - lambda;
              x <- (s' / s) x + alpha' (1 - e^-h) (m + (m - m_prev) h / (2 h_prev));
              the first step and the last (into s' = 0: x <- m) are first order. 1 model call a step.
              With alpha = 1 - s a first-order step is exactly Euler's step, and after s = 1 (h_prev infinite) the
              second-order term is 0: on a table from 1, DPM++ 2M departs from Euler from its third step on (so at
              most 3 steps from 1 are Euler's), as diffusers'.
    dpmpp_2m_sde  DPM-Solver++(2M) SDE, midpoint (diffusers' DPMSolverMultistepScheduler with algorithm_type
              "sde-dpmsolver++", otherwise as dpmpp_2m): x <- (s' / s) e^-h x + alpha' (1 - e^-2h) (m + (m - m_prev)
              h / (2 h_prev)) + s' sqrt(1 - e^-2h) z, z fresh unit noise each step (`step_noise`: image j's from
              seed j + 1); first order at the first and the last step (into 0: x <- m, no noise).
    unipc     UniPC, bh2, order 2, on the same data prediction m and lambda (diffusers' UniPCMultistepScheduler with
              use_flow_sigmas and prediction_type "flow_prediction", its defaults: predict_x0, solver_order 2,
              lower_order_final, final_sigmas_type "zero"): at each step the UniC corrector first corrects the
              sample with this step's m (the sample the previous predictor started from, m_prev and m_prev2), then
              the UniP predictor steps on from it; phi = B = expm1(-h) with
              predictor  x' = (s' / s) x_c - alpha' phi m - alpha' B (m_prev - m) / (2 r),  r = (lambda_prev -
                         lambda) / h (order 1 at the first and the last step: without the last term; into 0: x' = m)
              corrector  x_c = (s / s_prev) last - alpha phi_c m_prev - alpha B_c (rho_1 (m_prev2 - m_prev) / r_c +
                         rho_t (m - m_prev))  (at the previous predictor's order; order 1: rho_1 = 0, rho_t = 1/2).
              1 model call a step; a lambda of -inf (s = 1) gives the terms' limits (its differences weigh 0).

A multistep sampler carries its history from step to step. Its step function takes it and returns it
(`flow_step`'s dpmpp_2m: (x, t, t_next, dt, m_prev, c) -> (x', m); unipc: (x, t, t_next, dt, last, m_prev, m_prev2,
c) -> (x', x_c, m, m_prev)) so that a CUDA graph of the step holds no state of its own: the per-step coefficients `c`
come in as a tensor (`step_coefficients`), the history as more inputs (`multistep_state`: the first step's), and a
stochastic sampler's noise as one more (dpmpp_2m_sde: (x, t, t_next, dt, m_prev, z, c) -> (x', m)), drawn outside
the graph.
"""
import math

import flame_core as flame

from .k_samplers import unipc_rhos_c2

FLOW_SAMPLERS = ("euler", "heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc")
MULTISTEP = frozenset(("dpmpp_2m", "dpmpp_2m_sde", "unipc"))
STOCHASTIC = frozenset(("dpmpp_2m_sde",))   # a fresh noise tensor each step (step_noise)
# the names A1111 / Forge write in an image's "parameters" text (generate's PNG metadata)
DISPLAY_NAMES = {"euler": "Euler", "heun": "Heun", "dpmpp_2m": "DPM++ 2M", "dpmpp_2m_sde": "DPM++ 2M SDE",
                 "unipc": "UniPC"}
_HISTORY = {"dpmpp_2m": 1, "dpmpp_2m_sde": 1, "unipc": 3}   # the history tensors a multistep step takes and returns


def check_flow_sampler(sampler):
    """`sampler` if it is one of FLOW_SAMPLERS, else a ValueError naming them."""
    if sampler not in FLOW_SAMPLERS:
        raise ValueError(f"unknown flow-matching sampler {sampler!r}: choose one of {', '.join(FLOW_SAMPLERS)}")
    return sampler


def flow_step(velocity, sampler):
    """step(x, t, t_next, dt) -> x at the next sigma, by `sampler` over velocity(x, t) (t, t_next: the model's
    timestep tensors at s and s'; dt = s' - s). Euler does not read t_next.
    dpmpp_2m: step(x, t, t_next, dt, m_prev, c) -> (x', m): m_prev the previous step's data prediction (any tensor of
    x's shape on the first step, which does not read it), c the step's coefficients (dpmpp_2m_coefficients) as a
    float32 tensor of 4 on x's device; reads neither t_next nor dt.
    unipc: step(x, t, t_next, dt, last, m_prev, m_prev2, c) -> (x', x_c, m, m_prev): x the predictor's last result,
    last the sample it started from, m_prev / m_prev2 the data predictions of the two steps before, c the step's
    coefficients (unipc_coefficients, 9 float32); x_c is x corrected (the next step's `last`). The returned m_prev is
    a copy (a graph's output is then none of its inputs).
    dpmpp_2m_sde: step(x, t, t_next, dt, m_prev, z, c) -> (x', m): z the step's unit noise (x's shape, float32), c
    dpmpp_2m_sde_coefficients' 5."""
    kind = check_flow_sampler(sampler)
    if kind == "euler":
        return lambda x, t, t_next, dt: x + dt * velocity(x, t)
    if kind == "dpmpp_2m":
        def dpmpp_2m(x, t, t_next, dt, m_prev, c):
            m = x - c[0] * velocity(x, t)
            return c[1] * x + c[2] * m + c[3] * (m - m_prev), m
        return dpmpp_2m
    if kind == "dpmpp_2m_sde":
        def dpmpp_2m_sde(x, t, t_next, dt, m_prev, z, c):
            m = x - c[0] * velocity(x, t)
            return c[1] * x + c[2] * m + c[3] * (m - m_prev) + c[4] * z, m
        return dpmpp_2m_sde
    if kind == "unipc":
        def unipc(x, t, t_next, dt, last, m_prev, m_prev2, c):
            m = x - c[0] * velocity(x, t)
            xc = c[1] * x + c[2] * last + c[3] * m_prev + c[4] * m_prev2 + c[5] * m
            return c[6] * xc + c[7] * m + c[8] * m_prev, xc, m, m_prev.clone()
        return unipc

    def heun(x, t, t_next, dt):
        v = velocity(x, t)
        return x + dt * (0.5 * (v + velocity(x + dt * v, t_next)))
    return heun


def step_kind(sampler, i, steps):
    """The sampler of step i of `steps`: Heun's last step (into sigma 0) is Euler's, as diffusers'. (dpmpp_2m's first
    and last steps are first order through their coefficients, not another kind.)"""
    return "euler" if i == steps - 1 and sampler == "heun" else check_flow_sampler(sampler)


def _lam(s):
    """lambda = log(alpha / sigma) of the flow schedule (alpha = 1 - s): -inf at s = 1, +inf at s = 0."""
    if s >= 1.0:
        return -math.inf
    if s <= 0.0:
        return math.inf
    return math.log1p(-s) - math.log(s)


def dpmpp_2m_coefficients(sigmas, i):
    """(s, c_x, c_m, c_d) of DPM-Solver++(2M)'s step i along `sigmas` (decreasing to 0): x' = c_x x + c_m m +
    c_d (m - m_prev) with m = x - s v. The first step and the step into 0 are first order (c_d = 0), as diffusers'
    solver_order 2 with final_sigmas_type "zero"; so is a step whose previous interval is infinite in lambda (after
    s = 1: its weight 1 / r0 is 0 there too)."""
    n = len(sigmas) - 1
    if not 0 <= i < n:
        raise IndexError(f"step {i} of a table of {n} steps")
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    if not s > s_next >= 0.0:
        raise ValueError(f"dpmpp_2m needs sigmas decreasing to 0; step {i} goes from {s} to {s_next}")
    if s_next == 0.0:  # the last step: x' = m
        return s, 0.0, 1.0, 0.0
    lam_s, lam_t = _lam(s), _lam(s_next)
    h = lam_t - lam_s
    e = math.exp(-h)
    c_x, c_m = s_next / s, (1.0 - s_next) * (1.0 - e)
    c_d = 0.0
    if i > 0:
        h_prev = lam_s - _lam(float(sigmas[i - 1]))
        if math.isfinite(h_prev) and h_prev > 0:
            c_d = 0.5 * c_m * h / h_prev
    return s, c_x, c_m, c_d


def unipc_coefficients(sigmas, i):
    """(s, k0, k1, k2, k3, k4, p0, p1, p2) of UniPC's step i along `sigmas` (decreasing to 0): with m = x - s v,
    x_c = k0 x + k1 last + k2 m_prev + k3 m_prev2 + k4 m (the corrector; step 0: x_c = x) and
    x' = p0 x_c + p1 m + p2 m_prev (the predictor; into 0: x' = m). Orders as diffusers' UniPCMultistepScheduler
    with solver_order 2 and lower_order_final: the predictor's min(2, steps - i, i + 1), the corrector's the previous
    predictor's. Computed in float64 from lambda = log((1 - s) / s)."""
    n = len(sigmas) - 1
    if not 0 <= i < n:
        raise IndexError(f"step {i} of a table of {n} steps")
    sig = [float(v) for v in sigmas[:i + 2]]
    for j in range(i + 1):
        if not sig[j] > sig[j + 1] >= 0.0:
            raise ValueError(f"unipc needs sigmas decreasing to 0; step {j} goes from {sig[j]} to {sig[j + 1]}")
    lam = [_lam(v) for v in sig]
    s = sig[i]
    k = [1.0, 0.0, 0.0, 0.0, 0.0]
    if i > 0:                                 # UniC at the previous predictor's order
        prev_order = min(2, n - (i - 1), i)
        h = lam[i] - lam[i - 1]
        phi = math.expm1(-h)                  # (bh2: B = phi)
        a = 1.0 - s
        k = [0.0, s / sig[i - 1], -a * phi, 0.0, 0.0]
        if prev_order == 1:
            rho1, rho_t, inv_r = 0.0, 0.5, 0.0
        else:
            r1 = (lam[i - 2] - lam[i - 1]) / h
            rho1, rho_t = unipc_rhos_c2(h, r1)
            inv_r = 1.0 / r1 if math.isfinite(r1) else 0.0
        # - a B (rho1 (m_prev2 - m_prev) / r1 + rho_t (m - m_prev))
        k[2] += a * phi * (rho1 * inv_r + rho_t)
        k[3] = -a * phi * rho1 * inv_r
        k[4] = -a * phi * rho_t
    s_next = sig[i + 1]
    if s_next == 0.0:
        p = (0.0, 1.0, 0.0)
    else:
        h = lam[i + 1] - lam[i]
        phi = math.expm1(-h)
        a = 1.0 - s_next
        order = min(2, n - i, i + 1)
        p1, p2 = -a * phi, 0.0
        if order == 2:
            r1 = (lam[i - 1] - lam[i]) / h
            w = a * phi * 0.5 / r1 if math.isfinite(r1) else 0.0    # - a B (m_prev - m) / (2 r1)
            p1, p2 = p1 + w, -w
        p = (s_next / s, p1, p2)
    return (s, *k, *p)


def dpmpp_2m_sde_coefficients(sigmas, i):
    """(s, c_x, c_m, c_d, c_z) of DPM-Solver++(2M) SDE's step i along `sigmas` (decreasing to 0): x' = c_x x +
    c_m m + c_d (m - m_prev) + c_z z with m = x - s v; first order (c_d = 0) where dpmpp_2m_coefficients is, and
    into 0: x' = m."""
    s, _, _, _ = dpmpp_2m_coefficients(sigmas, i)    # (its checks, and its first / last-step rules for c_d)
    s_next = float(sigmas[i + 1])
    if s_next == 0.0:
        return s, 0.0, 1.0, 0.0, 0.0
    h = _lam(s_next) - _lam(s)
    e = math.exp(-h)                                  # (0 from s = 1: lambda -inf)
    c_m = (1.0 - s_next) * -math.expm1(-2.0 * h)
    c_d = 0.0
    if i > 0:
        h_prev = _lam(s) - _lam(float(sigmas[i - 1]))
        if math.isfinite(h_prev) and h_prev > 0:
            c_d = 0.5 * c_m * h / h_prev
    return s, s_next / s * e, c_m, c_d, s_next * math.sqrt(-math.expm1(-2.0 * h))


def step_noise(seeds, device=None):
    """noise(i, x) -> a stochastic sampler's unit noise for step i, float32 of x's shape on x's device: image j's
    from a generator of its own seeded seeds[j] + 1 (its noise whatever the batch it is drawn in, as SDXL's stochastic
    samplers); an int: one generator seeded seed + 1 for the whole batch (the samplers that draw a batch's starting
    noise from one seed)."""
    dev = flame.device(device) if device is not None else flame.default_device()
    if isinstance(seeds, int):
        g = flame.Generator(dev).manual_seed(seeds + 1)
        return lambda i, x: flame.randn(*x.shape, generator=g, dtype=flame.float32, device=x.device)
    gens = [flame.Generator(dev).manual_seed(int(s) + 1) for s in seeds]

    def noise(i, x):
        if x.shape[0] != len(gens):
            raise ValueError(f"step noise for {x.shape[0]} images from {len(gens)} seeds")
        parts = [flame.randn(1, *x.shape[1:], generator=g, dtype=flame.float32, device=x.device) for g in gens]
        return parts[0] if len(parts) == 1 else flame.cat(parts, dim=0)
    return noise


def check_step_noise(sampler, noise):
    """A ValueError when the stochastic `sampler` gets no step noise."""
    if sampler in STOCHASTIC and noise is None:
        raise ValueError(f"{sampler} draws fresh noise at every step: pass step_noise (samplers.flow.step_noise of "
                         f"the images' seeds)")


def multistep_state(sampler, x):
    """The history the first step of a multistep `sampler` takes (zeros of x's shape, which it does not read);
    () for a one-step sampler."""
    return tuple(flame.zeros_like(x) for _ in range(_HISTORY.get(sampler, 0)))


def step_coefficients(sampler, sigmas, i):
    """The coefficients of step i of a multistep `sampler` along `sigmas` (dpmpp_2m_coefficients,
    dpmpp_2m_sde_coefficients or unipc_coefficients)."""
    return {"dpmpp_2m": dpmpp_2m_coefficients, "dpmpp_2m_sde": dpmpp_2m_sde_coefficients,
            "unipc": unipc_coefficients}[sampler](sigmas, i)
