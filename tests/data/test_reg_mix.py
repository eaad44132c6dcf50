"""Regularisation images (is_reg): drawn in their own micro-batches at train.reg_ratio exactly as reg_mix.py defines
it, each kind through its own epochs, cached like the others, and resumed exactly."""
import os

import numpy as np
import pytest
from make_images import write_caption, write_image

from flame_models.data import DataError, DatasetConfig, ImageDataset, LatentCache, TextEmbeddingCache, TrainingDataset
from flame_models.data.reg_mix import RegMixLoader, is_reg_batch, reg_batches_before
from flame_models.data.sharding import shard_loader


def _folders(tmp_path, n_train=4, n_reg=6):
    out = []
    for name, n in (("train", n_train), ("reg", n_reg)):
        for i in range(n):
            write_caption(write_image(str(tmp_path / name / f"{name}{i}.png"), 64, 64, seed=i + 10 * len(out)),
                          f"{name} picture {i}")
        out.append(str(tmp_path / name))
    return out


def _training_data(tmp_path, **reg_kw):
    train, reg = _folders(tmp_path)
    ds = ImageDataset([DatasetConfig(folder_path=train, resolution=64, bucket_tolerance=32),
                       DatasetConfig(folder_path=reg, resolution=64, bucket_tolerance=32, is_reg=True, **reg_kw)],
                      progress=False)
    latents = LatentCache("enc")
    latents.fill(ds.latent_specs(), lambda px: px[:, :, ::8, ::8], progress=False)
    texts = TextEmbeddingCache(None, "te")
    texts.fill(ds.prompts(range(8)), lambda ps: {"prompt_embeds": np.zeros((len(ps), 2, 4), np.float32)},
               progress=False)
    return ds, TrainingDataset(ds, latents, texts)


@pytest.mark.parametrize("ratio, pattern", [(0.5, "TRTRTRTR"), (1 / 3, "TTRTTRTT"), (0.25, "TTTRTTTR"),
                                            (0.75, "TRRRTRRR")])
def test_the_ratio_places_regularisation_batches_exactly(ratio, pattern):
    assert "".join("R" if is_reg_batch(k, ratio) else "T" for k in range(8)) == pattern
    for n in (0, 1, 7, 100, 1001):
        assert reg_batches_before(n, ratio) == sum(is_reg_batch(k, ratio) for k in range(n))
        assert reg_batches_before(n, ratio) == int(np.floor(n * ratio + 1e-9))
    assert reg_batches_before(10, 0.3) == 3                    # 0.3 is exactly 3/10, not 0.29999...
    with pytest.raises(DataError, match=r"train.reg_ratio: .* in \(0, 1\)"):
        is_reg_batch(0, 1.0)


def test_batches_come_from_one_kind_at_the_ratio_and_resume_exactly(tmp_path):
    ds, data = _training_data(tmp_path)
    loader = RegMixLoader.build(data, batch_size=2, shuffle=True, seed=3, ratio=1 / 3)
    kinds, seen_reg = [], set()
    for k in range(30):
        b = loader.next_batch()
        flags = {ds.is_reg(int(i)) for i in b["indices"]}
        assert len(flags) == 1 and b["is_reg"].tolist() == [flags.pop()] * 2   # one kind per micro-batch
        kinds.append(bool(b["is_reg"][0]))
        if kinds[-1]:
            seen_reg.update(int(i) for i in b["indices"])
        assert all("reg" in c for c in b["captions"]) == kinds[-1]
    assert kinds == [is_reg_batch(k, 1 / 3) for k in range(30)] and sum(kinds) == 10
    assert seen_reg == {i for i in range(len(ds)) if ds.is_reg(i)}               # its own epochs: all reg images
    # exact resume: a loader at the saved position draws the same batches
    state = loader.state_dict()
    ahead = [loader.next_batch()["indices"].tolist() for _ in range(7)]
    again = RegMixLoader.build(data, batch_size=2, shuffle=True, seed=3, ratio=1 / 3)
    again.load_state_dict(state)
    assert [again.next_batch()["indices"].tolist() for _ in range(7)] == ahead
    other = RegMixLoader.build(data, batch_size=2, shuffle=True, seed=3, ratio=0.5)
    with pytest.raises(DataError, match="train.reg_ratio"):
        other.load_state_dict(state)
    # each kind runs through its own epochs: 4 training images in 2 batches, 6 regularisation images in 3
    assert loader.sampler.epochs_needed(30) == max(int(np.ceil(20 / 2)), int(np.ceil(10 / 3)))
    assert loader.sampler.batch_size == 2 and len(loader.sampler.buckets) == 1      # one shape: 64x64


def test_each_rank_shards_both_streams(tmp_path):
    ds, data = _training_data(tmp_path)
    whole = RegMixLoader.build(data, batch_size=2, shuffle=True, seed=0)
    ranks = [shard_loader(RegMixLoader.build(data, batch_size=1, shuffle=True, seed=0), r, 2) for r in (0, 1)]
    for _ in range(6):
        b = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert sum((p["indices"].tolist() for p in parts), []) == b["indices"].tolist()
        assert {bool(p["is_reg"][0]) for p in parts} == {bool(b["is_reg"][0])}
    assert ranks[0].state_dict()["world_size"] == 2


def test_a_kind_without_a_full_batch_is_named(tmp_path):
    ds, data = _training_data(tmp_path)
    with pytest.raises(DataError, match=r"the training images \(is_reg: false\): no bucket holds batch_size 5"):
        RegMixLoader.build(data, batch_size=5, shuffle=True, seed=0)
    _, reg = _folders(tmp_path / "b")
    with pytest.raises(DataError, match="every dataset is is_reg: true"):
        ImageDataset([DatasetConfig(folder_path=reg, resolution=64, is_reg=True)], progress=False)
    assert os.path.isdir(reg)
