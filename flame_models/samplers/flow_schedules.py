"""Respacing a flow-matching family's sigma table: the `scheduler` choices (ComfyUI's word; A1111's "Schedule type")
simple, karras, exponential and beta -- diffusers' FlowMatchEulerDiscreteScheduler with none of / use_karras_sigmas /
use_exponential_sigmas / use_beta_sigmas.

A family's own table ("simple": SD3's shifted linspace, Flux's time-shifted one, Chroma's, Qwen-Image's stretched to
its terminal sigma) goes through `respace`, which keeps its end points -- s_max = its first sigma, s_min = its last
sigma above 0 -- and its number of steps, and spaces the steps between them anew, then appends 0, as diffusers does
after its shifting (so `simple` is the table unchanged):

    karras       (s_max^(1/7) + r (s_min^(1/7) - s_max^(1/7)))^7,      r = 0 .. 1 in n steps (Karras et al. 2022)
    exponential  exp(log s_max + r (log s_min - log s_max))
    beta         s_min + F^-1(1 - r) (s_max - s_min),  F the Beta(0.6, 0.6) distribution ("Beta Sampling is All You
                 Need", Lee et al. 2024: more steps at both ends)

The model's timesteps follow the new sigmas (each family's own sigma -> timestep rule). Host-side float64; the
inverse of the regularised incomplete beta function is computed here (no SciPy): a continued fraction for I_x(a, b)
and a safeguarded Newton iteration, to ~1e-14 in x.
"""
import math

FLOW_SCHEDULERS = ("simple", "karras", "exponential", "beta")
# the names A1111 / Forge write as "Schedule type" in an image's "parameters" text
DISPLAY_NAMES = {"simple": "Simple", "karras": "Karras", "exponential": "Exponential", "beta": "Beta"}
BETA_ALPHA = BETA_BETA = 0.6   # diffusers' _convert_to_beta defaults
KARRAS_RHO = 7.0


def check_flow_scheduler(schedule):
    """`schedule` if it is one of FLOW_SCHEDULERS (a `scheduler=` argument), else a ValueError naming them."""
    if schedule not in FLOW_SCHEDULERS:
        raise ValueError(f"unknown flow-matching scheduler {schedule!r}: choose one of {', '.join(FLOW_SCHEDULERS)}")
    return schedule


def respace(sigmas, schedule):
    """The family table `sigmas` (decreasing, ending in 0) respaced by `schedule` (module docstring): a list of
    floats of the same length, ending in 0."""
    check_flow_scheduler(schedule)
    table = [float(s) for s in sigmas]
    if len(table) < 2 or table[-1] != 0.0 or any(not a > b for a, b in zip(table, table[1:])):
        raise ValueError(f"a flow schedule respaces a table of sigmas decreasing to 0, got {table[:4]}"
                         f"{' ...' if len(table) > 4 else ''}")
    if schedule == "simple":
        return table
    n = len(table) - 1
    hi, lo = table[0], table[-2]
    ramp = [i / (n - 1) for i in range(n)] if n > 1 else [0.0]
    if schedule == "karras":
        a, b = hi ** (1 / KARRAS_RHO), lo ** (1 / KARRAS_RHO)
        out = [(a + r * (b - a)) ** KARRAS_RHO for r in ramp]
    elif schedule == "exponential":
        a, b = math.log(hi), math.log(lo)
        out = [math.exp(a + r * (b - a)) for r in ramp]
    else:
        out = [lo + beta_ppf(1.0 - r, BETA_ALPHA, BETA_BETA) * (hi - lo) for r in ramp]
    return out + [0.0]


def _betacf(a, b, x):
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def beta_cdf(x, a, b):
    """The regularised incomplete beta function I_x(a, b): the Beta(a, b) distribution's CDF at x."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def beta_ppf(p, a, b):
    """The inverse of beta_cdf in x (the Beta(a, b) distribution's quantile at p): Newton steps on I_x - p, kept
    inside a bisection bracket."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a probability in [0, 1], got {p}")
    if p == 0.0 or p == 1.0:
        return p
    lo, hi = 0.0, 1.0
    log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    x = 0.5
    for _ in range(200):
        f = beta_cdf(x, a, b) - p
        if f > 0:
            hi = x
        else:
            lo = x
        pdf = math.exp(log_norm + (a - 1.0) * math.log(x) + (b - 1.0) * math.log1p(-x))
        step = x - f / pdf if pdf > 0 else None
        nxt = step if step is not None and lo < step < hi else 0.5 * (lo + hi)
        if abs(nxt - x) <= 1e-15 * max(x, 1e-300) or hi - lo <= 1e-15:
            return nxt
        x = nxt
    return x
