"""Datasets (PyTorch's torch.utils.data names): Dataset, IterableDataset, TensorDataset, StackDataset, Subset,
ConcatDataset, ChainDataset and random_split."""
import bisect
import itertools
import math
import warnings

from ...errors import ShapeError
from ...tensor import Tensor


class Dataset:
    """A map-style dataset: `__getitem__(index)` and, for samplers and len(DataLoader), `__len__`."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")

    def __add__(self, other):
        return ConcatDataset([self, other])


class IterableDataset(Dataset):
    """A stream of samples: `__iter__`. With worker processes each worker iterates its own copy; split the stream
    with `get_worker_info()` (id, num_workers) inside `__iter__` so that samples are not repeated."""

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def __add__(self, other):
        return ChainDataset([self, other])


class TensorDataset(Dataset):
    """Sample i is `tuple(t[i] for t in tensors)`; every tensor has the same size in dim 0."""

    def __init__(self, *tensors):
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"TensorDataset: argument {i} is a {type(t).__name__}, not a Tensor")
            if t.ndim == 0 or t.shape[0] != tensors[0].shape[0]:
                raise ShapeError(f"TensorDataset: size mismatch between tensors: tensor 0 has shape "
                                 f"{tuple(tensors[0].shape)}, tensor {i} has shape {tuple(t.shape)} (dim 0 must agree)")
        self.tensors = tensors

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]


class StackDataset(Dataset):
    """Several datasets of one length side by side: `StackDataset(a, b)[i] == (a[i], b[i])`,
    `StackDataset(x=a, y=b)[i] == {"x": a[i], "y": b[i]}`."""

    def __init__(self, *args, **kwargs):
        if args and kwargs:
            raise ValueError("Supported either ``tuple``- (via ``args``) or ``dict``- (via ``kwargs``) like "
                             "input/output, but both types are given.")
        if not args and not kwargs:
            raise ValueError("At least one dataset should be passed")
        self.datasets = args or kwargs
        parts = args or tuple(kwargs.values())
        self._length = len(parts[0])
        if any(len(d) != self._length for d in parts):
            raise ValueError("Size mismatch between datasets")

    def __getitem__(self, index):
        if isinstance(self.datasets, dict):
            return {k: d[index] for k, d in self.datasets.items()}
        return tuple(d[index] for d in self.datasets)

    def __getitems__(self, indices):
        """The samples at `indices`, each part fetched with its dataset's own `__getitems__` where it has one."""
        named = self.datasets.items() if isinstance(self.datasets, dict) else enumerate(self.datasets)
        columns = {}
        for key, d in named:
            getitems = getattr(d, "__getitems__", None)
            items = getitems(indices) if callable(getitems) else [d[i] for i in indices]
            if len(items) != len(indices):
                raise ValueError(f"Nested dataset's output size mismatch. Expected {len(indices)}, got {len(items)}")
            columns[key] = items
        rows = zip(*columns.values())
        if isinstance(self.datasets, dict):
            return [dict(zip(columns, row)) for row in rows]
        return list(rows)

    def __len__(self):
        return self._length


class Subset(Dataset):
    """The samples of `dataset` at `indices`, in that order."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __getitem__(self, idx):
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __getitems__(self, indices):
        if callable(getattr(self.dataset, "__getitems__", None)):
            return self.dataset.__getitems__([self.indices[i] for i in indices])
        return [self.dataset[self.indices[i]] for i in indices]

    def __len__(self):
        return len(self.indices)


class ConcatDataset(Dataset):
    """The samples of several map-style datasets one after the other."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("ConcatDataset: datasets should not be an empty iterable")
        for d in self.datasets:
            if isinstance(d, IterableDataset):
                raise TypeError("ConcatDataset does not support IterableDataset")
        self.cumulative_sizes = list(itertools.accumulate(len(d) for d in self.datasets))

    def __len__(self):
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx):
        if idx < 0:
            if -idx > len(self):
                raise ValueError(f"ConcatDataset: index {idx} out of range for length {len(self)}")
            idx = len(self) + idx
        d = bisect.bisect_right(self.cumulative_sizes, idx)
        if d == len(self.datasets):
            raise IndexError(f"ConcatDataset: index {idx} out of range for length {len(self)}")
        start = self.cumulative_sizes[d - 1] if d else 0
        return self.datasets[d][idx - start]


class ChainDataset(IterableDataset):
    """Several IterableDatasets one after the other, chained as they are iterated (`a + b` for IterableDatasets).
    In DataLoader workers each worker iterates its own copy, so each part splits itself with get_worker_info()."""

    def __init__(self, datasets):
        self.datasets = datasets

    def _parts(self):
        for d in self.datasets:
            if not isinstance(d, IterableDataset):
                raise AssertionError(f"ChainDataset only supports IterableDataset, got a {type(d).__name__}")
            yield d

    def __iter__(self):
        for d in self._parts():
            yield from d

    def __len__(self):
        return sum(len(d) for d in self._parts())


def random_split(dataset, lengths, generator=None):
    """Split `dataset` into non-overlapping Subsets of the given lengths, or fractions summing to 1 (floors, then the
    remainder handed out one by one from the first split on), from one random permutation drawn from `generator`
    (flame_core's default cpu generator when None)."""
    from ...ops.creation import randperm
    from ...random import default_generator
    n = len(dataset)
    lengths = list(lengths)
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        sizes = []
        for i, frac in enumerate(lengths):
            if frac < 0 or frac > 1:
                raise ValueError(f"Fraction at index {i} is not between 0 and 1")
            sizes.append(math.floor(n * frac))
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
        for i, size in enumerate(sizes):
            if size == 0:
                warnings.warn(f"Length of split at index {i} is 0. This might result in an empty dataset.",
                              UserWarning, stacklevel=2)
        lengths = sizes
    if any(int(x) != x or x < 0 for x in lengths):
        raise ValueError(f"random_split: lengths must be non-negative integers or fractions summing to 1, got "
                         f"{lengths}")
    if sum(lengths) != n:
        raise ValueError(f"Sum of input lengths ({sum(lengths)}) does not equal the length of the input dataset "
                         f"({n})!")
    gen = generator if generator is not None else default_generator("cpu")
    indices = randperm(n, generator=gen).tolist()
    out, offset = [], 0
    for size in lengths:
        out.append(Subset(dataset, indices[offset:offset + int(size)]))
        offset += int(size)
    return out
