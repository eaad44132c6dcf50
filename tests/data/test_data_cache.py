"""Latent and text-embedding caches: exactly what changed is encoded again; interrupted fills resume."""
import os
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from make_images import write_caption, write_image

from flame_models.data import (
    BucketLoader,
    DataError,
    DatasetConfig,
    ImageDataset,
    LatentCache,
    TextEmbeddingCache,
    TrainingDataset,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CountingVAE:
    """encode_images stand-in: 8x8 average pooling to 4 channels; records every image it sees."""

    def __init__(self, dtype=np.float32, fail_on_call=None):
        self.calls, self.images, self.dtype, self.fail_on_call = 0, [], dtype, fail_on_call

    def __call__(self, x):
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            raise KeyboardInterrupt
        assert x.dtype == np.float32 and x.ndim == 4 and x.shape[1] == 3 and -1 <= x.min() and x.max() <= 1
        self.images += [x[i].copy() for i in range(len(x))]
        b, c, h, w = x.shape
        pooled = x.reshape(b, c, h // 8, 8, w // 8, 8).mean((3, 5))
        return np.concatenate([pooled, pooled[:, :1] * 2], axis=1).astype(self.dtype)


class CountingTE:
    def __init__(self):
        self.prompts = []

    def __call__(self, prompts):
        self.prompts += prompts
        codes = np.array([[sum(map(ord, p)) % 97, len(p)] for p in prompts], np.float32)
        return {"prompt_embeds": np.repeat(codes[:, None, :], 6, axis=1), "pooled_prompt_embeds": codes * 2}


def make(folder, **kw):
    kw = {"resolution": [64, 128], "cache_latents_to_disk": True, **kw}
    return ImageDataset([DatasetConfig(folder_path=folder, **kw)], progress=False)


def test_latents_are_encoded_once_and_only_what_changed(folder):
    vae = CountingVAE()
    ds = make(folder)
    specs = ds.latent_specs()
    cache = LatentCache("vae-A|bf16")
    assert cache.fill(specs, vae, batch_size=3, progress=False) == 10 and len(vae.images) == 10
    lat_dir = os.path.join(folder, ".flame_cache", "latents")
    assert len(os.listdir(lat_dir)) == 10
    i = next(i for i in range(len(ds)) if ds.samples[i].bucket.width == 128)
    assert cache.load(ds.latent_spec(i)).shape == (4, ds.samples[i].bucket.height // 8, 16)
    calls = vae.calls
    assert LatentCache("vae-A|bf16").fill(make(folder).latent_specs(), vae, progress=False) == 0
    assert vae.calls == calls                                  # nothing encoded, the encoder not even called

    write_image(os.path.join(folder, "img2.png"), 256, 256, seed=99)       # new bytes, same size
    before = len(vae.images)
    ds2 = make(folder)
    assert LatentCache("vae-A|bf16").fill(ds2.latent_specs(), vae, progress=False) == 2   # img2 at 64 and 128
    redone = [s for s in ds2.latent_specs() if s.path.endswith("img2.png")]
    assert sorted(x.shape for x in vae.images[before:]) == sorted((3, s.bucket.height, s.bucket.width) for s in redone)

    ds3 = make(folder, resolution=[64, 128, 192])
    assert LatentCache("vae-A|bf16").fill(ds3.latent_specs(), vae, progress=False) == 5   # only the 192 buckets
    assert LatentCache("vae-A|bf16").fill(make(folder, resolution=64).latent_specs(), vae, progress=False) == 0

    assert LatentCache("vae-B|bf16").fill(ds2.latent_specs(), vae, progress=False) == 10  # another encoder: all
    assert LatentCache("vae-A|bf16").fill(ds2.latent_specs(), vae, progress=False) == 0   # old files kept
    # stale files stay until pruned: the old img2 (2), the 192 ones (5), encoder B's (10)
    assert len(os.listdir(lat_dir)) == 10 + 2 + 5 + 10
    assert LatentCache("vae-A|bf16").prune(ds2.latent_specs()) == 17 and len(os.listdir(lat_dir)) == 10
    assert LatentCache("vae-A|bf16").fill(ds2.latent_specs(), vae, progress=False) == 0


def test_the_same_image_in_two_cache_folders_is_cached_in_each(tmp_path, folder):
    """An image whose bytes another dataset also holds (a held-out copy, a second folder) has the same cache key, but
    its entry lives in its own dataset's cache folder (or in memory): each folder gets it. Deduplicating by key alone
    left the second one missing (a validation folder beside a disk-cached training folder)."""
    import shutil
    twin = tmp_path / "twin"
    shutil.copytree(folder, twin)
    on_disk = make(folder)                                   # .flame_cache in the folder
    in_memory = make(str(twin), cache_latents_to_disk=False)  # the same bytes, cached in host memory
    specs = on_disk.latent_specs() + in_memory.latent_specs()
    cache, vae = LatentCache("vae-A|bf16"), CountingVAE()
    assert cache.missing(specs) == specs[:len(on_disk.latent_specs())] + specs[len(on_disk.latent_specs()):]
    cache.fill(specs, vae, progress=False)
    assert cache.missing(specs) == []
    for s in specs:
        assert cache.load(s).shape[0] == 4


def test_cached_latents_keep_values_and_dtype(tmp_path, folder):
    vae = CountingVAE(dtype=ml_dtypes.bfloat16)
    for store in (True, False):                                # on disk, and in memory
        ds = make(folder, cache_latents_to_disk=store, resolution=64)
        cache = LatentCache(f"vae|{store}")
        cache.fill(ds.latent_specs(), vae, batch_size=2, progress=False)
        for i in range(len(ds)):
            got = cache.load(ds.latent_spec(i))
            want = CountingVAE(dtype=ml_dtypes.bfloat16)(ds.latent_spec(i).pixels()[None])[0]
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert not os.path.isdir(os.path.join(folder, ".flame_cache", "latents")) or len(
        os.listdir(os.path.join(folder, ".flame_cache", "latents"))) == 5


def test_text_cache_encodes_each_caption_once_and_changed_captions_only(tmp_path, folder):
    te = CountingTE()
    ds = make(folder, resolution=64)
    texts = TextEmbeddingCache(str(tmp_path / "text"), "t5|clip|bf16")
    prompts = ds.prompts(range(3)) + ["a sample prompt"]
    assert texts.fill(prompts + prompts[:2], te, batch_size=4, progress=False) == 6 and len(te.prompts) == 6
    emb = texts.load("a sample prompt")
    assert set(emb) == {"prompt_embeds", "pooled_prompt_embeds"} and emb["prompt_embeds"].shape == (6, 2)
    write_caption(os.path.join(folder, "img3.png"), "a changed caption")
    ds2 = make(folder, resolution=64)
    again = TextEmbeddingCache(str(tmp_path / "text"), "t5|clip|bf16")
    assert again.fill(ds2.prompts(range(3)) + ["a sample prompt"], te, progress=False) == 1
    assert te.prompts[-1] == "a changed caption"
    assert TextEmbeddingCache(str(tmp_path / "text"), "t5|clip|fp8").fill(["a sample prompt"], te, progress=False) == 1


def test_caption_dropout_and_shuffling_train_from_the_cache(tmp_path, folder):
    te = CountingTE()
    ds = ImageDataset([DatasetConfig(folder_path=folder, resolution=64, caption_dropout_rate=0.5,
                                     shuffle_tokens=True, keep_tokens=1)], seed=5, progress=False)
    lat, texts = LatentCache("vae"), TextEmbeddingCache(None, "te")
    train = TrainingDataset(ds, lat, texts)
    loader = BucketLoader(train, batch_size=1, seed=5)
    epochs = loader.sampler.epochs_needed(40)
    assert epochs == 8
    with pytest.raises(DataError, match="5 latent and .* text-embedding cache entries are missing"):
        train.check(range(epochs))
    lat.fill(ds.latent_specs(), CountingVAE(), progress=False)
    texts.fill(ds.prompts(range(epochs)), te, progress=False)
    assert "" in te.prompts                                     # the dropout caption (no trigger word)
    train.check(range(epochs))
    dropped = 0
    for _ in range(40):
        b = loader.next_batch()
        want = CountingTE()(b["captions"])
        np.testing.assert_array_equal(b["prompt_embeds"], want["prompt_embeds"])
        dropped += b["captions"] == [""]
    assert 8 <= dropped <= 32 and loader.sampler.epoch == 7


def test_interrupted_fill_leaves_whole_files_and_resumes(folder):
    ds = make(folder, resolution=64)
    vae = CountingVAE(fail_on_call=3)
    with pytest.raises(KeyboardInterrupt):
        LatentCache("vae").fill(ds.latent_specs(), vae, batch_size=1, progress=False)
    lat_dir = os.path.join(folder, ".flame_cache", "latents")
    assert sorted(os.listdir(lat_dir)) == sorted(n for n in os.listdir(lat_dir) if n.endswith(".safetensors"))
    assert len(os.listdir(lat_dir)) == 2
    rest = CountingVAE()
    assert LatentCache("vae").fill(ds.latent_specs(), rest, batch_size=2, progress=False) == 3
    assert len(rest.images) == 3 and len(os.listdir(lat_dir)) == 5

    victim = os.path.join(lat_dir, sorted(os.listdir(lat_dir))[0])
    with open(victim, "r+b") as f:                              # a damaged file is encoded again, not trusted
        f.truncate(20)
    assert LatentCache("vae").fill(ds.latent_specs(), CountingVAE(), progress=False) == 1


CHILD = r"""
import sys, time, numpy as np
sys.path.insert(0, {repo!r})
from flame_models.data import DatasetConfig, ImageDataset, LatentCache
ds = ImageDataset([DatasetConfig(folder_path={folder!r}, resolution=64, cache_latents_to_disk=True)], progress=False)
def slow(x):
    time.sleep(0.3)
    return np.repeat(x[:, :, ::8, ::8], 20000, axis=1)   # ~ 15 MB per latent: writes take a while
LatentCache("vae").fill(ds.latent_specs(), slow, batch_size=1, progress=False)
"""


def test_killed_fill_leaves_no_partial_file(folder):
    lat_dir = os.path.join(folder, ".flame_cache", "latents")
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO, folder=folder)],
                             env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while time.time() < deadline and (not os.path.isdir(lat_dir) or
                                      len([n for n in os.listdir(lat_dir) if n.endswith(".safetensors")]) < 2):
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    done = [n for n in os.listdir(lat_dir) if n.endswith(".safetensors")]
    assert 2 <= len(done) < 5
    from flame_core import io
    for n in done:                                              # every file there is whole
        with io.safe_open(os.path.join(lat_dir, n)) as f:
            assert f.get_array("latents").shape == (60000, 8, 8)
    ds = make(folder, resolution=64)
    slow_shape = lambda x: np.repeat(x[:, :, ::8, ::8], 20000, axis=1)  # noqa: E731
    cache = LatentCache("vae")
    assert cache.fill(ds.latent_specs(), slow_shape, progress=False) == 5 - len(done)
    assert cache.prune(ds.latent_specs()) == len(os.listdir(lat_dir)) - 5    # only leftover temp files go


def test_encoder_outputs_are_checked(tmp_path, folder):
    ds = make(folder, resolution=64)
    with pytest.raises(DataError, match=r"encode_images returned shape \(4, 8, 8\) for input \(2, 3, 64, 64\)"):
        LatentCache("v").fill(ds.latent_specs(), lambda x: np.zeros((4, 8, 8)), batch_size=2, progress=False)
    with pytest.raises(DataError, match=r"encode_prompts returned 'e' of shape \(1, 4\) for 2 prompts"):
        TextEmbeddingCache(None, "t").fill(["a", "b"], lambda p: {"e": np.zeros((1, 4))}, progress=False)
    with pytest.raises(DataError, match="encoder_id must be a non-empty string"):
        LatentCache("")
    with pytest.raises(DataError, match=r"text embeddings of 'never cached'.*missing"):
        TextEmbeddingCache(str(tmp_path / "t"), "t").load("never cached")
