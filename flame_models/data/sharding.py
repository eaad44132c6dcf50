"""Each rank's share of the data: rank r of N, with batch_size B, gets rows r·B .. (r+1)·B of the batch that ONE
process with batch_size N·B would draw at that step -- the same samples in the same per-epoch order, and for aspect
buckets the same bucket on every rank at every step. So N ranks train on exactly what one process with an N× batch
would, and the position in the data is that of the global batch:

    loader = shard_loader(SampleLoader(dataset, B, seed=s), rank, world)   # or a BucketLoader
    batch = loader.next_batch()          # B samples: this rank's slice; only those are read from disk
    state = loader.state_dict()          # the global position + world_size and global_batch

A checkpoint's position is therefore the same whichever world size wrote it, as long as the global batch N·B is the
same: 2 ranks × 2 resume as 1 × 4 or 4 × 1 (a single process reads the same state with its plain loader). A
different global batch is a different run (the trainer refuses it, as it refuses a changed batch_size).
"""
import numpy as np

from .errors import DataError
from .sampler import BucketBatchSampler
from .samples import SampleLoader


class ShardedLoader:
    """A rank's slice of a `SampleLoader`'s global batches (see the module docstring)."""

    def __init__(self, loader, rank, world_size):
        self.rank, self.world_size, self.batch_size = int(rank), int(world_size), loader.batch_size
        self.global_batch = self.batch_size * self.world_size
        if len(loader.dataset) < self.global_batch:
            raise DataError(f"the dataset has {len(loader.dataset)} samples, fewer than one global batch: "
                               f"batch_size {self.batch_size} x {self.world_size} ranks = {self.global_batch}")
        self.dataset = loader.dataset
        self.glob = SampleLoader(loader.dataset, self.global_batch, shuffle=loader.shuffle, seed=loader.seed)

    def next_batch(self):
        idx = self.glob.next_indices()
        return self.glob.collate(idx[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])

    def state_dict(self):
        return {**self.glob.state_dict(), "world_size": self.world_size, "global_batch": self.global_batch}

    def load_state_dict(self, state):
        _check_global_batch(state, self.global_batch)
        self.glob.load_state_dict(state)


class ShardedBucketLoader:
    """A rank's slice of a flame_models.data.BucketLoader's global batches: the global sampler draws batches of
    N·B from one bucket; this rank reads and collates its B."""

    def __init__(self, loader, rank, world_size):
        s = loader.sampler
        self.rank, self.world_size, self.batch_size = int(rank), int(world_size), s.batch_size
        self.global_batch = self.batch_size * self.world_size
        self.dataset = loader.dataset
        try:
            self.sampler = BucketBatchSampler(loader.dataset.buckets(), self.global_batch, s.shuffle, s.seed)
        except DataError as e:
            raise DataError(f"{e} (the global batch is batch_size {self.batch_size} x {self.world_size} ranks)") \
                from None

    def next_batch(self):
        epoch, idx = self.sampler.next_batch()
        mine = idx[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        batch = self.dataset.collate([self.dataset.get(i, epoch) for i in mine])
        batch["indices"] = np.asarray(mine, dtype=np.int64)
        batch["epoch"] = epoch
        return batch

    def state_dict(self):
        return {**self.sampler.state_dict(), "data": self.dataset.dataset.fingerprint(),
                "world_size": self.world_size, "global_batch": self.global_batch}

    def load_state_dict(self, state):
        data = state.get("data")
        if data is not None and data != self.dataset.dataset.fingerprint():
            raise DataError("the data position in this checkpoint belongs to other images, captions or dataset "
                            "settings: exact resume is impossible; start fresh or restore the data")
        _check_global_batch(state, self.global_batch)
        self.sampler.load_state_dict(state)


def _check_global_batch(state, mine):
    theirs = state.get("global_batch")
    if theirs is not None and int(theirs) != mine:
        raise DataError(f"the data position in this checkpoint is one of global batches of {theirs} samples "
                        f"(batch_size x world size), this run's are {mine}: keep batch_size x ranks the same to "
                        f"resume")


def shard_loader(loader, rank, world_size):
    """The rank's sharded view of a SampleLoader or BucketLoader (the loader itself when world_size is 1 or it is
    sharded already)."""
    if world_size == 1 or isinstance(loader, (ShardedLoader, ShardedBucketLoader)):
        return loader
    if hasattr(loader, "map_loaders"):  # the regularisation mix: each of its streams sharded
        return loader.map_loaders(lambda part: shard_loader(part, rank, world_size))
    if isinstance(loader, SampleLoader):
        return ShardedLoader(loader, rank, world_size)
    if hasattr(loader, "sampler") and hasattr(loader, "dataset"):
        return ShardedBucketLoader(loader, rank, world_size)
    raise TypeError(f"cannot shard a {type(loader).__name__}: expected a SampleLoader or a BucketLoader")
