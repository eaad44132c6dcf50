"""ctc_loss: the Connectionist Temporal Classification loss (Graves et al. 2006), -log p(target | log_probs) summed
over every alignment, by the alpha (forward) and beta (backward) recursions in log space. Each recursion is vectorised
over the batch and the extended label axis (blank, l1, blank, l2, ..., blank: S' = 2 S + 1 states) and loops over time
only."""
import numpy as np

import flame_core as flame
from flame_core import backend
from flame_core.autograd import Function
from flame_core.errors import ShapeError, fmt_shape

from .loss import _reduce


def _logsumexp(*arrays):
    """Elementwise log(sum(exp)) of same-shape arrays, -inf where every term is -inf."""
    xp = backend.xp_of(arrays[0])
    m = arrays[0]
    for a in arrays[1:]:
        m = xp.maximum(m, a)
    safe = xp.where(xp.isfinite(m), m, 0.0)
    total = sum(xp.exp(a - safe) for a in arrays)
    with np.errstate(divide="ignore"):
        return xp.log(total) + safe


def _shift(a, k, fill=-np.inf):
    """a moved k states along the last axis (k > 0: state s reads s - k; k < 0: s reads s - k), `fill` entering."""
    xp = backend.xp_of(a)
    out = xp.full_like(a, fill)
    if k > 0:
        out[..., k:] = a[..., :-k]
    else:
        out[..., :k] = a[..., -k:]
    return out


class _CTC(Function):
    """Per-sample negative log-likelihoods (N,) of log_probs (T, N, C). Its gradient is PyTorch's:
    exp(log_probs) - (the posterior occupancy of each label), which is the gradient with respect to the logits when
    log_probs come from log_softmax (the exp term is what log_softmax's backward then cancels); 0 past an input's
    length, and for the samples zero_infinity zeroes."""

    @staticmethod
    def forward(ctx, log_probs, labels, skip, input_lengths, target_lengths, zero_infinity):
        lp = log_probs.array                                    # (T, N, C)
        xp = backend.xp_of(lp)
        T, N, _ = lp.shape
        lpe = xp.take_along_axis(lp, xp.broadcast_to(labels[None], (T,) + labels.shape), axis=2)   # (T, N, S')
        batch = xp.arange(N)
        last = 2 * target_lengths                               # the final blank's state
        # alpha[t + 1]: log p of the prefixes ending in each state at time t; alpha[0] starts in state 0
        alpha = xp.full((T + 1,) + labels.shape, -np.inf, dtype=lp.dtype)
        alpha[0, :, 0] = 0.0
        for t in range(T):
            a = alpha[t]
            alpha[t + 1] = _logsumexp(a, _shift(a, 1), xp.where(skip, _shift(a, 2), -np.inf)) + lpe[t]
        end = alpha[input_lengths, batch]                       # (N, S') at each sample's last frame
        nll = -_logsumexp(end[batch, last], xp.where(last > 0, end[batch, xp.maximum(last - 1, 0)], -np.inf))
        ctx.saved = (lp, lpe, alpha, labels, skip, input_lengths, last, nll)
        ctx.zero_infinity = zero_infinity
        if zero_infinity:
            nll = xp.where(xp.isinf(nll), 0.0, nll)
        return flame.as_tensor(nll)

    @staticmethod
    def backward(ctx, grad):
        lp, lpe, alpha, labels, skip, input_lengths, last, nll = ctx.saved
        xp = backend.xp_of(lp)
        T, N, C = lp.shape
        states = xp.arange(labels.shape[1])
        # beta: log p of completing the target from each state at time t, after t's emission (so alpha * beta
        # counts that emission once); it starts in the last blank and the last label at each sample's last frame
        init = xp.where((states == last[:, None]) | (states == last[:, None] - 1), 0.0, -np.inf).astype(lp.dtype)
        skip_from = _shift(skip, -2, fill=False)                # state s may jump to s + 2
        occupancy = xp.empty_like(lpe)                          # (T, N, S') posterior of each state
        beta = xp.full_like(init, -np.inf)
        with np.errstate(invalid="ignore"):
            for t in range(T - 1, -1, -1):
                if t + 1 < T:
                    b = beta + lpe[t + 1]
                    beta = _logsumexp(b, _shift(b, -1), xp.where(skip_from, _shift(b, -2), -np.inf))
                beta = xp.where((t == input_lengths - 1)[:, None], init,
                                xp.where((t < input_lengths - 1)[:, None], beta, -np.inf))
                occupancy[t] = xp.exp(alpha[t + 1] + beta + nll[:, None])
            # sum the occupancy of the states of each label: (T, N, S') added into (T, N, C)
            flat = (xp.arange(T)[:, None, None] * N + xp.arange(N)[None, :, None]) * C + labels[None]
            occ = xp.zeros(T * N * C, dtype=lp.dtype)
            xp.add.at(occ, flat.reshape(-1), occupancy.reshape(-1))
            g = xp.exp(lp) - occ.reshape(T, N, C)
            # a sample no alignment fits (loss +inf): PyTorch's rule exp(lp) - exp(log_occ + nll - lp) is NaN for every
            # class there, the labels' and the others' alike (-inf + inf); zero_infinity zeroes them below
            g = xp.where(xp.isinf(nll)[None, :, None], np.nan, g)
        keep = xp.arange(T)[:, None] < input_lengths[None, :]  # (T, N)
        if ctx.zero_infinity:
            keep &= ~xp.isinf(nll)[None, :]
        g = xp.where(keep[..., None], g * grad.array.astype(lp.dtype)[None, :, None], 0.0)
        return flame.as_tensor(g), None, None, None, None, None


def _lengths(name, lengths, n):
    arr = lengths.cpu().numpy() if isinstance(lengths, flame.Tensor) else np.asarray(lengths)
    arr = arr.reshape(-1)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ctc_loss: {name} must be integers, got {arr.dtype}")
    if arr.shape[0] != n:
        raise ShapeError(f"ctc_loss: {name} must be of size batch_size ({n}), got {arr.shape[0]}")
    if np.any(arr < 0):
        raise ValueError(f"ctc_loss: {name} must be non-negative, got {arr.tolist()}")
    return arr.astype(np.int64)


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """CTC loss of log_probs (T, N, C) (log-softmax outputs; (T, C) unbatched) against targets (N, S) padded, or 1-D
    concatenated (sum(target_lengths),); input_lengths and target_lengths (N,) as tensors or sequences of ints.
    'mean' divides each loss by its target length (at least 1), then averages over the batch; zero_infinity turns
    infinite losses (no alignment fits) and their gradients into zeros."""
    if log_probs.ndim not in (2, 3):
        raise ShapeError(f"ctc_loss: log_probs must be (T, N, C) or (T, C), got {fmt_shape(log_probs.shape)}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    unbatched = log_probs.ndim == 2
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(1), targets.reshape(1, -1)
    T, N, C = log_probs.shape
    if not 0 <= blank < C:
        raise ValueError(f"ctc_loss: blank must be in label range [0, {C}), got {blank}")
    in_len = _lengths("input_lengths", input_lengths, N)
    tg_len = _lengths("target_lengths", target_lengths, N)
    if np.any(in_len > T):
        raise ValueError(f"ctc_loss: input_lengths must be at most T = {T}, got {in_len.tolist()}")
    tg = targets.cpu().numpy().astype(np.int64)
    if tg.ndim == 1:                                            # concatenated: cut into padded rows
        if tg_len.sum() > tg.shape[0]:
            raise ShapeError(f"ctc_loss: 1-D targets hold {tg.shape[0]} labels, target_lengths sum to "
                             f"{tg_len.sum()}")
        pos = (np.cumsum(tg_len) - tg_len)[:, None] + np.arange(tg_len.max(initial=0))
        tg = tg[np.minimum(pos, tg.shape[0] - 1)] if tg.size else np.zeros(pos.shape, dtype=np.int64)
    elif tg.ndim != 2 or tg.shape[0] != N or tg.shape[1] < tg_len.max(initial=0):
        raise ShapeError(f"ctc_loss: targets {fmt_shape(targets.shape)} must be (N, S) with S >= max(target_lengths) "
                         f"= {tg_len.max(initial=0)}, or 1-D concatenated")
    S = int(tg_len.max(initial=0))
    tg = np.where(np.arange(S) < tg_len[:, None], tg[:, :S], blank)
    if np.any((tg < 0) | (tg >= C)):
        raise IndexError(f"ctc_loss: target labels must be in [0, {C}), got values in [{tg.min()}, {tg.max()}]")

    # the extended labels (N, S'): blank, l1, blank, l2, ..., blank; a label may be reached by skipping the blank
    # before it when it differs from the label two states back
    labels = np.full((N, 2 * S + 1), blank, dtype=np.int64)
    labels[:, 1::2] = tg
    skip = np.zeros(labels.shape, dtype=bool)
    skip[:, 3::2] = tg[:, 1:] != tg[:, :-1]
    xp = backend.xp_of(log_probs.array)
    compute = log_probs if log_probs.dtype in (flame.float32, flame.float64) else log_probs.float()
    nll = _CTC.apply(compute, xp.asarray(labels), xp.asarray(skip), xp.asarray(in_len), xp.asarray(tg_len),
                     bool(zero_infinity)).to(log_probs.dtype)
    if reduction == "mean":
        return (nll / flame.as_tensor(xp.asarray(np.maximum(tg_len, 1))).to(nll.dtype)).mean()
    return nll.reshape(()) if unbatched and reduction == "none" else _reduce(nll, reduction)
