"""im2col + GEMM, in bounded-memory chunks (planning.plan: a few whole images, or one band of output rows of one
image when a single image is too big). Per chunk:
    forward     out(O, P) = W(O, C*KH*KW) @ cols                       (grouped: one batched GEMM over groups)
    backward    dW += dY(O, P) @ cols^T ;  dcols = W^T @ dY ;  dX (+)= col2im(dcols)
cols is recomputed in backward rather than saved, so a conv keeps only x and w alive for backward."""
import numpy as np

from ... import backend
from .columns import col2im, im2col
from .matmul import mm
from .planning import HALF, plan, workspace_bytes


def _forward_chunk(w3, cols, out, g):
    """out(O, P) = W @ cols, group by group in one (batched) GEMM. w3 is (G, O/G, C/G*KH*KW)."""
    if g.G == 1:
        mm(w3[0], cols, out)
    else:
        mm(w3, cols.reshape(g.G, -1, cols.shape[1]), out.reshape(g.G, -1, cols.shape[1]))


def im2col_forward(x, w, g):
    xp = backend.xp_of(x)
    w3 = w.reshape(g.G, g.O // g.G, -1)
    y = xp.empty((g.N, g.O, g.OH, g.OW), dtype=x.dtype)
    budget = workspace_bytes(xp is not np)
    for n0, nimg, oh0, nrows in plan(g, x.itemsize, budget):
        cols = im2col(x, g, n0, nimg, oh0, nrows)
        P = cols.shape[1]
        if nimg == 1 and nrows == g.OH:
            _forward_chunk(w3, cols, y[n0].reshape(g.O, P), g)
            continue
        out = xp.empty((g.O, P), dtype=x.dtype)
        _forward_chunk(w3, cols, out, g)
        if nrows == g.OH:
            y[n0:n0 + nimg] = out.reshape(g.O, nimg, g.OH, g.OW).transpose(1, 0, 2, 3)
        else:
            y[n0, :, oh0:oh0 + nrows] = out.reshape(g.O, nrows, g.OW)
        del cols, out
    return y


def _grad_chunk(gy, g, n0, nimg, oh0, nrows):
    """dY of a chunk as an (O, P) matrix."""
    xp = backend.xp_of(gy)
    if nrows == g.OH:
        if nimg == 1:
            return gy[n0].reshape(g.O, -1)
        return xp.ascontiguousarray(gy[n0:n0 + nimg].reshape(nimg, g.O, -1).transpose(1, 0, 2)).reshape(g.O, -1)
    return xp.ascontiguousarray(gy[n0, :, oh0:oh0 + nrows]).reshape(g.O, -1)


def im2col_backward(gy, x, w, g, need_x, need_w):
    xp = backend.xp_of(x)
    w3 = w.reshape(g.G, g.O // g.G, -1)
    chunks = plan(g, x.itemsize, workspace_bytes(xp is not np) // 2)
    banded = any(nrows != g.OH for _, _, _, nrows in chunks)
    dx = (xp.zeros if banded else xp.empty)(x.shape, dtype=x.dtype) if need_x else None
    dw = None
    acc_dt = np.float32 if w.dtype in HALF else w.dtype
    w3t = w3.transpose(0, 2, 1)  # (G, CgK, Og)
    for n0, nimg, oh0, nrows in chunks:
        gc = _grad_chunk(gy, g, n0, nimg, oh0, nrows)  # (O, P)
        P = gc.shape[1]
        if need_w:
            cols = im2col(x, g, n0, nimg, oh0, nrows)
            if g.G == 1:
                part = mm(gc, cols.T)[None]
            else:
                part = mm(gc.reshape(g.G, -1, P), cols.reshape(g.G, -1, P).transpose(0, 2, 1))
            if len(chunks) == 1:
                dw = part
            elif dw is None:
                dw = part.astype(acc_dt)
            else:
                dw += part
            del cols, part
        if need_x:
            if g.G == 1:
                dcols = mm(w3t[0], gc)
            else:
                dcols = mm(w3t, gc.reshape(g.G, -1, P)).reshape(-1, P)
            col2im(dcols, dx, g, n0, nimg, oh0, nrows, accumulate=banded)
            del dcols
    if dw is not None:
        dw = dw.astype(w.dtype, copy=False).reshape(w.shape)
    return dx, dw
