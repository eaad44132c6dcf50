"""kohya's sample-prompt files (--sample_prompts .txt / .json / .toml) read into sample.prompts with their options as
flags, through the command line; what FLAME does not read is an error naming the file and entry."""
import json

import pytest

from flame_models import train
from flame_models.training.config import ConfigError
from flame_models.training.prompt_files import read_prompt_file
from flame_models.training.prompt_options import parse


def test_txt_json_and_toml_read_as_kohya_writes_them(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("# previews\n\na cat --w 768 --h 512 --d 1\n  a dog --l 3.5 --n blurry\n")
    assert read_prompt_file(str(txt)) == ["a cat --w 768 --h 512 --d 1", "a dog --l 3.5 --n blurry"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps([{"prompt": "a cat", "width": 768, "height": 512, "seed": 1, "sample_steps": 20,
                               "scale": 4.5, "negative_prompt": "low quality", "sample_sampler": "heun"},
                              {"prompt": "a dog", "guidance_scale": 3.5}]))
    got = read_prompt_file(str(js))
    o = parse(got[0])
    assert (o.text, o.width, o.height, o.seed, o.steps, o.cfg, o.negative, o.sampler) == \
        ("a cat", 768, 512, 1, 20, 4.5, "low quality", "heun")
    assert parse(got[1]).guidance == 3.5
    toml = tmp_path / "p.toml"
    toml.write_text('[prompt]\nwidth = 640\nsample_steps = 12\n\n[[prompt.subset]]\nprompt = "a cat"\n\n'
                    '[[prompt.subset]]\nprompt = "a dog"\nwidth = 768\n')
    got = [parse(p) for p in read_prompt_file(str(toml))]
    assert [(o.text, o.width, o.steps) for o in got] == [("a cat", 640, 12), ("a dog", 768, 12)]


@pytest.mark.parametrize("name, text, words", [
    ("a.json", json.dumps([{"prompt": "x", "controlnet_image": "c.png"}]), "[0]: controlnet_image: not read"),
    ("b.json", json.dumps({"prompt": "x"}), "expected a list of prompt objects"),
    ("c.json", json.dumps([{"width": 64}]), "[0]: a non-empty prompt string is required"),
    ("d.json", "[{", "cannot be read as json"),
    ("e.toml", "[other]\nx = 1\n", "expected a [prompt] table"),
    ("f.txt", "# only a comment\n", "holds no prompt"),
])
def test_bad_files_name_what_is_wrong(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_prompt_file(str(path))
    assert words in str(e.value) and str(path) in str(e.value)


def test_the_command_line_takes_them_and_checks_their_flags(tmp_path):
    from .conftest import draw_images
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1)
    conf = tmp_path / "run.yaml"
    conf.write_text(f"training_folder: {tmp_path}\nmodel: {{size: flux-tiny}}\n"
                    f"datasets: [{{folder_path: {images}, resolution: 64, bucket_tolerance: 32}}]\n")
    txt = tmp_path / "p.txt"
    txt.write_text("a cat --w 64 --h 32\na dog\n")
    args = ["--config", str(conf), "--device", "cpu", "--sample-prompts", str(txt)]
    cfg, _, _ = train.build_config(train.parser().parse_args(args))
    assert cfg.sample.prompts == ["a cat --w 64 --h 32", "a dog"]
    txt.write_text("a cat --frames 4\n")
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: --frames: not a sample-prompt option"):
        train.build_config(train.parser().parse_args(args))
    with pytest.raises(ConfigError, match="--sample-prompts .*nope.txt: no such file"):
        train.build_config(train.parser().parse_args(args[:-1] + [str(tmp_path / "nope.txt")]))
