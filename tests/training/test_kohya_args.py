"""kohya sd-scripts' training arguments file (--config_file args.toml) read as a FLAME run (--kohya-config): each
argument to its FLAME setting, the dataset TOML and prompt file it names, notes for what FLAME always does or does
not use, and an error naming the file and key for everything FLAME would not apply; then a run trains from it."""
import pytest

from flame_models import train
from flame_models.training.config import ConfigError
from flame_models.training.kohya_args import read_kohya_args
from flame_models.training.trainer import Trainer

from .conftest import draw_images

ARGS = """
pretrained_model_name_or_path = "{model}"
cache_latents_to_disk = true
save_model_as = "safetensors"
sdpa = true
persistent_data_loader_workers = true
max_data_loader_n_workers = 2
seed = 7
gradient_checkpointing = true
mixed_precision = "no"
save_precision = "fp32"
network_module = "networks.lora_flux"
network_dim = 4
network_alpha = 2
network_train_unet_only = true
optimizer_type = "AdamW8bit"
optimizer_args = ["weight_decay=0.01", "betas=(0.9, 0.99)"]
learning_rate = 1e-4
lr_scheduler = "cosine_with_restarts"
lr_scheduler_num_cycles = 2
lr_warmup_steps = 1
cache_text_encoder_outputs = true
max_train_steps = 2
save_every_n_steps = 2
dataset_config = "dataset.toml"
sample_prompts = "prompts.txt"
sample_every_n_steps = 2
output_dir = "{out}"
output_name = "my_flux_lora"
timestep_sampling = "shift"
discrete_flow_shift = 3.1582
model_prediction_type = "raw"
guidance_scale = 1.0
"""
DATASET = """
[general]
caption_extension = '.txt'
[[datasets]]
resolution = 64
batch_size = 2
bucket_reso_steps = 32
  [[datasets.subsets]]
  image_dir = '{images}'
  num_repeats = 2
"""


@pytest.fixture
def files(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images", n_concept=2, n_other=2)
    (tmp_path / "dataset.toml").write_text(DATASET.format(images=images))
    (tmp_path / "prompts.txt").write_text("ohwx on a beach --w 64 --h 64\n")
    args = tmp_path / "args.toml"
    args.write_text(ARGS.format(model=tiny_model, out=tmp_path / "out"))
    return tmp_path, str(args)


def test_each_argument_maps_to_its_setting(files):
    tmp, path = files
    proc, notes = read_kohya_args(path)
    assert proc["model"] == {"name_or_path": proc["model"]["name_or_path"]}
    assert proc["network"] == {"type": "lora", "linear": 4, "linear_alpha": 2}
    t = proc["train"]
    assert (t["optimizer"], t["optimizer_params"], t["lr"]) == ("AdamW8bit", {"weight_decay": 0.01,
                                                                              "betas": (0.9, 0.99)}, 1e-4)
    assert (t["lr_scheduler"], t["lr_scheduler_params"], t["steps"], t["dtype"]) == \
        ("cosine_with_restarts", {"num_cycles": 2}, 2, "fp32")
    assert (t["timestep_type"], t["shift"], t["guidance"], t["batch_size"]) == ("shift", 3.1582, 1.0, 2)
    assert "train_text_encoder" not in t                           # network_train_unet_only
    assert proc["datasets"][0]["cache_latents_to_disk"] and proc["datasets"][0]["num_repeats"] == 2
    assert proc["sample"] == {"prompts": ["ohwx on a beach --w 64 --h 64"], "sample_every": 2}
    assert (proc["name"], proc["save"]) == ("my_flux_lora", {"save_every": 2, "dtype": "fp32"})
    said = "\n".join(notes)
    assert "sdpa: not used" in said and "cache_latents: " not in said and "cache_text_encoder_outputs: FLAME" in said
    # kohya's --enable_bucket is off unless given: square crops; given, the subsets bucket
    assert proc["datasets"][0]["max_aspect"] == 1.0 and "enable_bucket off" in said
    with open(path, "a") as f:
        f.write("enable_bucket = true\n")
    proc, notes = read_kohya_args(path)
    assert "max_aspect" not in proc["datasets"][0] and "enable_bucket" not in "\n".join(notes)


def test_a_run_trains_from_it(files):
    tmp, path = files
    cfg, demo, notes = train.build_config(train.parser().parse_args(["--kohya-config", path, "--device", "cpu"]))
    assert not demo and cfg.name == "my_flux_lora" and tuple(cfg.train.optimizer_params["betas"]) == (0.9, 0.99)
    assert cfg.train.optimizer == "adamw8bit" and cfg.save.save_every == 2 and cfg.datasets[0].num_repeats == 2
    assert cfg.train.timestep_type == "shift" and cfg.sample.prompts == ["ohwx on a beach --w 64 --h 64"]
    tr = Trainer(cfg, verbose=False)
    tr.setup()
    loss = tr.train_step()[0]
    assert loss == loss


@pytest.mark.parametrize("line, words", [
    ("save_every_n_epochs = 1", "save_every_n_epochs and save_every_n_steps: FLAME saves on one schedule"),
    ("blocks_to_swap = 18", "blocks_to_swap: not supported"),
    ('timestep_sampling = "sigma"', "timestep_sampling: FLAME draws uniform, sigmoid, shift, flux_shift"),
    ('mixed_precision = "fp8"', "mixed_precision: one of"),
    ('network_module = "networks.oft"', "network_module 'networks.oft'"),
    ('network_args = ["algo=glora"]', "algo=glora"),
    ('network_args = ["train_blocks=single"]', "network_args train_blocks='single': not supported"),
])
def test_what_flame_would_not_apply_is_named(files, line, words):
    tmp, path = files
    text = open(path).read()
    key = line.split(" =")[0]
    text = "\n".join(x for x in text.splitlines() if not x.startswith(key + " ")) + "\n" + line + "\n"
    if key == "network_args":
        text = text.replace('network_module = "networks.lora_flux"', 'network_module = "lycoris.kohya"')
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match=words):
        read_kohya_args(path)


def test_lycoris_lokr_and_text_encoder_training(files):
    tmp, path = files
    text = open(path).read().replace('network_module = "networks.lora_flux"', 'network_module = "lycoris.kohya"\n'
                                     'network_args = ["algo=lokr", "factor=4", "conv_dim=8"]')
    text = text.replace("network_train_unet_only = true\n", "").replace("cache_text_encoder_outputs = true\n", "")
    with open(path, "w") as f:
        f.write(text)
    proc, notes = read_kohya_args(path)
    assert proc["network"] == {"type": "lokr", "linear": 4, "linear_alpha": 2, "lokr_factor": 4, "conv": 8}
    assert proc["train"]["train_text_encoder"] is True and any("kohya trains the text encoders" in n for n in notes)
    with pytest.raises(ConfigError, match="--config, --kohya-config and --simpletuner-config each give"):
        train.build_config(train.parser().parse_args(["--kohya-config", path, "--config", path]))


def test_a_missing_or_bad_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_kohya_args(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="not a TOML file"):
        read_kohya_args(str(bad))
    no_data = tmp_path / "nodata.toml"
    no_data.write_text('pretrained_model_name_or_path = "x"\ntrain_data_dir = "img"\n')
    with pytest.raises(ConfigError, match="train_data_dir: not supported.*\n.*no dataset_config"):
        read_kohya_args(str(no_data))


def test_kohyas_epochs_become_steps_from_the_datasets_batches(files):
    """max_train_epochs / save_every_n_epochs (kohya's canonical Flux example uses them): an epoch is every batch of
    the image datasets once (4 drawings x 2 repeats at batch 2: 4 batches); the epochs win over max_train_steps."""
    tmp, path = files
    text = open(path).read().replace("save_every_n_steps = 2\n", "save_every_n_epochs = 1\n")
    with open(path, "w") as f:
        f.write(text + "max_train_epochs = 3\n")
    proc, notes = read_kohya_args(path)
    assert proc["train"]["epochs"] == 3 and "steps" not in proc["train"] and proc["save"]["save_every_epochs"] == 1
    assert any("the epochs set the length" in n for n in notes)
    cfg = train.build_config(train.parser().parse_args(["--kohya-config", path, "--device", "cpu"]))[0]
    tr = Trainer(cfg, verbose=False)
    tr.setup()
    per_epoch = sum(len(v) // 2 for v in tr.dataset.buckets().values())
    assert per_epoch == 4 and cfg.train.steps == 3 * per_epoch and cfg.save.save_every == per_epoch
    with pytest.raises(ConfigError, match="train.epochs: given together with config.process\\[0\\].train.steps|"
                                          "train.epochs: given together with train.steps"):
        from flame_models.training.config import config_from_dict
        config_from_dict({"datasets": [{"folder_path": str(tmp / "images")}], "train": {"epochs": 2, "steps": 5}})


def test_warm_up_longer_than_the_epochs_steps_is_named(files):
    tmp, path = files
    text = open(path).read().replace("lr_warmup_steps = 1\n", "lr_warmup_steps = 50\n")
    with open(path, "w") as f:
        f.write(text + "max_train_epochs = 1\n")
    cfg = train.build_config(train.parser().parse_args(["--kohya-config", path, "--device", "cpu"]))[0]
    with pytest.raises(ConfigError, match="lr_warmup_steps: 50 warm-up steps leave nothing of the 4 steps"):
        Trainer(cfg, verbose=False).setup()


def test_unet_lr_wins_over_learning_rate_wherever_it_stands(files):
    tmp, path = files
    text = open(path).read()
    with open(path, "w") as f:
        f.write("unet_lr = 3e-4\n" + text)                 # (before learning_rate in the file)
    assert read_kohya_args(path)[0]["train"]["lr"] == 3e-4


def test_optimizer_args_are_literals_or_text():
    from flame_models.training.kohya_args import _pairs
    deep = "[" * 10000 + "]" * 10000
    got = _pairs(["weight_decay=0.01", "relative_step=False", "betas=(0.9,0.99)", "mode=fast", f"deep={deep}"], "x")
    assert got == {"weight_decay": 0.01, "relative_step": False, "betas": (0.9, 0.99), "mode": "fast", "deep": deep}
    with pytest.raises(ConfigError, match="a list of \"key=value\" strings"):
        _pairs(["novalue"], "x")
