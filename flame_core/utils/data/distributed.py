"""DistributedSampler (PyTorch's torch.utils.data.DistributedSampler): each of `num_replicas` processes reads its
own share of a map-style dataset.

The index list (a permutation drawn from a FLAME Generator seeded with seed + epoch, or 0 .. n-1 unshuffled) is made
a multiple of num_replicas -- padded by repeating it from its start, or cut short with drop_last -- and rank r takes
every num_replicas-th index from position r. Unshuffled, the ranks' lists are PyTorch's; shuffled, every rank draws
the same permutation (the same seed on every rank), but not PyTorch's (FLAME's random streams are its own).
"""
import math

from ...random import Generator
from .sampler import Sampler


def _from_default_group(value, read):
    """`value`, or read(flame_core.distributed) when it is None (the default process group must be initialised)."""
    if value is not None:
        return value
    from ... import distributed
    if not distributed.is_initialized():
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group (flame_core.distributed), or pass num_replicas and rank.")
    return read(distributed)


class DistributedSampler(Sampler):
    """This rank's indices of `dataset`; call `set_epoch(epoch)` before each epoch so that shuffled epochs differ."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        num_replicas = _from_default_group(num_replicas, lambda d: d.get_world_size())
        rank = _from_default_group(rank, lambda d: d.get_rank())
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.epoch, self.shuffle, self.seed, self.drop_last = 0, shuffle, seed, drop_last
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        from ...ops.creation import randperm
        n = len(self.dataset)
        if self.shuffle:
            indices = randperm(n, generator=Generator("cpu").manual_seed(self.seed + self.epoch)).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[:self.total_size]
        else:  # pad by repeating the list from its start (several times over when it is shorter than the padding)
            pad = self.total_size - n
            indices += (indices * math.ceil(pad / n))[:pad] if pad else []
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        """The epoch whose permutation the next iteration draws (seed + epoch)."""
        self.epoch = epoch
