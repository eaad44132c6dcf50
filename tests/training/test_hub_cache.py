"""Hugging Face repo ids in a config (ai-toolkit's name_or_path / assistant_lora_path) read from the local Hugging
Face cache: refs/main's snapshot (or the only one), said in a warning; a repo the cache lacks stays an error saying how
to fetch it; an ambiguous or broken cache entry is an error naming it (tiny Flux, cpu)."""
import os
import shutil

import numpy as np
import pytest

from flame_models.checkpoint_io import hub_cache
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_base_loras import _lora


def _cached(root, repo_id, files, revision="0123abcd", ref=True):
    """A cache entry as huggingface_hub writes it: models--org--name/snapshots/<rev>/..., refs/main."""
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for rel, src in files.items():
        dst = snap / rel
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return str(snap)


def test_ai_toolkit_style_repo_ids_read_from_the_cache(tmp_path, tiny_model, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    # the model repo: the tiny diffusers folder as the snapshot's content
    org_repo = root / "models--black-forest-labs--FLUX.1-tiny"
    (org_repo / "snapshots").mkdir(parents=True)
    shutil.copytree(tiny_model, org_repo / "snapshots" / "rev1")
    (org_repo / "refs").mkdir()
    (org_repo / "refs" / "main").write_text("rev1\n")
    model_snap = str(org_repo / "snapshots" / "rev1")
    adapter = _lora(tmp_path / "adapter.safetensors", os.path.join(tiny_model, "transformer"), fmt="peft",
                    modules=["double_blocks.0.img_attn.qkv"])
    lora_snap = _cached(root, "ostris/FLUX.1-tiny-training-adapter", {"pytorch_lora_weights.safetensors": adapter},
                        ref=False)
    images = draw_images(tmp_path / "images", 2, 1)
    c = image_config(tmp_path, "hub", "black-forest-labs/FLUX.1-tiny", images, steps=2,
                     model={"assistant_lora_path": "ostris/FLUX.1-tiny-training-adapter"})
    assert c.model.name_or_path == model_snap and c.model.assistant_lora_path == lora_snap
    said = "\n".join(c.warnings)
    assert f"model.name_or_path: black-forest-labs/FLUX.1-tiny read from the Hugging Face cache: {model_snap}" in said
    assert "model.assistant_lora_path: ostris/FLUX.1-tiny-training-adapter read from the Hugging Face cache" in said
    assert np.isfinite(Trainer(c, verbose=False).train()["losses"]).all()


def test_a_repo_the_cache_lacks_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    images = draw_images(tmp_path / "images", 2, 1)
    with pytest.raises(ConfigError, match=r"model.name_or_path: no such file or folder: black-forest-labs/FLUX.1-dev "
                                          r"\(a Hugging Face repo id\? FLAME does not download, .*`huggingface-cli "
                                          r"download black-forest-labs/FLUX.1-dev` fills it"):
        image_config(tmp_path, "x", "black-forest-labs/FLUX.1-dev", images)


def test_ambiguous_or_broken_cache_entries_are_named(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    _cached(root, "a/two", {"w.safetensors": str(f)}, revision="r1", ref=False)
    (root / "models--a--two" / "snapshots" / "r2").mkdir()
    with pytest.raises(hub_cache.HubCacheError, match=r"holds 2 snapshots \(r1, r2\) and no refs/main"):
        hub_cache.snapshot("a/two")
    _cached(root, "a/gone", {"w.safetensors": str(f)}, revision="r1", ref=False)
    (root / "models--a--gone" / "refs").mkdir()
    (root / "models--a--gone" / "refs" / "main").write_text("r9")
    with pytest.raises(hub_cache.HubCacheError, match=r"names revision r9, which .* does not hold"):
        hub_cache.snapshot("a/gone")
    (root / "models--a--gone" / "refs" / "main").write_text("../../etc")
    with pytest.raises(hub_cache.HubCacheError, match=r"not a revision name"):
        hub_cache.snapshot("a/gone")
    assert hub_cache.snapshot("a/absent") is None


@pytest.mark.parametrize("value, repo", [("black-forest-labs/FLUX.1-dev", True), ("ostris/x.safetensors", False),
                                         ("/abs/path", False), ("a/b/c", False), ("../x", False), ("a/..", False),
                                         ("flux1-dev.safetensors", False)])
def test_what_reads_as_a_repo_id(value, repo):
    assert hub_cache.looks_like_repo_id(value) is repo


def test_the_cache_root_follows_huggingface_hubs_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache.cache_root() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache.cache_root() == str(tmp_path / "c")


def test_generate_reads_a_repo_id_from_the_cache(tmp_path, tiny_model, monkeypatch, capsys):
    """`generate --model org/name` samples from the cached snapshot (said on stderr); a repo the cache lacks is the
    command's error, saying how to fetch it."""
    from flame_models import generate
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    repo = root / "models--black-forest-labs--FLUX.1-tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / "rev1")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    out = tmp_path / "generated"
    assert generate.main(["--model", "black-forest-labs/FLUX.1-tiny", "--prompt", "ohwx", "--width", "64",
                          "--height", "64", "--steps", "2", "--seed", "1", "--max-length", "8", "--device", "cpu",
                          "--output", str(out)]) == 0
    assert [f for f in os.listdir(out) if f.endswith(".png")]
    assert "--model black-forest-labs/FLUX.1-tiny: read from the Hugging Face cache" in capsys.readouterr().err
    assert generate.main(["--model", "black-forest-labs/FLUX.1-absent", "--prompt", "x", "--device", "cpu"]) == 2
    assert "`huggingface-cli download black-forest-labs/FLUX.1-absent` fills it" in capsys.readouterr().err


def test_a_repo_id_matches_the_cache_without_regard_to_case(tmp_path, monkeypatch):
    """Hub ids ignore case and the cache keeps the spelling the download asked for: SimpleTuner's
    black-forest-labs/flux.1-dev finds diffusers' models--black-forest-labs--FLUX.1-dev; the exact spelling wins;
    two spellings of one id in the cache are an error naming both."""
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    upper = _cached(root, "black-forest-labs/FLUX.1-dev", {"w.safetensors": str(f)})
    assert hub_cache.snapshot("black-forest-labs/flux.1-dev") == upper
    assert hub_cache.snapshot("black-forest-labs/FLUX.1-dev") == upper
    lower = _cached(root, "black-forest-labs/flux.1-dev", {"w.safetensors": str(f)}, revision="feed")
    assert hub_cache.snapshot("black-forest-labs/flux.1-dev") == lower       # (exact first)
    assert hub_cache.snapshot("black-forest-labs/FLUX.1-dev") == upper
    with pytest.raises(hub_cache.HubCacheError, match=r"models--black-forest-labs--FLUX.1-dev, "
                                                      r"models--black-forest-labs--flux.1-dev: the same repo id"):
        hub_cache.snapshot("black-forest-labs/Flux.1-Dev")
