"""Timestep (σ) sampling for rectified-flow training: the choices users of kohya / ai-toolkit expect.

Every sampler returns σ in [0, 1] (the transformer receives t = σ). Draws come from a `flame.Generator` so that a
checkpoint that stores the generator's state resumes with exactly the same σ sequence.

    sigmoid       σ = sigmoid(s · n),  n ~ N(0, 1), s = `sigmoid_scale` (1.0)
    logit_normal  σ = sigmoid(μ + s · n)  with μ = `logit_mean` (0.0), s = `logit_std` (1.0)   (SD3's choice)
    uniform       σ ~ U[0, 1)
    linear        σ = (1000 − k) / 1000, k uniform in {0, ..., 998}: ai-toolkit's 'linear' (its table
                  linspace(1000, 1, 1000) indexed by randint(0, 999), which never draws the last entry)
    shift         σ = k·u / (1 + (k − 1)·u),  u = sigmoid(s · n), k = `shift` (3.0)            (kohya 'shift')
    flux_shift    σ = e^μ / (e^μ + 1/u − 1),  u = sigmoid(s · n), μ linear in the packed token count
                  (0.5 at 256 tokens, 1.15 at 4096: BFL's schedule shift, kohya 'flux_shift')
    mode          σ = 1 − u − m·(cos²(πu/2) − 1 + u),  u ~ U[0, 1), m = `mode_scale` (1.29): the SD3 paper's
                  mode sampling with heavy tails (diffusers' / kohya's weighting_scheme 'mode'); m in (−1, 1.75)
                  keeps σ in [0, 1] and decreasing in u
    chroma        σ on the grid linspace(0, 1, 1000) with probability ∝ 2 − 7.7·(σ − 0.5)², the inverse of its CDF
                  at u ~ U[0, 1), no shift: how Chroma was trained (lodestone-rock/flow, src/trainer/train_chroma*.py:
                  create_distribution / sample_from_distribution); Chroma's default

`bias` (ai-toolkit's content_or_style): "balanced" draws σ from the type's distribution as above; "content" and
"style" draw it at the distribution's quantile p = 1 − u³ (favouring high noise: composition, structure) or p = u³
(low noise: texture, style), u ~ U[0, 1) -- ai-toolkit's cubic index into its sorted table of the type's timesteps
(diffusers' training scripts, after T2I-Adapter §3.4).
"""
import math
import statistics

import numpy as np

import flame_core as flame

TIMESTEP_TYPES = ("sigmoid", "logit_normal", "uniform", "linear", "shift", "flux_shift", "mode", "chroma")
LINEAR_STEPS = 1000   # ai-toolkit's table of 'linear' timesteps
# mode_scale must lie in (MODE_SCALE_RANGE): outside it σ(u) is not monotone (or leaves [0, 1])
MODE_SCALE_RANGE = (-1.0, 1.0 / (math.pi / 2 - 1))

BASE_TOKENS, MAX_TOKENS, BASE_SHIFT, MAX_SHIFT = 256, 4096, 0.5, 1.15


def flux_mu(num_tokens, base_tokens=BASE_TOKENS, max_tokens=MAX_TOKENS, base_shift=BASE_SHIFT, max_shift=MAX_SHIFT):
    """BFL's μ: linear in the packed image token count, 0.5 at 256 tokens (512²) and 1.15 at 4096 (1024²)."""
    m = (max_shift - base_shift) / (max_tokens - base_tokens)
    return m * num_tokens + (base_shift - m * base_tokens)


def flux_time_shift(sigma, mu):
    """e^μ / (e^μ + 1/σ − 1), written as e^μσ / (e^μσ + 1 − σ) so that σ = 0 maps to 0 without a division by 0."""
    sigma = np.asarray(sigma, dtype=np.float64)
    e = math.exp(mu)
    return e * sigma / (e * sigma + (1.0 - sigma))


def shift_sigmas(sigma, shift):
    """k·σ / (1 + (k − 1)·σ): the discrete-flow shift (SD3 / kohya `discrete_flow_shift`)."""
    sigma = np.asarray(sigma, dtype=np.float64)
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def mode_sigmas(u, mode_scale=1.29):
    """σ = 1 − u − m·(cos²(πu/2) − 1 + u) for u in [0, 1) (diffusers' compute_density_for_timestep_sampling 'mode')."""
    u = np.asarray(u, dtype=np.float64)
    return 1.0 - u - mode_scale * (np.cos(math.pi * u / 2) ** 2 - 1.0 + u)


CHROMA_GRID = np.linspace(0.0, 1.0, 1000)
_CHROMA_P = 2.0 - 7.7 * (CHROMA_GRID - 0.5) ** 2          # > 0 on the whole grid (0.075 at the ends)
_CHROMA_CDF = np.cumsum(_CHROMA_P / _CHROMA_P.sum())


def chroma_sigmas(u):
    """Chroma's training σ for uniform draws u in [0, 1): the grid value where the density's CDF first exceeds u
    (searchsorted right, as the reference; u past the last CDF value, a rounding case, takes the last point)."""
    i = np.searchsorted(_CHROMA_CDF, np.asarray(u, dtype=np.float64), side="right")
    return CHROMA_GRID[np.minimum(i, len(CHROMA_GRID) - 1)]


BIASES = ("balanced", "content", "style")


def sample_sigmas(kind, batch_size, *, generator=None, num_tokens=None, shift=3.0, sigmoid_scale=1.0,
                  logit_mean=0.0, logit_std=1.0, mode_scale=1.29, device="cpu", dtype=flame.float32, bias="balanced"):
    """Draw `batch_size` σ values of the distribution `kind` (one of TIMESTEP_TYPES) as a 1-D tensor on `device`.

    The draw is made on the CPU in float64 from `generator` (a CPU `flame.Generator`; the default CPU generator when
    None), so the sequence is the same on every device. `num_tokens` (packed image tokens per sample) is required for
    'flux_shift'.
    """
    if kind not in TIMESTEP_TYPES:
        raise ValueError(f"unknown timestep type {kind!r}; choose one of {', '.join(TIMESTEP_TYPES)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"timestep sampling draws on the CPU; got a generator on {generator.device}")
    if bias not in BIASES:
        raise ValueError(f"unknown bias {bias!r}; choose one of {', '.join(BIASES)}")
    p = None   # content / style: the quantile of σ's distribution to take (σ increasing in it)
    if bias != "balanced":
        u = flame.rand(batch_size, generator=generator, dtype=flame.float64, device="cpu").numpy()
        p = 1.0 - u ** 3 if bias == "content" else u ** 3
    if kind in ("uniform", "linear", "mode", "chroma"):
        s = flame.rand(batch_size, generator=generator, dtype=flame.float64, device="cpu").numpy() if p is None \
            else (1.0 - p if kind in ("mode", "linear") else p)   # (mode's σ and linear's index go the other way)
        if kind == "linear":   # s: the index's fraction of the table (0: σ 1)
            k = np.minimum(np.floor(s * (LINEAR_STEPS - 1)), LINEAR_STEPS - 2)
            s = (LINEAR_STEPS - k) / LINEAR_STEPS
        elif kind == "chroma":
            s = chroma_sigmas(s)
        elif kind == "mode":
            lo, hi = MODE_SCALE_RANGE
            if not lo < mode_scale < hi:
                raise ValueError(f"mode_scale must lie in ({lo}, {hi:.4f}), got {mode_scale}")
            s = mode_sigmas(s, mode_scale)
    else:
        if p is None:
            n = flame.randn(batch_size, generator=generator, dtype=flame.float64, device="cpu").numpy()
        else:   # the standard normal's quantile (σ increases with n in every type below)
            unit = statistics.NormalDist()
            n = np.array([unit.inv_cdf(min(max(float(q), 1e-12), 1.0 - 1e-12)) for q in p])
        if kind == "logit_normal":
            s = _sigmoid(logit_mean + logit_std * n)
        else:
            s = _sigmoid(sigmoid_scale * n)
            if kind == "shift":
                if shift <= 0:
                    raise ValueError(f"shift must be > 0, got {shift}")
                s = shift_sigmas(s, shift)
            elif kind == "flux_shift":
                if num_tokens is None:
                    raise ValueError("timestep type 'flux_shift' needs num_tokens (packed image tokens per sample)")
                s = flux_time_shift(s, flux_mu(num_tokens))
    return flame.tensor(np.asarray(s, dtype=np.float64), dtype=dtype, device=device)
