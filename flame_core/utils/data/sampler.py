"""Samplers (PyTorch's names): Sampler, SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler,
BatchSampler (DistributedSampler: distributed.py).

Random samplers draw from a flame_core Generator: the same seed gives the same order. Without one they seed a
private generator from flame_core's default cpu generator at each epoch (WeightedRandomSampler draws from that
default generator itself, as torch.multinomial does), so `flame_core.manual_seed` makes the order reproducible too.
FLAME's random streams are not PyTorch's: the same seed gives other indices, from the same distributions.
"""
from ...dtypes import float64
from ...random import Generator, default_generator


class Sampler:
    """Iterates over dataset indices (or, for a batch sampler, lists of them)."""

    def __init__(self, data_source=None):
        pass

    def __iter__(self):
        raise NotImplementedError


class SequentialSampler(Sampler):
    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


def _epoch_generator(generator):
    """The generator to draw an epoch from: the given one, or a fresh one seeded from the default generator."""
    if generator is not None:
        return generator
    seed = int(default_generator("cpu")._integers(0, 2 ** 62, ()))
    return Generator("cpu").manual_seed(seed)


def _permutation(n, gen):
    from ...ops.creation import randperm
    return randperm(n, generator=gen).tolist()


class RandomSampler(Sampler):
    """A random permutation of the indices each epoch (`replacement=True`: `num_samples` independent draws)."""

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={replacement}")
        self.data_source, self.replacement, self._num_samples, self.generator = \
            data_source, replacement, num_samples, generator
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples="
                             f"{self.num_samples}")

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        n = len(self.data_source)
        gen = _epoch_generator(self.generator)
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield from gen._integers(0, n, (32,)).tolist()
            yield from gen._integers(0, n, (self.num_samples % 32,)).tolist()
            return
        for _ in range(self.num_samples // n):
            yield from _permutation(n, gen)
        yield from _permutation(n, gen)[:self.num_samples % n]

    def __len__(self):
        return self.num_samples


class SubsetRandomSampler(Sampler):
    """The given indices in a random order each epoch."""

    def __init__(self, indices, generator=None):
        self.indices, self.generator = indices, generator

    def __iter__(self):
        for i in _permutation(len(self.indices), _epoch_generator(self.generator)):
            yield self.indices[i]

    def __len__(self):
        return len(self.indices)


class WeightedRandomSampler(Sampler):
    """`num_samples` indices in [0, len(weights)), index i drawn with probability weights[i] / sum(weights) (weights
    need not sum to 1); `replacement=False`: no index twice in an epoch (then num_samples <= the non-zero weights)."""

    def __init__(self, weights, num_samples, replacement=True, generator=None):
        from ...ops.creation import as_tensor
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples={num_samples}")
        if not isinstance(replacement, bool):
            raise ValueError(f"replacement should be a boolean value, but got replacement={replacement}")
        self.weights = as_tensor(weights, dtype=float64, device="cpu")
        if self.weights.ndim != 1:
            raise ValueError(f"weights should be a 1d sequence but given weights have shape "
                             f"{tuple(self.weights.shape)}")
        self.num_samples, self.replacement, self.generator = num_samples, replacement, generator

    def __iter__(self):
        from ...ops.sampling import multinomial
        yield from multinomial(self.weights, self.num_samples, self.replacement, generator=self.generator).tolist()

    def __len__(self):
        return self.num_samples


class BatchSampler(Sampler):
    """Groups the indices of `sampler` into lists of `batch_size` (the last one shorter unless drop_last)."""

    def __init__(self, sampler, batch_size, drop_last):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        batch = []
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
