"""kohya sd-scripts' dataset TOML (--dataset_config) read as FLAME's datasets: [general] < [[datasets]] <
[[datasets.subsets]] precedence, each key to its FLAME field, one batch size, and every key FLAME would not apply an
error naming the file, entry and key; then through the command line into a run whose buckets keep kohya's bounds."""
import pytest

from flame_models import train
from flame_models.data.buckets import Bucket, make_buckets
from flame_models.data.kohya_toml import KohyaConfigError, read_dataset_config
from flame_models.training.config import ConfigError

KOHYA = """
[general]
shuffle_caption = true
caption_extension = '.txt'
keep_tokens = 1

[[datasets]]
resolution = 64
batch_size = 2
enable_bucket = true
bucket_reso_steps = 32
min_bucket_reso = 32
max_bucket_reso = 96

  [[datasets.subsets]]
  image_dir = '{a}'
  num_repeats = 10
  class_tokens = 'ohwx dog'
  flip_aug = true

  [[datasets.subsets]]
  image_dir = '{b}'
  is_reg = true
  keep_tokens = 0
  caption_extension = '.caption'

[[datasets]]
resolution = [128, 128]
batch_size = 2
bucket_no_upscale = true

  [[datasets.subsets]]
  image_dir = '{a}'
  caption_dropout_rate = 0.05
  caption_prefix = 'photo of'
  keep_tokens_separator = '|||'
  caption_tag_dropout_rate = 0.1
  secondary_separator = ';;;'
  caption_dropout_every_n_epochs = 3
  enable_wildcard = true
"""


def _write(tmp_path, text, name="dataset.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_every_subset_becomes_a_dataset_with_kohyas_precedence(tmp_path):
    path = _write(tmp_path, KOHYA.format(a="/data/a", b="/data/reg"))
    datasets, batch, notes = read_dataset_config(path)
    assert batch == 2
    common = {"shuffle_tokens": True, "caption_ext": ".txt", "keep_tokens": 1}
    assert datasets == [
        {**common, "resolution": 64, "bucket_tolerance": 32, "min_bucket_reso": 32, "max_bucket_reso": 96,
         "folder_path": "/data/a", "num_repeats": 10, "default_caption": "ohwx dog", "flip_x": True,
         "allow_upscale": True, "caption_lines": "first"},
        {**common, "resolution": 64, "bucket_tolerance": 32, "min_bucket_reso": 32, "max_bucket_reso": 96,
         "folder_path": "/data/reg", "is_reg": True, "keep_tokens": 0, "caption_ext": ".caption",
         "allow_upscale": True, "caption_lines": "first"},
        # kohya trains on one line of a caption file: a random one with wildcards on, else the first
        {**common, "resolution": 128, "folder_path": "/data/a", "caption_dropout_rate": 0.05,
         "caption_prefix": "photo of", "keep_tokens_separator": "|||", "caption_tag_dropout_rate": 0.1,
         "secondary_separator": ";;;", "allow_upscale": False, "caption_dropout_every_n_epochs": 3,
         "enable_wildcard": True, "caption_lines": "random", "max_aspect": 1.0}]   # (no enable_bucket: kohya's off)
    assert len(notes) == 2 and "flip_aug" in notes[0] and "subset #1" in notes[0]
    assert "[[datasets]] #2 subset #1: enable_bucket off" in notes[1] and "cropped to the square" in notes[1]
    # the arguments file's enable_bucket is the default of the subsets that do not set it
    datasets, _, notes = read_dataset_config(path, enable_bucket=True)
    assert all("max_aspect" not in d for d in datasets) and len(notes) == 1


@pytest.mark.parametrize("text, words", [
    ("[general]\ncolor_aug = true\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n",
     "[general]: color_aug: not supported"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\ntoken_warmup_step = 10\n",
     "[[datasets]] #1 subset #1: token_warmup_step: not supported"),
    ("[[datasets]]\nresolution = [1024, 768]\n[[datasets.subsets]]\nimage_dir = 'x'\n",
     "resolution: [1024, 768] is not square"),
    ("[[datasets]]\nenable_bucket = 'no'\n[[datasets.subsets]]\nimage_dir = 'x'\n",
     "subset #1.enable_bucket: true or false, got 'no'"),
    ("[[datasets]]\nbatch_size = 1\n[[datasets.subsets]]\nimage_dir = 'x'\n"
     "[[datasets]]\nbatch_size = 4\n[[datasets.subsets]]\nimage_dir = 'y'\n", "batch sizes [1, 4]"),
    ("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 2\n", "subset #1: no image_dir"),
    ("[[datasets]]\nresolution = 512\n", "[[datasets]] #1: no [[datasets.subsets]]"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\nresolution = 512\n", "resolution: not supported"),
    ("this is = = not toml", "not a TOML file"),
])
def test_what_flame_would_not_apply_is_an_error_naming_it(tmp_path, text, words):
    path = _write(tmp_path, text)
    with pytest.raises(KohyaConfigError) as e:
        read_dataset_config(path)
    assert words in str(e.value) and path in str(e.value)


def test_bucket_bounds_keep_the_sides_within_them():
    all_ = make_buckets(1024, 64)
    bounded = make_buckets(1024, 64, min_side=768, max_side=1280)
    assert bounded == [b for b in all_ if 768 <= min(b) and max(b) <= 1280]
    assert Bucket(1024, 1024) in bounded and Bucket(768, 1280) in bounded and Bucket(704, 1472) not in bounded
    with pytest.raises(ValueError, match="outside the bucket sides' bounds"):
        make_buckets(1024, 64, max_side=512)


def test_the_command_line_reads_it_into_a_run(tmp_path):
    from PIL import Image

    from flame_models.flux.demo import draw_dataset
    from flame_models.training.trainer import Trainer
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    draw_dataset(a, n_concept=2, n_other=2, size=64)                       # 64x64 drawings
    draw_dataset(b, n_concept=1, n_other=1, size=64)
    for f in (tmp_path / "b").glob("*.txt"):                                 # that subset's captions: .caption
        f.rename(f.with_suffix(".caption"))
    Image.new("RGB", (192, 64), (30, 90, 200)).save(tmp_path / "a" / "band.png")   # and a 3:1 band
    (tmp_path / "a" / "band.txt").write_text("a wide blue band")
    path = _write(tmp_path, KOHYA.format(a=a, b=b).replace("resolution = [128, 128]", "resolution = 64"))
    args = ["--dataset-config", path, "--output", str(tmp_path), "--device", "cpu", "--steps", "2"]
    cfg, demo, notes = train.build_config(train.parser().parse_args(args))
    assert not demo and cfg.train.batch_size == 2 and len(cfg.datasets) == 3
    assert [d.folder_path for d in cfg.datasets] == [a, b, a] and cfg.datasets[1].is_reg
    assert any("flip_aug" in n for n in notes)
    tr = Trainer(cfg, verbose=False)
    tr.setup()
    # the 3:1 band goes to the widest bucket within max_bucket_reso 96 (96x32), not to 192x32
    buckets = {tuple(s.bucket) for s in tr.dataset.samples if s.config == 0}
    assert max(b[0] for b in buckets) <= 96 and (96, 32) in buckets
    with pytest.raises(ConfigError, match="--dataset-config: the datasets come from it"):
        train.build_config(train.parser().parse_args(args + ["--data", a]))
    with pytest.raises(ConfigError, match="--dataset-config .*color_aug: not supported"):
        train.build_config(train.parser().parse_args(
            ["--dataset-config", _write(tmp_path, "[general]\ncolor_aug = true\n", "bad.toml")]))


def test_a_run_with_tag_dropout_has_every_caption_it_draws_encoded(tmp_path):
    """caption_tag_dropout_rate in a run: the text stage encodes every variant the epochs can draw (the loader
    checks each batch's caption is cached), and the run trains."""
    import numpy as np

    from flame_models.flux.demo import draw_dataset
    from flame_models.training.trainer import Trainer

    images = str(tmp_path / "img")
    draw_dataset(images, n_concept=2, n_other=2, size=64)
    for f in (tmp_path / "img").glob("*.txt"):
        f.write_text(f.read_text().strip() + ", red, round, small, bright, centered")
    path = _write(tmp_path, f"[general]\ncaption_tag_dropout_rate = 0.5\nshuffle_caption = true\nkeep_tokens = 1\n"
                            f"[[datasets]]\nresolution = 64\nbatch_size = 2\nbucket_reso_steps = 32\n"
                            f"[[datasets.subsets]]\nimage_dir = '{images}'\n")
    args = ["--dataset-config", path, "--output", str(tmp_path), "--device", "cpu", "--steps", "6"]
    cfg, _, _ = train.build_config(train.parser().parse_args(args))
    cfg.sample.sample_every = 0
    result = Trainer(cfg, verbose=False).train()
    assert np.isfinite(result["losses"]).all() and result["encoded"]["text"] > 4
