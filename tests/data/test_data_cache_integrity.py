"""Cache entries carry a checksum: a damaged, non-finite or unchecked entry is encoded again at the next fill and
refused (naming the file) when read; an encoder's NaN / inf output is an error naming the image or caption."""
import os

import numpy as np
import pytest
from test_data_cache import CountingTE, CountingVAE, make

from flame_core import io
from flame_models.data import DataError, LatentCache, TextEmbeddingCache
from flame_models.data.cache import checksum


def _entry(cache, spec):
    return os.path.join(spec.folder, cache.key(spec) + ".safetensors")


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        b = f.read(1)
        f.seek(os.path.getsize(path) - 1)
        f.write(bytes([b[0] ^ 0x55]))


def _rewrite(path, change, keep_checksum=True):
    """Rewrite a cache file with `change(arrays)` applied; its checksum recomputed (a valid file of bad values) or
    dropped (an older FLAME's file)."""
    with io.safe_open(path) as f:
        meta = dict(f.metadata() or {})
        names = f.keys()
        arrays = {k: np.array(f.get_array(k)) for k in names}
    change(arrays)
    meta.pop("sha256", None)
    if keep_checksum:
        meta["sha256"] = checksum(arrays)
    io.save_file(arrays, path, metadata=meta)


@pytest.mark.parametrize("damage", ["flipped byte", "NaN with a valid checksum", "no checksum"])
def test_a_bad_latent_entry_is_refused_when_read_and_encoded_again(folder, damage):
    vae = CountingVAE()
    specs = make(folder).latent_specs()
    cache = LatentCache("vae-A")
    assert cache.fill(specs, vae, progress=False) == len(specs)
    spec = specs[3]
    good = cache.load(spec).copy()
    path = _entry(cache, spec)
    if damage == "flipped byte":
        _flip_last_byte(path)
        why = "do not match their SHA-256"
    elif damage == "NaN with a valid checksum":
        _rewrite(path, lambda a: a["latents"].__setitem__((0, 0, 0), np.nan))
        why = "latents holds NaN or infinite values"
    else:
        _rewrite(path, lambda a: None, keep_checksum=False)
        why = "no checksum"
    with pytest.raises(DataError, match=f"cache file {path}: .*{why}"):
        cache.load(spec)
    assert [s.path for s in cache.missing(specs)] == [spec.path]
    assert cache.fill(specs, vae, progress=False) == 1            # exactly that entry, encoded again
    np.testing.assert_array_equal(cache.load(spec), good)


def test_a_bad_text_entry_is_encoded_again(tmp_path):
    te = CountingTE()
    cache = TextEmbeddingCache(str(tmp_path / "text"), encoder_id="t5")
    assert cache.fill(["a cat", "a dog"], te, progress=False) == 2
    path = os.path.join(str(tmp_path / "text"), cache.key("a dog") + ".safetensors")
    _rewrite(path, lambda a: a["prompt_embeds"].__setitem__((0, 0), np.inf))
    with pytest.raises(DataError, match="text embeddings of 'a dog'.*prompt_embeds holds NaN"):
        cache.load("a dog")
    assert cache.missing(["a cat", "a dog"]) == ["a dog"]
    assert cache.fill(["a cat", "a dog"], te, progress=False) == 1 and te.prompts[-1] == "a dog"
    assert np.isfinite(cache.load("a dog")["prompt_embeds"]).all()


def test_an_encoder_that_returns_nan_is_an_error_naming_the_image_and_nothing_is_cached(folder, tmp_path):
    specs = make(folder).latent_specs()

    def nan_vae(x):
        out = CountingVAE()(x)
        out[-1, 0, 0, 0] = np.nan
        return out
    with pytest.raises(DataError, match=r"latents of .*\.(png|jpg).*: the encoder returned NaN or infinite"):
        LatentCache("vae-nan").fill(specs, nan_vae, batch_size=len(specs), progress=False)
    assert LatentCache("vae-nan").missing(specs)[-1].path == specs[-1].path

    def nan_te(prompts):
        out = CountingTE()(prompts)
        out["pooled_prompt_embeds"][0, 0] = np.nan
        return out
    with pytest.raises(DataError, match="text embeddings of 'x y': the encoder returned NaN or infinite values in "
                                        "'pooled_prompt_embeds'"):
        TextEmbeddingCache(str(tmp_path / "t"), "te").fill(["x y"], nan_te, progress=False)
