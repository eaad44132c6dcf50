"""DatasetConfig validation: every problem at once, each with its field path."""
import typing
from dataclasses import fields

from make_images import write_image

from flame_models.data import DatasetConfig, resolutions, validate_dataset_config
from flame_models.data.config import caption_extension


def test_defaults_are_valid_and_ai_toolkit_names(folder):
    cfg = DatasetConfig(folder_path=folder)
    assert validate_dataset_config(cfg, "datasets[0]") == []
    names = {f.name for f in fields(DatasetConfig)}
    assert {"folder_path", "caption_ext", "default_caption", "caption_dropout_rate", "shuffle_tokens", "keep_tokens",
            "num_repeats", "resolution", "random_crop", "flip_x", "flip_y", "cache_latents_to_disk",
            "bucket_tolerance", "trigger_word"} <= names
    assert resolutions(DatasetConfig(resolution=[1024, 512, 768])) == [512, 768, 1024]
    assert caption_extension(DatasetConfig(caption_ext=".caption")) == caption_extension(
        DatasetConfig(caption_ext="caption")) == ".caption"
    typing.get_type_hints(DatasetConfig)                         # the trainer's YAML builder reads these


def test_every_problem_with_its_path(tmp_path):
    cfg = DatasetConfig(folder_path=str(tmp_path / "missing"), caption_ext="", caption_dropout_rate=1.5,
                        keep_tokens=-1, num_repeats=0, resolution=[512, 500, "x", 512], bucket_tolerance=64,
                        shuffle_tokens="yes", shuffle_variants=0, caption_separator="", trigger_word=3)
    errs = validate_dataset_config(cfg, "config.process[0].datasets[1]")
    p = "config.process[0].datasets[1]."
    expected = [f"{p}shuffle_tokens: expected true or false, got 'yes'",
                f"{p}caption_ext: expected a non-empty string, got ''",
                f"{p}caption_separator: expected a non-empty string, got ''",
                f"{p}trigger_word: expected a string, got int 3",
                f"{p}caption_dropout_rate: a probability in [0, 1], got 1.5",
                f"{p}keep_tokens: an integer >= 0, got -1",
                f"{p}shuffle_variants: null (a new order every epoch) or an integer >= 1, got 0",
                f"{p}num_repeats: an integer >= 1, got 0",
                f"{p}resolution[1]: 500 is not a multiple of bucket_tolerance 64; try 448 or 512",
                f"{p}resolution[2]: a positive integer (pixels), got 'x'",
                f"{p}folder_path: no such folder: {tmp_path / 'missing'}"]
    assert errs == expected
    assert validate_dataset_config(DatasetConfig(folder_path="x", resolution=[512, 512]), "d",
                                   check_files=False) == ["d.resolution: [512, 512] lists a resolution twice"]
    assert validate_dataset_config(DatasetConfig(folder_path="x", bucket_tolerance=48, resolution=[]), "d",
                                   check_files=False) == [
        "d.bucket_tolerance: a positive multiple of 32 (pixels), got 48",
        "d.resolution: an integer or a non-empty list of integers, got []"]
    assert validate_dataset_config(DatasetConfig(), "d") == [
        "d.folder_path: required (a folder of images with same-name caption files)"]
    assert validate_dataset_config(DatasetConfig(folder_path="x", caption_ext="a/b"), "d", check_files=False) == [
        "d.caption_ext: an extension such as 'txt', got 'a/b'"]


def test_folder_checks(tmp_path):
    (tmp_path / "only_text").mkdir()
    (tmp_path / "only_text" / "a.txt").write_text("x")
    (tmp_path / "only_text" / ".hidden").mkdir()
    write_image(str(tmp_path / "only_text" / ".hidden" / "a.png"), 8, 8)
    assert validate_dataset_config(DatasetConfig(folder_path=str(tmp_path / "only_text")), "d") == [
        f"d.folder_path: {tmp_path / 'only_text'} holds no images (.png, .jpg, .jpeg, .webp)"]
    write_image(str(tmp_path / "only_text" / "sub" / "b.WEBP"), 8, 8, fmt="WEBP")
    assert validate_dataset_config(DatasetConfig(folder_path=str(tmp_path / "only_text")), "d") == []
