"""Direct NumPy float64 references (loops over the definitions) that the flame_nn layers are tested against."""
import math

import numpy as np


def conv2d(x, w, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    N, C, H, W = x.shape
    O, Cg, KH, KW = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    OH = (H + 2 * ph - dh * (KH - 1) - 1) // sh + 1
    OW = (W + 2 * pw - dw * (KW - 1) - 1) // sw + 1
    y = np.zeros((N, O, OH, OW))
    og = O // groups
    for o in range(O):
        gi = o // og
        for i in range(OH):
            for j in range(OW):
                patch = xp[:, gi * Cg:(gi + 1) * Cg, i * sh:i * sh + dh * (KH - 1) + 1:dh,
                           j * sw:j * sw + dw * (KW - 1) + 1:dw]
                y[:, o, i, j] = (patch * w[o]).sum(axis=(1, 2, 3))
    if b is not None:
        y += b.reshape(1, -1, 1, 1)
    return y


def layer_norm(x, n_dims, w=None, b=None, eps=1e-5):
    ax = tuple(range(x.ndim - n_dims, x.ndim))
    y = (x - x.mean(ax, keepdims=True)) / np.sqrt(x.var(ax, keepdims=True) + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def rms_norm(x, n_dims, w=None, eps=1e-6):
    ax = tuple(range(x.ndim - n_dims, x.ndim))
    y = x / np.sqrt((x * x).mean(ax, keepdims=True) + eps)
    return y * (1 if w is None else w)


def group_norm(x, groups, w=None, b=None, eps=1e-5):
    N, C = x.shape[:2]
    xg = x.reshape(N, groups, -1)
    y = ((xg - xg.mean(2, keepdims=True)) / np.sqrt(xg.var(2, keepdims=True) + eps)).reshape(x.shape)
    shp = (1, C) + (1,) * (x.ndim - 2)
    return y * (1 if w is None else w.reshape(shp)) + (0 if b is None else b.reshape(shp))


def _pool_out(n, k, s, p, d, ceil_mode):
    num = n + 2 * p - d * (k - 1) - 1
    o = (math.ceil(num / s) if ceil_mode else num // s) + 1
    if ceil_mode and (o - 1) * s >= n + p:
        o -= 1
    return o


def max_pool2d(x, k, s, p, d=1, ceil_mode=False):
    N, C, H, W = x.shape
    OH, OW = _pool_out(H, k, s, p, d, ceil_mode), _pool_out(W, k, s, p, d, ceil_mode)
    y = np.full((N, C, OH, OW), -np.inf)
    for i in range(OH):
        for j in range(OW):
            for a in range(k):
                for c in range(k):
                    h, w = i * s - p + a * d, j * s - p + c * d
                    if 0 <= h < H and 0 <= w < W:
                        y[:, :, i, j] = np.maximum(y[:, :, i, j], x[:, :, h, w])
    return y


def avg_pool2d(x, k, s, p, ceil_mode=False, count_include_pad=True, divisor_override=None):
    N, C, H, W = x.shape
    OH, OW = _pool_out(H, k, s, p, 1, ceil_mode), _pool_out(W, k, s, p, 1, ceil_mode)
    y = np.zeros((N, C, OH, OW))
    for i in range(OH):
        for j in range(OW):
            h0, w0 = i * s - p, j * s - p
            h1, w1 = min(h0 + k, H + p), min(w0 + k, W + p)  # PyTorch: the window clipped to the padded input
            pool_size = (h1 - h0) * (w1 - w0)
            hs, ws = max(h0, 0), max(w0, 0)
            he, we = min(h1, H), min(w1, W)
            total = x[:, :, hs:he, ws:we].sum(axis=(2, 3))
            if divisor_override:
                div = divisor_override
            elif count_include_pad:
                div = pool_size
            else:
                div = (he - hs) * (we - ws)
            y[:, :, i, j] = total / div
    return y


def adaptive_avg_pool2d(x, oh, ow):
    N, C, H, W = x.shape
    y = np.zeros((N, C, oh, ow))
    for i in range(oh):
        hs, he = (i * H) // oh, math.ceil((i + 1) * H / oh)
        for j in range(ow):
            ws, we = (j * W) // ow, math.ceil((j + 1) * W / ow)
            y[:, :, i, j] = x[:, :, hs:he, ws:we].mean(axis=(2, 3))
    return y


def upsample_nearest(x, oh, ow):
    H, W = x.shape[2:]
    ih = np.minimum(np.floor(np.arange(oh) * (H / oh)).astype(int), H - 1)
    iw = np.minimum(np.floor(np.arange(ow) * (W / ow)).astype(int), W - 1)
    return x[:, :, ih][:, :, :, iw]


def upsample_bilinear(x, oh, ow, align_corners):
    N, C, H, W = x.shape
    y = np.zeros((N, C, oh, ow))

    def src(i, n_in, n_out):
        if align_corners:
            return i * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        return max((i + 0.5) * n_in / n_out - 0.5, 0.0)
    for i in range(oh):
        sy = src(i, H, oh)
        y0 = min(int(math.floor(sy)), H - 1)
        y1, ly = min(y0 + 1, H - 1), sy - y0
        for j in range(ow):
            sx = src(j, W, ow)
            x0 = min(int(math.floor(sx)), W - 1)
            x1, lx = min(x0 + 1, W - 1), sx - x0
            y[:, :, i, j] = ((1 - ly) * ((1 - lx) * x[:, :, y0, x0] + lx * x[:, :, y0, x1])
                             + ly * ((1 - lx) * x[:, :, y1, x0] + lx * x[:, :, y1, x1]))
    return y


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def multihead_attention(q_in, k_in, v_in, wq, wk, wv, bq, bk, bv, wo, bo, heads, mask=None):
    """Batch-first (N, L, E) inputs; mask additive, broadcastable to (N, H, L, S)."""
    N, L, E = q_in.shape
    S = k_in.shape[1]
    D = E // heads
    q = (q_in @ wq.T + bq).reshape(N, L, heads, D).transpose(0, 2, 1, 3)
    k = (k_in @ wk.T + bk).reshape(N, S, heads, D).transpose(0, 2, 1, 3)
    v = (v_in @ wv.T + bv).reshape(N, S, heads, D).transpose(0, 2, 1, 3)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    if mask is not None:
        s = s + mask
    a = softmax(s)
    o = (a @ v).transpose(0, 2, 1, 3).reshape(N, L, E)
    return o @ wo.T + bo, a


def cross_entropy(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Class-index targets, logits (N, C)."""
    N, C = logits.shape
    logp = logits - logits.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    w = np.ones(C) if weight is None else weight
    losses, weights, smooth = [], [], []
    for i in range(N):
        t = target[i]
        if t == ignore_index:
            losses.append(0.0)
            weights.append(0.0)
            smooth.append(0.0)
            continue
        losses.append(-w[t] * logp[i, t])
        weights.append(w[t])
        smooth.append(-(w * logp[i]).sum())
    losses, weights, smooth = np.array(losses), np.array(weights), np.array(smooth)
    if reduction == "none":
        return (1 - label_smoothing) * losses + label_smoothing / C * smooth
    if reduction == "sum":
        return (1 - label_smoothing) * losses.sum() + label_smoothing / C * smooth.sum()
    return (1 - label_smoothing) * losses.sum() / weights.sum() + label_smoothing / C * smooth.sum() / weights.sum()
