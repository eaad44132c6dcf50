"""embedding_bag: the sum, mean or max of the embedding rows of each bag of indices, without materialising the per-index
embeddings as an output. The bags are laid out as a padded (B, L) block (L the longest bag), looked up with
F.embedding and reduced over L, so the gradients to weight and per_sample_weights are the ops' own."""
import numpy as np

import flame_core as flame
from flame_core.errors import DTypeError, fmt_shape
from flame_core.ops.embedding import embedding

from .embedding import ScaleGrad, renorm_rows_


def _bag_layout(input, offsets, include_last_offset):
    """(positions (B, L) int64 host array into the flat input, their mask (B, L)) for a 1-D input and its offsets."""
    if offsets.ndim != 1:
        raise ValueError(f"offsets has to be a 1D Tensor, got shape {fmt_shape(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == flame.bool:
        raise DTypeError(f"embedding_bag: offsets must be integers, got {offsets.dtype}")
    o = offsets.cpu().numpy().astype(np.int64)
    n = input.shape[0]
    if o.size and o[0] != 0:
        raise ValueError(f"offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from "
                         f"position 0. However, got {o[0]}")
    if o.size and (o[-1] > n or np.any(np.diff(o) < 0)):
        raise ValueError(f"embedding_bag: offsets must be non-decreasing and at most the input's length {n}, got "
                         f"{o.tolist()}")
    starts, ends = (o[:-1], o[1:]) if include_last_offset else (o, np.append(o[1:], n))
    lengths = ends - starts
    slots = np.arange(int(lengths.max()) if lengths.size else 0)
    return starts[:, None] + slots, slots < lengths[:, None]


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False, mode="mean",
                  sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """Bags of rows of `weight` (num_embeddings, D) reduced to (B, D): `input` (B, L) is B bags of L indices, or a 1-D
    input cut into bags at `offsets` (B,) (with include_last_offset, (B + 1,) whose last entry ends the last bag).
    mode 'sum' (rows times per_sample_weights, input's shape, when given), 'mean' or 'max'; indices equal to
    padding_idx are left out (of the mean's count too); an empty bag gives zeros. max_norm renormalises the rows
    looked up, in place (PyTorch's embedding_renorm_); scale_grad_by_freq divides each row's gradient by its count in
    the input (the documented rule; PyTorch 2.13's CPU kernel divides by misaligned counts)."""
    if weight.ndim != 2:
        raise ValueError(f"weight has to be a 2D Tensor, but got Tensor of dimension {weight.ndim}")
    if input.dtype.is_floating_point or input.dtype == flame.bool:
        raise DTypeError(f"embedding_bag: indices must be integers (int64 or int32), got {input.dtype}")
    if mode not in ("sum", "mean", "max"):
        raise ValueError("mode has to be one of sum, mean or max")
    if sparse:
        raise NotImplementedError("embedding_bag: sparse=True is not supported (FLAME's gradients are dense); pass "
                                  "sparse=False")
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(f"embedding_bag: per_sample_weights was not None. per_sample_weights is only "
                                      f"supported for mode='sum' (got mode='{mode}')")
        if tuple(per_sample_weights.shape) != tuple(input.shape):
            raise ValueError(f"embedding_bag: If per_sample_weights ({fmt_shape(per_sample_weights.shape)}) is not "
                             f"None, then it must have the same shape as the input ({fmt_shape(input.shape)})")
        if per_sample_weights.dtype != weight.dtype:
            raise DTypeError(f"embedding_bag: per_sample_weights ({per_sample_weights.dtype}) must have weight's "
                             f"dtype ({weight.dtype})")
    if scale_grad_by_freq and mode == "max":
        raise ValueError("max mode does not support scaling the gradient by the frequency")
    num = weight.shape[0]
    if padding_idx is not None:
        if not -num <= padding_idx < num:
            raise ValueError(f"padding_idx must be within the number of embeddings, {-num} through {num - 1}, but "
                             f"got {padding_idx}")
        padding_idx %= num

    # the bags as a padded (B, L) block of indices, and which slots hold one
    if input.ndim == 2:
        if offsets is not None:
            raise ValueError("if input is 2D, then offsets has to be None, as input is treated is a mini-batch of "
                             "fixed length sequences")
        idx, psw = input, per_sample_weights
        mask = flame.ones(tuple(input.shape), dtype=flame.bool, device=input.device)
    elif input.ndim == 1:
        if offsets is None:
            raise ValueError("offsets has to be a 1D Tensor but got None")
        pos, slot_mask = _bag_layout(input, offsets, include_last_offset)
        pos = flame.tensor(pos.clip(0, max(input.shape[0] - 1, 0)), device=input.device)
        mask = flame.tensor(slot_mask, device=input.device)
        idx = input[pos] if input.shape[0] else flame.zeros(tuple(pos.shape), dtype=input.dtype, device=input.device)
        psw = per_sample_weights[pos] if per_sample_weights is not None and input.shape[0] else None
    else:
        raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.ndim}")
    if idx.numel() and bool(((idx < 0) | (idx >= num)).any()):
        raise IndexError(f"embedding_bag: indices must be in [0, {num}), got values in [{int(idx.min())}, "
                         f"{int(idx.max())}]")
    if idx.shape[1] == 0:  # bags all empty: one masked slot keeps the output connected to weight
        idx = flame.zeros((idx.shape[0], 1), dtype=idx.dtype, device=idx.device)
        mask = flame.zeros((idx.shape[0], 1), dtype=flame.bool, device=idx.device)
        psw = None
    if max_norm is not None:
        renorm_rows_(weight, idx, max_norm, norm_type)

    # look up (B, L, D), weigh, reduce over L
    valid = mask if padding_idx is None else mask & (idx != padding_idx)
    rows = embedding(idx, weight)
    if scale_grad_by_freq:
        freq = flame.bincount(input.reshape(-1).long(), minlength=num)[idx]   # the input's counts, at the slots
        rows = ScaleGrad.apply(rows, (1.0 / freq.to(rows.dtype)).unsqueeze(-1))
    count = valid.sum(1, keepdim=True)                                         # (B, 1)
    if mode == "max":
        out = rows.masked_fill(~valid.unsqueeze(-1), float("-inf")).max(1)[0]
        return out.masked_fill(count == 0, 0.0)
    w = valid.to(rows.dtype) if psw is None else psw * valid.to(rows.dtype)
    out = (rows * w.unsqueeze(-1)).sum(1)
    return out / count.clamp(min=1).to(out.dtype) if mode == "mean" else out
