"""Training config: the ai-toolkit example parses, and every kind of mistake is reported with its field path."""
import os

import pytest

from flame_models.training.config import ConfigError, TrainConfig, config_from_dict, load_config, validate

EXAMPLE = """
job: extension
config:
  name: my_lora
  process:
    - type: sd_trainer
      training_folder: {out}
      device: cpu
      trigger_word: ohwx
      network: {{type: lora, linear: 16, linear_alpha: 16}}
      save: {{dtype: bf16, save_every: 250, max_step_saves_to_keep: 4}}
      datasets:
        - folder_path: {data}
          caption_ext: txt
          caption_dropout_rate: 0.05
          cache_latents_to_disk: true
          resolution: [512, 768, 1024]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false
        gradient_checkpointing: true
        noise_scheduler: flowmatch
        timestep_type: sigmoid
        optimizer: adamw8bit
        lr: 1e-4
        dtype: bf16
      model: {{name_or_path: {model}, arch: flux, quantize: true}}
      sample:
        sample_every: 250
        width: 1024
        height: 1024
        prompts: ["a photo of [trigger]"]
        seed: 42
        guidance_scale: 4
        sample_steps: 20
"""


@pytest.fixture
def files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "0000.safetensors").write_bytes(b"")
    model = tmp_path / "flux1-dev.safetensors"
    model.write_bytes(b"")
    return tmp_path, data, model


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


def test_ai_toolkit_example_parses(files):
    tmp, data, model = files
    cfg = load_config(_write(tmp, EXAMPLE.format(out=tmp / "out", data=data, model=model)))
    assert cfg.name == "my_lora" and cfg.output_dir == os.path.join(str(tmp / "out"), "my_lora")
    assert (cfg.network.type, cfg.network.linear, cfg.network.linear_alpha) == ("lora", 16, 16.0)
    assert cfg.train.lr == pytest.approx(1e-4)  # YAML 1.1 reads 1e-4 as a string
    assert (cfg.train.steps, cfg.train.optimizer, cfg.train.timestep_type) == (2000, "adamw8bit", "sigmoid")
    assert cfg.datasets[0].folder_path == str(data) and cfg.model.name_or_path == str(model)
    assert (cfg.sample.width, cfg.sample.sample_steps, cfg.sample.guidance_scale) == (1024, 20, 4.0)
    # keys that mean nothing here are accepted with a reason, not silently
    joined = "\n".join(cfg.warnings)
    for key in ("trigger_word", "caption_dropout_rate", "resolution", "prompts", "caption_ext"):
        assert key in joined, key
    assert cfg.model.quantize is True and "quantize" not in joined  # honoured: fp8 storage of the blocks
    assert "datasets[0].cache_latents_to_disk" in joined


def test_every_problem_is_listed_with_its_path(files):
    tmp, data, model = files
    bad = {"config": {"name": "x", "process": [{
        "network": {"type": "lorra", "linear": 0},
        "train": {"lrr": 1e-4, "steps": "many", "optimizer": "sgd", "timestep_type": "cosmic"},
        "save": {"format": "peft"},
        "datasets": [{"folder_path": str(tmp / "missing")}],
        "model": {"name_or_path": str(tmp / "nope.safetensors")},
        "sample": {"width": 1000},
    }]}}
    with pytest.raises(ConfigError) as ei:
        config_from_dict(bad, "run.yaml")
    msg = str(ei.value)
    for piece in ("config.process[0].network.type: 'lorra' is not one of", "did you mean 'lora'",
                  "network.linear: must be >= 1, got 0", "train.lrr: unknown field; did you mean 'lr'",
                  "train.steps: expected a number, got 'many'", "train.optimizer: 'sgd'",
                  "train.timestep_type: 'cosmic'", "datasets[0].folder_path: no such folder",
                  "model.name_or_path: no such file or folder", "sample.width: must be a positive multiple of 16"):
        assert piece in msg, piece
    assert msg.startswith("run.yaml: ") and "problem(s) in the training config" in msg


def test_semantic_errors(files):
    tmp, data, model = files
    base = {"datasets": [{"folder_path": str(data)}]}
    cases = [
        ({"network": {"type": "lokr"}, "save": {"format": "peft"}}, "'peft' cannot hold lokr"),
        ({"train": {"steps": 10, "lr_warmup_steps": 10}}, "leave nothing of 10 steps"),
        ({"train": {"train_text_encoder": True}}, "text encoder training is not available"),
        ({"train": {"noise_scheduler": "ddpm"}}, "Flux trains with 'flowmatch'"),
        ({"network": {"dropout": 1.5}}, "network.dropout: must be in [0, 1)"),
        ({"network": {"target": []}}, "network.target"),
        ({"network": {"network_kwargs": {"only_if": ["x"]}}}, "network_kwargs.only_if: unknown"),
        ({"datasets": []}, "datasets: no dataset"),
        ({"device": "tpu"}, "device: 'cpu', 'cuda' or 'cuda:N'"),
        ({"train": {"gradient_checkpointing": "yes"}}, "expected true or false"),
    ]
    for change, expect in cases:
        d = {**base, **change}
        with pytest.raises(ConfigError) as ei:
            config_from_dict(d)
        assert expect in str(ei.value), (change, str(ei.value))


def test_empty_folder_and_yaml_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no .safetensors files"):
        config_from_dict({"datasets": [{"folder_path": str(empty)}]})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "train: {steps: 10\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "absent.yaml"))
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(_write(tmp_path, ""))


def test_aliases_and_flat_layout(files):
    tmp, data, model = files
    cfg = config_from_dict({"name": "flat", "network": {"rank": 8, "alpha": 4},
                            "datasets": [{"folder_path": str(data)}], "train": {"optimizer": "adamw"}})
    assert (cfg.name, cfg.network.linear, cfg.network.linear_alpha, cfg.train.optimizer) == ("flat", 8, 4.0, "adamw")
    with pytest.raises(ConfigError, match="given twice"):
        config_from_dict({"network": {"rank": 8, "linear": 4}, "datasets": [{"folder_path": str(data)}]})


def test_defaults_need_only_a_dataset():
    cfg = TrainConfig()
    errs = validate(cfg)
    assert errs == ["datasets: no dataset (give datasets: [{folder_path: ...}] or synthetic: {...})"]
