"""Variable-length sequences, PyTorch's torch.nn.utils.rnn: pad_sequence / unpad_sequence, and the PackedSequence
(the time steps of a batch sorted by decreasing length, stacked without padding) made by pack_padded_sequence /
pack_sequence and undone by pad_packed_sequence / unpack_sequence. Every move of the data is one index_select, so
gradients flow through all of them."""
from collections import namedtuple

import numpy as np

import flame_core as flame
from flame_core import dtypes as D
from flame_core.tensor import Tensor


def invert_permutation(permutation):
    """The permutation q with q[permutation[i]] == i (None stays None)."""
    if permutation is None:
        return None
    return permutation.argsort()


class PackedSequence(namedtuple("PackedSequence", ["data", "batch_sizes", "sorted_indices", "unsorted_indices"]),
                     D.FloatCasts):
    """data (sum of lengths, *): step 0 of every sequence, then step 1 of those that have it, ...; batch_sizes (int64,
    on the cpu): how many sequences each step holds; sorted_indices: the batch order packed (None: as given),
    unsorted_indices its inverse. Casts and moves (to, cpu, cuda, float, double, half, ...) apply to data, the
    indices follow data's device."""
    __slots__ = ()

    def __new__(cls, data, batch_sizes=None, sorted_indices=None, unsorted_indices=None):
        if batch_sizes is None:   # PyTorch's legacy form PackedSequence((data, batch_sizes), ...)
            if not isinstance(data, (list, tuple)) or len(data) != 2:
                raise TypeError("PackedSequence: pass data and batch_sizes, or one (data, batch_sizes) pair")
            data, batch_sizes = data
        if isinstance(batch_sizes, flame.Tensor) and batch_sizes.device.type != "cpu":
            raise ValueError("PackedSequence: batch_sizes should always be on CPU (as PyTorch: they are read on the "
                             f"host), got a tensor on {batch_sizes.device}")
        if unsorted_indices is None:
            unsorted_indices = invert_permutation(sorted_indices)
        return super().__new__(cls, data, batch_sizes, sorted_indices, unsorted_indices)

    def _with_data(self, data):
        move = [None if i is None else i.to(data.device) for i in (self.sorted_indices, self.unsorted_indices)]
        return type(self)(data, self.batch_sizes, *move)

    def to(self, *args, **kwargs):
        return self._with_data(self.data.to(*args, **kwargs))

    def cpu(self):
        return self._with_data(self.data.cpu())

    def cuda(self, device=None):
        return self._with_data(self.data.cuda(device))

    def long(self):
        return self.to(D.int64)

    def int(self):
        return self.to(D.int32)

    @property
    def is_cuda(self):
        return self.data.is_cuda


def _gather(rows, index, padding_value, batch_first):
    """(T, B, *) (batch_first: (B, T, *)) from rows (N, *): entry (t, b) is rows[index[t, b]], the host index array's
    N meaning padding_value."""
    if batch_first:
        index = index.T
    pad = flame.full((1, *rows.shape[1:]), padding_value, dtype=rows.dtype, device=rows.device)
    picked = flame.cat([rows, pad]).index_select(0, flame.tensor(index.reshape(-1), dtype=flame.int64,
                                                                 device=rows.device))
    return picked.reshape(*index.shape, *rows.shape[1:])


def pad_sequence(sequences, batch_first=False, padding_value=0.0, padding_side="right"):
    """Stack sequences of shapes (L_i, *) into (T, B, *) (batch_first: (B, T, *)), T the longest length, the rest
    filled with padding_value after (padding_side "right") or before ("left") each sequence."""
    if padding_side not in ("left", "right"):
        raise RuntimeError(f"Expected padding_side to be one of left or right, but got {padding_side}.")
    sequences = list(sequences.unbind(0) if isinstance(sequences, Tensor) else sequences)
    if not sequences:
        raise RuntimeError("received an empty list of sequences")
    if any(s.ndim == 0 for s in sequences) or len({tuple(s.shape[1:]) for s in sequences}) > 1:
        raise RuntimeError(f"pad_sequence: sequences must have one or more dims and the same trailing dims, got shapes "
                           f"{[tuple(s.shape) for s in sequences]}")
    lengths = np.array([s.shape[0] for s in sequences], dtype=np.int64)
    total = int(lengths.max())
    # step t of the output holds step t - shift of sequence b, whose rows start at starts[b] in the concatenation
    shift = total - lengths if padding_side == "left" else 0
    step = np.arange(total)[:, None] - shift
    starts = np.cumsum(lengths) - lengths
    index = np.where((step >= 0) & (step < lengths), starts + step, lengths.sum())
    return _gather(flame.cat(sequences), index, padding_value, batch_first)


def unpad_sequence(padded_sequences, lengths, batch_first=False):
    """The sequences of a padded batch (T, B, *) (batch_first: (B, T, *)): a list of (L_i, *) views."""
    if not batch_first:
        padded_sequences = padded_sequences.transpose(0, 1)
    return [padded_sequences[i, :int(n)] for i, n in enumerate(_lengths(lengths))]


def _lengths(lengths):
    """lengths (a list or a 1-D tensor) as a host int64 array."""
    if isinstance(lengths, Tensor):
        lengths = lengths.tolist()
    array = np.asarray(lengths).astype(np.int64)
    if array.ndim != 1:
        raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {array.ndim}D tensor")
    return array


def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
    """Pack a padded batch (T, B, *) (batch_first: (B, T, *)) whose sequence b has lengths[b] steps. enforce_sorted:
    lengths must decrease (sorted_indices None); else the batch is sorted by decreasing length (stably)."""
    lengths = _lengths(lengths)
    if enforce_sorted:
        if np.any(lengths[:-1] < lengths[1:]):
            raise RuntimeError("`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You "
                               "can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to "
                               "sidestep this requirement if you do not need ONNX exportability.")
        order = np.arange(len(lengths))
    else:
        order = np.argsort(-lengths, kind="stable")
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    if len(lengths) != batch:
        raise RuntimeError(f"Expected `len(lengths)` to be equal to batch_size, but got {len(lengths)} "
                           f"(batch_size={batch})")
    if np.any(lengths <= 0):
        raise RuntimeError("Length of all samples has to be greater than 0, but found an element in 'lengths' that is "
                           "<= 0")
    if np.any(lengths > steps):
        raise RuntimeError(f"pack_padded_sequence: lengths {lengths.tolist()} exceed the input's {steps} time steps")
    sorted_lengths = lengths[order]
    batch_sizes = (sorted_lengths[None, :] > np.arange(sorted_lengths[0])[:, None]).sum(1)
    # row of (step t, sorted position j) in the flattened input: t * B + order[j], or order[j] * T + t
    t, j = np.nonzero(np.arange(sorted_lengths[0])[:, None] < sorted_lengths[None, :])
    index = order[j] * steps + t if batch_first else t * batch + order[j]
    data = input.reshape(steps * batch, *input.shape[2:]).index_select(
        0, flame.tensor(index, dtype=flame.int64, device=input.device))
    sorted_indices = None if enforce_sorted else flame.tensor(order, dtype=flame.int64, device=input.device)
    return PackedSequence(data, flame.tensor(batch_sizes.astype(np.int64), device="cpu"), sorted_indices)


def pad_packed_sequence(sequence, batch_first=False, padding_value=0.0, total_length=None):
    """Undo pack_padded_sequence: (padded (T, B, *) or (B, T, *), lengths (int64, cpu)), in the batch order given to
    the packing; T = total_length when given (at least the longest length)."""
    batch_sizes = _lengths(sequence.batch_sizes)
    steps = len(batch_sizes)
    if total_length is not None:
        if total_length < steps:
            raise ValueError(f"Expected total_length to be at least the length of the longest sequence in input, but "
                             f"got total_length={total_length} and max sequence length being {steps}")
        steps = total_length
    batch = int(batch_sizes[0])
    sorted_lengths = (batch_sizes[None, :] > np.arange(batch)[:, None]).sum(1)
    order = np.arange(batch) if sequence.sorted_indices is None else _lengths(sequence.sorted_indices)
    lengths = np.empty(batch, dtype=np.int64)
    lengths[order] = sorted_lengths
    # data holds step t of sorted position j at row offsets[t] + j
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)[:-1]])
    step = np.arange(steps)[:, None]
    rows = offsets[np.minimum(step, len(batch_sizes) - 1)] + np.argsort(order)
    index = np.where(step < lengths, rows, sequence.data.shape[0])
    return _gather(sequence.data, index, padding_value, batch_first), flame.tensor(lengths, device="cpu")


def pack_sequence(sequences, enforce_sorted=True):
    """Pack a list of sequences (L_i, *) (enforce_sorted: given by decreasing length)."""
    return pack_padded_sequence(pad_sequence(sequences), [s.shape[0] for s in sequences],
                                enforce_sorted=enforce_sorted)


def unpack_sequence(packed_sequences):
    """The list of sequences (L_i, *) a PackedSequence holds, in the order they were packed from."""
    padded, lengths = pad_packed_sequence(packed_sequences, batch_first=True)
    return unpad_sequence(padded, lengths, batch_first=True)
