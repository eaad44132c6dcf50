"""The loss stage's weights from a batch: loss masks per latent pixel (datasets' mask_path / alpha_mask,
flame_models/data/masks.py) and per-sample weights of regularisation images (is_reg; train.reg_weight, kohya's
prior_loss_weight; flame_models/data/reg_mix.py). With pred, target (B, ...) in x0's layout, per-sample objective
weights w_b (a weighting scheme, min-SNR-γ; 1 without), the mask m (1 without) and r_b = reg_weight for a
regularisation sample, 1 otherwise:

    L = mean_b( w_b · r_b · mean over sample b's elements of m · (pred − target)² )

A batch with neither (every run without masks and regularisation images) gives no weights, and the loss is the
objective's plain one, bit for bit. The weights are made outside the captured region (host arrays copied in) and
travel with the conditioning under their own keys, so a CUDA graph captures them as inputs.
"""
import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape

MASK_KEY = "loss_mask"        # cond key of the loss mask tensor (x0's layout, broadcasting over channels)
WEIGHT_KEY = "loss_weight"    # cond key of the per-sample weights (B,) float32


def batch_weights(family, batch, x0, reg_weight=1.0):
    """{MASK_KEY: the batch's loss masks in x0's layout, WEIGHT_KEY: (B,) float32} for what `batch` carries
    ("loss_mask" (B, 1, h, w), "is_reg" (B,)); {} when it carries neither."""
    out = {}
    mask = batch.get("loss_mask")
    if mask is not None:
        lat = np.shape(batch["latents"])
        want = (lat[0], 1) + tuple(lat[2:])
        if np.shape(mask) != want:
            raise ShapeError(f"loss_mask {fmt_shape(np.shape(mask))} does not fit latents {fmt_shape(lat)}: "
                             f"expected {fmt_shape(want)}")
        out[MASK_KEY] = family.loss_mask(np.asarray(mask, np.float32), x0)
    is_reg = batch.get("is_reg")
    if is_reg is not None:
        w = np.where(np.asarray(is_reg, dtype=bool), np.float32(reg_weight), np.float32(1.0)).astype(np.float32)
        out[WEIGHT_KEY] = flame.tensor(w, device=x0.device)
    return out


def split(cond):
    """(cond without the weights, {"mask": ..., "sample_weights": ...} for objective.loss)."""
    cond = dict(cond)
    return cond, {"mask": cond.pop(MASK_KEY, None), "sample_weights": cond.pop(WEIGHT_KEY, None)}
