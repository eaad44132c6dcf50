"""Data sharding: N ranks with batch B see exactly the batches one process with batch N·B sees (same samples, same
per-epoch order, the same aspect bucket on every rank), across epochs, and a position saved under one world size
resumes under another with the same global batch."""
import numpy as np
import pytest

from flame_models.data import BucketLoader, ConcatDataset
from flame_models.data import DataError as DatasetError
from flame_models.data import SampleLoader as Loader
from flame_models.data.errors import DataError
from flame_models.data.sharding import ShardedBucketLoader, ShardedLoader, shard_loader


class Items:
    """n samples; sample i is {"latents": [i, i]} (so a batch shows which samples it holds)."""

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"latents": np.full(2, i + self.offset, dtype=np.float32)}


def ids(batch):
    return batch["latents"][:, 0].astype(int).tolist()


def ranks(make, world, batch):
    return [shard_loader(make(batch), r, world) for r in range(world)]


@pytest.mark.parametrize("world,batch", [(2, 1), (2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("shuffle", [True, False, [True, False]])
def test_n_ranks_of_b_together_draw_what_one_process_of_n_b_draws(world, batch, shuffle):
    ds = Items(13) if not isinstance(shuffle, list) else ConcatDataset([Items(6), Items(7, offset=6)])
    one = Loader(ds, world * batch, shuffle=shuffle, seed=5)
    shards = ranks(lambda b: Loader(ds, b, shuffle=shuffle, seed=5), world, batch)
    for _ in range(12):  # several epochs (13 samples: ragged tails dropped the same way)
        want = one.next_batch()
        got = [s.next_batch() for s in shards]
        assert sum((ids(g) for g in got), []) == ids(want)
        assert all(len(ids(g)) == batch for g in got)
    assert {(s.glob.epoch, s.glob.index) for s in shards} == {(one.epoch, one.index)}


def test_the_position_is_global_and_resumes_under_another_world_size():
    ds = Items(10)
    two = ranks(lambda b: Loader(ds, b, seed=1), 2, 2)  # 2 ranks x 2 = global batch 4
    for _ in range(5):
        [s.next_batch() for s in two]
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["world_size"] == 2 and state["global_batch"] == 4
    ref = [sum((ids(s.next_batch()) for s in two), []) for _ in range(4)]
    one = Loader(ds, 4, seed=1)  # a single process reads the same state
    one.load_state_dict(state)
    assert [ids(one.next_batch()) for _ in range(4)] == ref
    four = ranks(lambda b: Loader(ds, b, seed=1), 4, 1)  # 4 ranks x 1
    for s in four:
        s.load_state_dict(state)
    assert [sum((ids(s.next_batch()) for s in four), []) for _ in range(4)] == ref
    other = ShardedLoader(Loader(ds, 3, seed=1), 0, 2)
    with pytest.raises(DataError, match="global batches of 4 samples.*this run's are 6"):
        other.load_state_dict(state)


def test_a_dataset_smaller_than_the_global_batch_is_refused():
    with pytest.raises(DatasetError, match=r"fewer than one global batch: batch_size 3 x 2 ranks = 6"):
        ShardedLoader(Loader(Items(5), 3), 0, 2)
    assert shard_loader("anything", 0, 1) == "anything"
    with pytest.raises(TypeError, match="cannot shard a list"):
        shard_loader([], 0, 2)


class BucketItems:
    """A TrainingDataset stand-in: samples in aspect buckets; sample i of bucket k has latents of shape (1, k+1)."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.where, start = {}, 0
        for k, n in enumerate(sizes):
            for i in range(start, start + n):
                self.where[i] = k
            start += n
        self.dataset = self  # BucketLoader reads the fingerprint through .dataset

    def buckets(self):
        out = {}
        for i, k in self.where.items():
            out.setdefault(f"b{k}", []).append(i)
        return out

    def get(self, i, epoch):
        return {"latents": np.full((1, self.where[i] + 1), i, dtype=np.float32), "caption": f"{i}@{epoch}"}

    def collate(self, items):
        return {"latents": np.stack([it["latents"] for it in items]), "captions": [it["caption"] for it in items]}

    def fingerprint(self):
        return f"sizes{self.sizes}"


def test_bucket_batches_n_ranks_match_one_process_and_share_the_bucket():
    ds = BucketItems([9, 5, 12, 3])
    world, b = 2, 2
    one = BucketLoader(ds, batch_size=world * b, shuffle=True, seed=3)
    shards = [shard_loader(BucketLoader(ds, batch_size=b, shuffle=True, seed=3), r, world) for r in range(world)]
    assert all(isinstance(s, ShardedBucketLoader) for s in shards)
    for _ in range(20):  # several epochs
        want = one.next_batch()
        got = [s.next_batch() for s in shards]
        assert {g["latents"].shape[2] for g in got} == {want["latents"].shape[2]}  # one bucket on every rank
        assert sum((g["indices"].tolist() for g in got), []) == want["indices"].tolist()
        assert sum((g["captions"] for g in got), []) == want["captions"]  # the epoch's captions
        assert {g["epoch"] for g in got} == {want["epoch"]}
    state = shards[1].state_dict()
    assert state["global_batch"] == 4 and state["world_size"] == 2
    one2 = BucketLoader(ds, batch_size=4, shuffle=True, seed=3)
    one2.load_state_dict(state)  # a single process with the global batch continues the sharded run
    four = [shard_loader(BucketLoader(ds, batch_size=1, shuffle=True, seed=3), r, 4) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    for _ in range(6):
        want = one.next_batch()
        assert one2.next_batch()["indices"].tolist() == want["indices"].tolist()
        assert sum((s.next_batch()["indices"].tolist() for s in four), []) == want["indices"].tolist()


def test_bucket_sharding_errors_name_the_global_batch():
    ds = BucketItems([3, 3])
    with pytest.raises(DataError, match=r"global batch is batch_size 2 x 2 ranks"):
        shard_loader(BucketLoader(ds, batch_size=2), 0, 2)
    s = shard_loader(BucketLoader(ds, batch_size=1), 0, 2)
    with pytest.raises(DataError, match="other images, captions or dataset settings"):
        s.load_state_dict({"epoch": 0, "index": 0, "data": "another"})
