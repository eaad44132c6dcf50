"""Symbolic links in a data folder: followed inside it, skipped with a warning outside it (files and folders alike),
each file and folder read once, loops do not hang; the same walk for images, captions, folder checks and samples."""
import os

import numpy as np
import pytest
from make_images import write_caption, write_image

from flame_models.data import DataError, DatasetConfig, ImageDataset, list_images, validate_dataset_config
from flame_models.data.walk import walk_files
from flame_models.training.data import FolderDataset, dataset_kind, write_sample


def _link(target, path):
    os.symlink(target, path)
    return str(path)


@pytest.fixture
def tree(tmp_path):
    """data/ with real images, links that stay inside (to a hidden store, absolute or relative, to a folder) and
    links that leave it, loop, break or repeat what the scan already holds; outside/ beside it."""
    out, data = tmp_path / "outside", tmp_path / "data"
    write_image(str(out / "secret.png"), 8, 8)
    write_image(str(out / "dir" / "o.png"), 8, 8)
    for rel in ("a.png", "sub/b.png", ".store/c.png", ".store2/d.png", ".store/e.png"):
        write_image(str(data / rel), 8, 8)
    links = {
        "in_dup.png": _link("sub/b.png", data / "in_dup.png"),                       # inside, but b.png is scanned
        "c_link.png": _link(".store/c.png", data / "c_link.png"),                    # inside: followed
        "abs_in.png": _link(str(data / ".store" / "e.png"), data / "abs_in.png"),    # absolute, inside: followed
        "storedir": _link(".store2", data / "storedir"),                             # a folder inside: followed
        "out.png": _link("../outside/secret.png", data / "out.png"),                 # a file outside
        "chain.png": _link("out.png", data / "chain.png"),                           # inside, then outside
        "outdir": _link(str(out / "dir"), data / "outdir"),                          # a folder outside
        "loop": _link(".", data / "loop"),                                           # the folder itself
        "sub/up": _link("..", data / "sub" / "up"),                                  # its parent
        "broken.png": _link("nothing.png", data / "broken.png"),
        "cycle.png": _link("cycle2.png", data / "cycle.png"),                        # a -> b -> a
        "cycle2.png": _link("cycle.png", data / "cycle2.png"),
    }
    return data, links


def test_links_inside_are_followed_and_links_outside_skipped_with_a_warning(tree):
    data, links = tree
    warnings = []
    got = [os.path.relpath(p, data) for p in list_images(str(data), warnings.append)]
    assert got == ["a.png", "abs_in.png", "c_link.png", "storedir/d.png", "sub/b.png"]
    said = {os.path.relpath(w.split(": ")[0], data): w for w in warnings}
    assert sorted(said) == ["broken.png", "chain.png", "cycle.png", "cycle2.png", "in_dup.png", "loop", "out.png",
                            "outdir", "sub/up"]
    for name in ("out.png", "chain.png", "outdir"):
        assert f"outside the data folder {data}: skipped" in said[name]
    assert str(data.parent / "outside" / "secret.png") in said["out.png"]
    assert "a broken link (to nothing.png)" in said["broken.png"]
    for name in ("loop", "sub/up"):
        assert "which the scan already holds (a loop" in said[name]
    assert "already holds" in said["in_dup.png"]


def test_the_data_folder_may_itself_be_a_link(tree, tmp_path):
    data, _ = tree
    alias = _link(str(data), tmp_path / "alias")
    got = [os.path.relpath(p, alias) for p in walk_files(alias)]
    assert "a.png" in got and "c_link.png" in got and not any("secret" in g or "o.png" in g for g in got)


def test_a_folder_whose_images_are_all_outside_holds_no_images(tmp_path):
    write_image(str(tmp_path / "outside" / "x.png"), 8, 8)
    data = tmp_path / "data"
    data.mkdir()
    _link("../outside/x.png", data / "x.png")
    _link("../outside", data / "more")
    assert dataset_kind(str(data)) is None
    e = validate_dataset_config(DatasetConfig(folder_path=str(data)))
    assert any("holds no images" in m for m in e), e


def test_the_dataset_warns_about_skipped_links_and_reads_captions_inside_only(tmp_path):
    data, out = tmp_path / "data", tmp_path / "outside"
    write_caption(write_image(str(data / "a.png"), 64, 64), "a cat")
    write_caption(write_image(str(data / "b.png"), 64, 64, seed=1), "unused")
    (out).mkdir()
    (out / "secret.txt").write_text("the secret")
    os.remove(data / "b.txt")
    _link("../outside/secret.txt", data / "b.txt")                  # a caption leaving the folder
    write_image(str(out / "c.png"), 64, 64, seed=2)
    _link("../outside/c.png", data / "c.png")
    with pytest.raises(DataError, match=r"b\.txt: a link to .*secret\.txt, outside the data folder .*: not read"):
        ImageDataset([DatasetConfig(folder_path=str(data), resolution=64)], progress=False)
    ds = ImageDataset([DatasetConfig(folder_path=str(data), resolution=64, default_caption="a thing")],
                      progress=False)
    assert sorted(os.path.basename(r.path) for r in ds.records) == ["a.png", "b.png"]
    assert sorted(ds.raw_captions) == ["a cat", "a thing"]
    assert any(w.startswith(str(data / "c.png")) and "outside the data folder" in w for w in ds.warnings)
    assert any(w.startswith(str(data / "b.txt")) and "default_caption used" in w for w in ds.warnings)


def test_sample_folders_follow_the_same_policy(tmp_path):
    data, out = tmp_path / "samples", tmp_path / "outside"
    data.mkdir()
    out.mkdir()
    arrays = {"latents": np.zeros((4, 2, 2), np.float32), "prompt_embeds": np.zeros((3, 8), np.float32)}
    write_sample(str(data / "0.safetensors"), **arrays)
    write_sample(str(out / "x.safetensors"), **arrays)
    _link("../outside/x.safetensors", data / "1.safetensors")
    _link("0.safetensors", data / "2.safetensors")                   # a second name for a sample: read once
    ds = FolderDataset(str(data), ["latents", "prompt_embeds"])
    assert [os.path.basename(f) for f in ds.files] == ["0.safetensors"]
    assert len(ds.warnings) == 2 and "outside the data folder" in ds.warnings[0]
    assert dataset_kind(str(data)) == "samples"
