"""Batches of one bucket, shuffled per (seed, epoch), drop-last per bucket, exact resume."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from make_images import write_caption

from flame_models.data import (
    BucketBatchSampler,
    BucketLoader,
    DataError,
    DatasetConfig,
    ImageDataset,
    LatentCache,
    TextEmbeddingCache,
    TrainingDataset,
)


def buckets_from(sizes):
    out, start = {}, 0
    for k, n in enumerate(sizes):
        out[f"b{k}"] = list(range(start, start + n))
        start += n
    return out


@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5), bs=st.integers(1, 4), seed=st.integers(0, 99))
def test_epoch_batches(sizes, bs, seed):
    b = buckets_from(sizes)
    if sum(n // bs for n in sizes) == 0:
        with pytest.raises(DataError, match=f"no bucket holds batch_size {bs} samples"):
            BucketBatchSampler(b, bs, seed=seed)
        return
    s = BucketBatchSampler(b, bs, seed=seed)
    owner = {i: k for k, v in b.items() for i in v}
    for epoch in (0, 1):
        batches = s.batches(epoch)
        assert len(batches) == s.batches_per_epoch == sum(n // bs for n in sizes)
        flat = [i for x in batches for i in x]
        assert len(flat) == len(set(flat))                                 # each sample at most once
        for x in batches:
            assert len(x) == bs and len({owner[i] for i in x}) == 1       # full, and of one bucket
        for k, v in b.items():                                             # drop-last per bucket
            assert sum(owner[i] == k for i in flat) == len(v) // bs * bs
        assert batches == BucketBatchSampler(b, bs, seed=seed).batches(epoch)
    assert set(s.unused) == {k for k, n in zip(b, sizes) if n < bs}


def test_order_changes_with_epoch_and_seed_and_not_without_shuffle():
    b = buckets_from([6, 5, 7])
    s = BucketBatchSampler(b, 2, seed=0)
    assert s.batches(0) != s.batches(1) and s.batches(0) != BucketBatchSampler(b, 2, seed=1).batches(0)
    plain = BucketBatchSampler(b, 2, shuffle=False)
    assert plain.batches(0) == plain.batches(3) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [11, 12], [13, 14],
                                                    [15, 16]]


@given(k=st.integers(0, 25), m=st.integers(1, 12), bs=st.integers(1, 3), seed=st.integers(0, 50))
def test_exact_resume(k, m, bs, seed):
    b = buckets_from([5, 3, 8])
    ref = BucketBatchSampler(b, bs, seed=seed)
    stream = [ref.next_batch() for _ in range(k + m)]
    first = BucketBatchSampler(b, bs, seed=seed)
    for _ in range(k):
        first.next_batch()
    state = dict(first.state_dict())
    resumed = BucketBatchSampler(b, bs, seed=seed)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(m)] == stream[k:]
    assert state["epoch"] == stream[k - 1][0] if k else state["epoch"] == 0


def test_resume_on_other_data_is_an_error():
    s = BucketBatchSampler(buckets_from([4, 4]), 2, seed=1)
    s.next_batch()
    with pytest.raises(DataError, match="other data or settings"):
        BucketBatchSampler(buckets_from([4, 5]), 2, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="other data or settings"):
        BucketBatchSampler(buckets_from([4, 4]), 2, seed=2).load_state_dict(s.state_dict())
    legacy = BucketBatchSampler(buckets_from([4, 4]), 2, seed=1)
    legacy.load_state_dict({"epoch": 3, "index": 1})                      # today's Loader state: accepted
    assert legacy.next_batch()[0] == 3


def test_epochs_needed():
    s = BucketBatchSampler(buckets_from([4, 3]), 2)                      # 3 batches per epoch
    assert [s.epochs_needed(n) for n in (1, 3, 4, 6, 7)] == [1, 1, 2, 2, 3]
    epochs = {s.next_batch()[0] for _ in range(7)}
    assert epochs == set(range(s.epochs_needed(7)))


def test_loader_resumes_exactly_with_captions(folder, tmp_path):
    cfg = DatasetConfig(folder_path=folder, resolution=[64, 128], caption_dropout_rate=0.3, shuffle_tokens=True,
                        num_repeats=2)
    ds = ImageDataset([cfg], seed=4, progress=False)
    lat, txt = LatentCache("v"), TextEmbeddingCache(None, "t")
    lat.fill(ds.latent_specs(), lambda x: x[:, :, ::8, ::8], progress=False)
    loader = BucketLoader(TrainingDataset(ds, lat, txt), batch_size=2, seed=4)
    n = 30
    txt.fill(ds.prompts(range(loader.sampler.epochs_needed(n))),
             lambda p: {"e": np.array([[len(x), sum(map(ord, x))] for x in p], np.float32)}, progress=False)
    full = [loader.next_batch() for _ in range(n)]
    again = BucketLoader(TrainingDataset(ds, lat, txt), batch_size=2, seed=4)
    for _ in range(11):
        again.next_batch()
    state = again.state_dict()
    resumed = BucketLoader(TrainingDataset(ds, lat, txt), batch_size=2, seed=4)
    resumed.load_state_dict(state)
    for want in full[11:]:
        got = resumed.next_batch()
        assert got["captions"] == want["captions"] and got["epoch"] == want["epoch"]
        for k in ("latents", "e", "indices", "original_size", "crop_coords", "target_size"):
            np.testing.assert_array_equal(got[k], want[k])
    b = full[0]
    assert b["latents"].shape[0] == 2 and b["target_size"].shape == (2, 2)
    assert (b["target_size"] // 8 == np.array(b["latents"].shape[2:])).all()
    write_caption(f"{folder}/img0.png", "an edited caption")
    edited = ImageDataset([cfg], seed=4, progress=False)
    with pytest.raises(DataError, match="other images, captions or dataset settings"):
        BucketLoader(TrainingDataset(edited, lat, txt), batch_size=2, seed=4).load_state_dict(state)
