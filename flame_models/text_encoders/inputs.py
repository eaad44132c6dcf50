"""Checks and conversions of what the encoders are called with: token ids (B, L) and an optional padding mask."""
import numpy as np

import flame_core as flame
from flame_core.errors import DTypeError, ShapeError


def token_ids(input_ids, *, vocab_size, device, model):
    """`input_ids` (a Tensor, NumPy array or nested list of ints, (B, L)) as an integer Tensor on `device`.

    Ids held on the host are range-checked against the vocabulary before anything runs; ids already on a GPU are
    not (the check would wait for the GPU), and an out-of-range id there reads a clamped row."""
    if isinstance(input_ids, flame.Tensor):
        t = input_ids
        if t.dtype.is_floating_point or t.dtype == flame.bool:
            raise DTypeError(f"{model}: input_ids must be integer token ids, got {t.dtype}")
    else:
        arr = np.asarray(input_ids)
        if arr.dtype.kind not in "iu":
            raise DTypeError(f"{model}: input_ids must be integer token ids, got a {arr.dtype} array")
        t = flame.tensor(arr.astype(np.int64, copy=False))
    if t.ndim != 2:
        raise ShapeError(f"{model}: input_ids must be (batch, length), got shape {tuple(t.shape)}"
                         + (" (add the batch dim: ids[None])" if t.ndim == 1 else ""))
    if t.shape[1] == 0:
        raise ShapeError(f"{model}: input_ids of shape {tuple(t.shape)} hold no tokens")
    checked = not t.is_cuda  # ids on the host are checked before anything is sent to the device
    if checked:
        _check_range(t, vocab_size, model)
    t = t.to(device)
    if not checked and not t.is_cuda:
        _check_range(t, vocab_size, model)
    return t


def _check_range(t, vocab_size, model):
    a = t.numpy()
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab_size:
        raise IndexError(f"{model}: token ids span [{lo}, {hi}] but the vocabulary has {vocab_size} entries")


def padding_mask(attention_mask, ids, *, device, model):
    """The (B, L) mask (1 / True = a real token, 0 = padding) as a bool Tensor on `device`, or None."""
    if attention_mask is None:
        return None
    m = attention_mask if isinstance(attention_mask, flame.Tensor) else flame.tensor(np.asarray(attention_mask))
    if tuple(m.shape) != tuple(ids.shape):
        raise ShapeError(f"{model}: attention_mask of shape {tuple(m.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}")
    return m.to(device) != 0
