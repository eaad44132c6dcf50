"""caption_from (the caption file, the image's name, or default_caption for every image), max_aspect (the
buckets' widest aspect; 1: square crops only) and resolution_mode (buckets of about resolution² pixels, or with the
shorter side at the resolution) of a dataset."""
import pytest
from make_images import write_caption, write_image

from flame_models.data import DataError, DatasetConfig, ImageDataset, make_buckets
from flame_models.data.config import validate_dataset_config


def _folder(tmp_path):
    root = tmp_path / "imgs"
    write_caption(write_image(str(root / "a_red_cube.png"), 600, 400, seed=1), "from the file")
    write_image(str(root / "sub" / "blue_ball_2.jpg"), 400, 600, seed=2, fmt="JPEG")    # no caption file
    return str(root)


def _captions(ds):
    return sorted(ds.caption(i, 0) for i in range(len(ds)))


def test_captions_from_file_names_or_one_default_caption(tmp_path):
    root = _folder(tmp_path)
    with pytest.raises(DataError, match="no caption file blue_ball_2.txt"):
        ImageDataset([DatasetConfig(folder_path=root, resolution=128)], progress=False)
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=128, caption_from="filename")], progress=False)
    assert _captions(ds) == ["a red cube", "blue ball 2"]          # (the .txt file is not read)
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=128, caption_from="default_caption",
                                     default_caption="ohwx toy")], progress=False)
    assert _captions(ds) == ["ohwx toy", "ohwx toy"]
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=128, default_caption="ohwx toy")], progress=False)
    assert _captions(ds) == ["from the file", "ohwx toy"]           # ("file": the file, else default_caption)
    # the trigger word and prefix rules apply to them as to a file's caption
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=128, caption_from="filename",
                                     caption_prefix="photo of")], trigger_word="zkx", progress=False)
    assert _captions(ds) == ["zkx photo of a red cube", "zkx photo of blue ball 2"]


def test_max_aspect_bounds_the_buckets(tmp_path):
    root = _folder(tmp_path)
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=256, caption_from="filename")], progress=False)
    assert {(s.bucket.width, s.bucket.height) for s in ds.samples} == {(320, 192), (192, 320)}   # 3:2 and 2:3
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=256, caption_from="filename", max_aspect=1)],
                      progress=False)
    assert {(s.bucket.width, s.bucket.height) for s in ds.samples} == {(256, 256)}    # square crops only
    assert max(b.aspect for b in make_buckets(512, 64, max_aspect=2.0)) <= 2.0
    # an image smaller than its square bucket is named with it
    with pytest.raises(DataError, match=r"a_red_cube.png: 600x400 is smaller than its 512x512 bucket"):
        ImageDataset([DatasetConfig(folder_path=root, resolution=512, caption_from="filename", max_aspect=1)],
                     progress=False)


def test_short_side_buckets_keep_the_shorter_side_at_the_resolution(tmp_path):
    # SimpleTuner's resolution_type pixel: 600x400 and 400x600 train at 384x256 / 256x384 (the longer side the
    # aspect's, to the bucket step), where area buckets of 256 hold them at 320x192 / 192x320
    root = _folder(tmp_path)
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=256, caption_from="filename",
                                     resolution_mode="short_side")], progress=False)
    assert {(s.bucket.width, s.bucket.height) for s in ds.samples} == {(384, 256), (256, 384)}
    assert {s.placement.resized for s in ds.samples} == {(384, 256), (256, 384)}   # 1.5:1 exactly: no crop
    got = make_buckets(256, 64, max_aspect=2.0, mode="short_side")
    assert got == sorted(got, key=lambda b: (b.aspect, b.width))
    assert {tuple(b) for b in got} == {(256, 256), (320, 256), (384, 256), (448, 256), (512, 256),
                                       (256, 320), (256, 384), (256, 448), (256, 512)}
    assert [tuple(b) for b in make_buckets(256, 64, max_aspect=2.0, mode="short_side", max_side=384)] == [
        (256, 384), (256, 320), (256, 256), (320, 256), (384, 256)]
    ds = ImageDataset([DatasetConfig(folder_path=root, resolution=256, caption_from="filename", max_aspect=1,
                                     resolution_mode="short_side")], progress=False)
    assert {(s.bucket.width, s.bucket.height) for s in ds.samples} == {(256, 256)}   # square crops as in area
    with pytest.raises(ValueError, match="bucket mode 'edge'"):
        make_buckets(256, mode="edge")


@pytest.mark.parametrize("fields, words", [
    ({"caption_from": "files"}, r"caption_from: one of file, filename, default_caption, got 'files'"),
    ({"caption_from": "default_caption"}, r"caption_from: default_caption gives every image default_caption, "
                                          r"which is not set"),
    ({"max_aspect": 0.5}, r"max_aspect: a number in \[1, 8\] \(1: square buckets only\), got 0.5"),
    ({"max_aspect": "wide"}, r"max_aspect: a number in \[1, 8\]"),
    ({"resolution_mode": "pixel"}, r"resolution_mode: one of area, short_side, got 'pixel'"),
])
def test_bad_values_are_named(tmp_path, fields, words):
    import re
    problems = validate_dataset_config(DatasetConfig(folder_path=_folder(tmp_path), **fields), "datasets[0]")
    assert any(re.search(words, p) for p in problems), problems
