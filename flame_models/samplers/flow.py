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

A multistep sampler carries the previous data prediction from step to step. Its step function takes it and returns it
(`flow_step`'s dpmpp_2m: (x, t, t_next, dt, m_prev, c) -> (x', m)) so that a CUDA graph of the step holds no state of
its own: the per-step coefficients `c` come in as a tensor (`dpmpp_2m_coefficients`), the history as another input.
"""
import math

FLOW_SAMPLERS = ("euler", "heun", "dpmpp_2m")
MULTISTEP = frozenset(("dpmpp_2m",))
# the names A1111 / Forge write in an image's "parameters" text (generate's PNG metadata)
DISPLAY_NAMES = {"euler": "Euler", "heun": "Heun", "dpmpp_2m": "DPM++ 2M"}


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
    float32 tensor of 4 on x's device; reads neither t_next nor dt."""
    kind = check_flow_sampler(sampler)
    if kind == "euler":
        return lambda x, t, t_next, dt: x + dt * velocity(x, t)
    if kind == "dpmpp_2m":
        def dpmpp_2m(x, t, t_next, dt, m_prev, c):
            m = x - c[0] * velocity(x, t)
            return c[1] * x + c[2] * m + c[3] * (m - m_prev), m
        return dpmpp_2m

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
