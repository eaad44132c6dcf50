"""Training config: the ai-toolkit example parses or says exactly what it asks for that FLAME lacks, every kind of
mistake is reported with its field path in one error before anything is loaded, and no key is accepted and ignored."""
import os

import numpy as np
import pytest

from flame_models.training.config import ConfigError, TrainConfig, config_from_dict, load_config
from flame_models.training.validation import validate

from .conftest import draw_images, make_samples

# ai-toolkit's config/examples/train_lora_flux_24gb.yaml, its comments dropped, paths filled in
AI_TOOLKIT = """
job: extension
config:
  name: "my_first_flux_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "{out}"
      device: cpu
      trigger_word: "p3r5on"
      network:
        type: "lora"
        linear: 16
        linear_alpha: 16
      save:
        dtype: float16
        save_every: 250
        max_step_saves_to_keep: 4
        push_to_hub: false
      datasets:
        - folder_path: "{data}"
          caption_ext: "txt"
          caption_dropout_rate: 0.05
          shuffle_tokens: false
          cache_latents_to_disk: true
          resolution: [ 512, 768, 1024 ]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false
        gradient_checkpointing: true
        noise_scheduler: "flowmatch"
        optimizer: "adamw8bit"
        lr: 1e-4
        ema_config:
          use_ema: true
          ema_decay: 0.99
        dtype: bf16
      model:
        name_or_path: "{model}"
        is_flux: true
        quantize: true
      sample:
        sampler: "flowmatch"
        sample_every: 250
        sample_start_step: 0
        width: 1024
        height: 1024
        prompts:
          - "woman with red hair, playing chess at the park, bomb going off in the background"
        neg: ""
        seed: 42
        walk_seed: true
        guidance_scale: 4
        sample_steps: 20
meta:
  name: "[name]"
  version: '1.0'
"""
IMAGE_ONLY = ("caption_ext", "caption_dropout_rate", "shuffle_tokens", "cache_latents_to_disk", "resolution")


@pytest.fixture
def files(tmp_path, flux_file):
    return tmp_path, make_samples(tmp_path / "data"), flux_file


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


def test_ai_toolkit_example_parses_with_an_image_folder_and_every_field_is_honoured(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images")
    cfg = load_config(_write(tmp_path, AI_TOOLKIT.format(out=tmp_path / "out", data=images, model=tiny_model)))
    assert cfg.name == "my_first_flux_lora_v1" and cfg.output_dir == os.path.join(str(tmp_path / "out"), cfg.name)
    assert cfg.trigger_word == "p3r5on" and cfg.sample.prompts == [
        "woman with red hair, playing chess at the park, bomb going off in the background"]
    d = cfg.datasets[0]
    assert (d.folder_path, d.caption_ext, d.caption_dropout_rate, d.shuffle_tokens, d.cache_latents_to_disk,
            d.resolution) == (images, "txt", 0.05, False, True, [512, 768, 1024])
    assert (cfg.network.type, cfg.network.linear, cfg.network.linear_alpha) == ("lora", 16, 16.0)
    assert cfg.train.lr == pytest.approx(1e-4)  # YAML 1.1 reads 1e-4 as a string
    assert (cfg.train.steps, cfg.train.optimizer, cfg.train.ema_config.use_ema) == (2000, "adamw8bit", True)
    assert cfg.model.name_or_path == tiny_model and cfg.model.quantize
    assert (cfg.sample.width, cfg.sample.sample_steps, cfg.sample.guidance_scale) == (1024, 20, 4.0)
    assert cfg.sample.walk_seed and cfg.sample.sampler == "flowmatch" and cfg.model.is_flux
    assert cfg.meta == {"name": "[name]", "version": "1.0"} and cfg.warnings == []


def test_an_ai_toolkit_file_without_network_says_it_trains_a_lora_where_ai_toolkit_would_fine_tune(tmp_path,
                                                                                               tiny_model):
    """ai-toolkit fine-tunes the whole model when its job file has no network section; FLAME keeps its LoRA
    default and says so, naming network: {type: full}. A FLAME mapping (no job / config.process) gets no note."""
    images = draw_images(tmp_path / "images")
    text = AI_TOOLKIT.format(out=tmp_path / "out", data=images, model=tiny_model).replace(
        '      network:\n        type: "lora"\n        linear: 16\n        linear_alpha: 16\n', "")
    assert "network" not in text
    cfg = load_config(_write(tmp_path, text))
    assert cfg.network.type == "lora" and any("network: {type: full}" in w for w in cfg.warnings)
    bare = config_from_dict({"name": "x", "training_folder": str(tmp_path), "device": "cpu",
                             "datasets": [{"folder_path": images}], "model": {"name_or_path": tiny_model}})
    assert bare.warnings == []


def test_ai_toolkit_example_on_precomputed_samples_lists_what_does_not_apply(files):
    tmp, data, model = files
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp, AI_TOOLKIT.format(out=tmp / "out", data=data, model=model)))
    msg = str(ei.value)
    assert "7 problems" in msg, msg
    for key in IMAGE_ONLY:
        assert f"config.process[0].datasets[0].{key}: only for image folders; {data} holds precomputed " \
               f"samples" in msg, key
    # the sample prompts need the text encoders, which a single transformer file does not name
    assert "config.process[0].model: clip_l: missing" in msg and "model: t5: missing" in msg
    assert "set model.clip_l_path (a CLIP text encoder (CLIP-L))" in msg


@pytest.mark.parametrize("where, key, value", [
    ("save", "push_to_hub", True),
    ("train", "linear_timesteps", True), ("sample", "neg", "blurry"), ("train", "blocks_to_swap", 18),
    ("train", "fused_backward_pass", True)])
def test_a_key_for_a_missing_feature_is_an_error_unless_it_asks_for_nothing(files, where, key, value):
    tmp, data, model = files
    base = {"datasets": [{"folder_path": data}]}

    def put(v):
        d = {"datasets": [{"folder_path": data}]}
        if where:
            d[where] = {key: v}
        else:
            d[key] = v
        return d
    with pytest.raises(ConfigError, match=rf"{key}: not available: "):
        config_from_dict(put(value))
    cfg = config_from_dict(put(False if isinstance(value, bool) else type(value)()))  # asks for nothing: fine
    assert cfg.warnings == [] and config_from_dict(base) is not None


@pytest.mark.parametrize("change, expect", [
    ({"trigger_word": "ohwx"}, "trigger_word: not used: this run has no captions"),
    ({"model": {"quantize_te": True}}, "model.quantize_te: not used: no text is encoded"),
    ({"model": {"t5_max_length": 64}}, "model.t5_max_length: not used: no text is encoded"),
    ({"model": {"tokenizer_path": "x"}}, "model.tokenizer_path: not used: no text is encoded"),
    ({"datasets": [{"shuffle_tokens": True}]}, "datasets[0].shuffle_tokens: only for image folders"),
    ({"datasets": [{"cache_latents": False}]}, "datasets[0].cache_latents: only True is accepted: FLAME always "
                                               "caches latents"),
    ({"synthetic": {}, "datasets": [], "sample": {"prompts": ["a cat"]}}, "sample.prompts: the synthetic dataset"),
    ({"synthetic": {}, "datasets": [], "model": {"vae_path": "ae.safetensors"}}, "model.vae_path: not used")])
def test_image_and_text_settings_on_a_run_without_them_are_errors(files, change, expect):
    tmp, data, model = files
    d = {"datasets": [{"folder_path": data}]}
    for k, v in change.items():
        if k == "datasets" and v:
            d["datasets"] = [{**d["datasets"][0], **v[0]}]
        else:
            d[k] = v
    with pytest.raises(ConfigError) as ei:
        config_from_dict(d)
    assert expect in str(ei.value), str(ei.value)
    cfg = config_from_dict({"datasets": [{"folder_path": data, "cache_latents": True}]})  # what FLAME does anyway
    assert cfg.datasets[0].folder_path == data


def test_the_lora_layout_defaults_to_one_comfyui_and_diffusers_both_read(files):
    # SD3: PEFT (diffusers 0.42 loads nothing from SD3 kohya files); Flux and SDXL: kohya (ComfyUI maps no SDXL PEFT
    # attention key); LoKr / LoHa: kohya, the one layout that holds them; a given format is kept
    tmp, data, model = files

    def fmt(arch, network=None, save=None):
        d = {"datasets": [{"folder_path": data}], "model": {"arch": arch}, "network": network or {},
             "save": save or {}}
        return config_from_dict(d, check_files=False).save.format
    assert (fmt("flux"), fmt("sd3"), fmt("sdxl")) == ("kohya", "peft", "kohya")
    assert fmt("sd3", network={"type": "lokr"}) == "kohya"
    assert fmt("sd3", save={"format": "kohya"}) == "kohya" and fmt("sdxl", save={"format": "peft"}) == "peft"


def test_ai_toolkit_keys_that_mean_something_are_checked(files):
    tmp, data, model = files
    base = {"datasets": [{"folder_path": data}]}
    for change, expect in [({"type": "extract"}, "type: 'extract' is not one of sd_trainer, diffusion_trainer"),
                           ({"model": {"is_flux": False}}, "model.is_flux: false contradicts model.arch 'flux'"),
                           ({"sample": {"sampler": "ddpm"}}, "sample.sampler: Flux previews use"),
                           ({"sample": {"scheduler": "normal"}}, "sample.scheduler: Flux previews space their "
                                                                 "sigmas as simple, karras, exponential, beta, got "
                                                                 "'normal'"),
                           ({"model": {"arch": "sd2"}}, "model.arch: unknown model arch 'sd2'")]:
        with pytest.raises(ConfigError, match=expect):
            config_from_dict({**base, **change})
    with pytest.raises(ConfigError, match="job: 'generate' is not a training job"):
        config_from_dict({"job": "generate", "config": {"process": [base]}})


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
    assert msg.startswith("run.yaml: 9 problems in the training config")


def test_null_and_non_finite_numbers_and_bad_optimizer_params_are_one_error(files, tmp_path):
    tmp, data, model = files
    text = f"""
datasets: [{{folder_path: {data}}}]
network: {{dropout: null}}
train:
  shift: null
  max_grad_norm: null
  lr: .inf
  sigmoid_scale: .nan
  timestep_type: shift
  ema_config: {{ema_decay: null}}
  optimizer_params: {{weight_decay: abc, betas: 0.9, eps: -1, momentum: 0.9}}
"""
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp_path, text))
    msg = str(ei.value)
    for piece in ("network.dropout: expected a number, got null", "train.shift: expected a number, got null",
                  "train.max_grad_norm: expected a number, got null", "train.lr: must be a finite number, got inf",
                  "train.sigmoid_scale: must be a finite number, got nan",
                  "train.ema_config.ema_decay: expected a number, got null",
                  "train.optimizer_params.weight_decay: expected a number, got 'abc'",
                  "train.optimizer_params.betas: expected two numbers such as [0.9, 0.999], got 0.9",
                  "train.optimizer_params.eps: must be > 0, got -1.0",
                  "train.optimizer_params.momentum: unknown; supported: weight_decay, betas, eps"):
        assert piece in msg, piece
    assert "10 problems" in msg, msg
    ok = config_from_dict({"datasets": [{"folder_path": data}],
                           "train": {"optimizer_params": {"weight_decay": "1e-2", "betas": [0.9, "0.99"]}}})
    assert ok.train.optimizer_params == {"weight_decay": 0.01, "betas": [0.9, 0.99]}


def test_dataset_files_are_checked_against_the_model_header_before_anything_is_loaded(tmp_path, flux_file):
    wrong = make_samples(tmp_path / "wrong", txt=(8, 40))          # flux-tiny's context is 32
    odd = make_samples(tmp_path / "odd", h=5)
    (tmp_path / "odd" / "0009.safetensors").write_bytes(b"\x05")
    with pytest.raises(ConfigError) as ei:
        config_from_dict({"model": {"name_or_path": flux_file},
                          "datasets": [{"folder_path": wrong}, {"folder_path": odd}]})
    msg = str(ei.value)
    assert "datasets[0].folder_path: 0000.safetensors: prompt_embeds (8, 40): expected (L, 32) for this model" in msg
    assert "datasets[1].folder_path: 0000.safetensors: latents (16, 5, 4): expected (16, h, w) with even h and w" \
        in msg
    assert "datasets[1].folder_path: 0009.safetensors: not a readable .safetensors file" in msg


def test_contradictory_and_misplaced_settings(files):
    tmp, data, model = files
    base = {"datasets": [{"folder_path": data}]}
    cases = [
        ({"network": {"type": "lokr"}, "save": {"format": "peft"}}, "'peft' cannot hold lokr"),
        ({"train": {"steps": 10, "lr_warmup_steps": 10}}, "leave nothing of 10 steps"),
        ({"train": {"train_text_encoder": True}}, "the flux family cannot train its text encoders"),
        ({"train": {"noise_scheduler": "ddpm"}}, "Flux trains with 'flowmatch'"),
        ({"network": {"dropout": 1.5}}, "network.dropout: must be in [0, 1)"),
        ({"network": {"target": []}}, "network.target"),
        ({"network": {"network_kwargs": {"only_if": ["x"]}}}, "network_kwargs.only_if: unknown"),
        ({"datasets": []}, "datasets: no dataset"),
        ({"device": "tpu"}, "device: 'cpu', 'cuda' or 'cuda:N'"),
        ({"train": {"gradient_checkpointing": "yes"}}, "expected true or false"),
        ({"train": {"shift": 2.0}}, "train.shift: only used by timestep_type shift (the type is 'sigmoid')"),
        ({"train": {"logit_mean": 0.5}}, "train.logit_mean: only used by timestep_type logit_normal"),
        ({"train": {"timestep_type": "uniform", "sigmoid_scale": 2}}, "train.sigmoid_scale: only used by"),
        ({"network": {"lokr_factor": 4}}, "network.lokr_factor: only used by network type 'lokr'"),
        ({"network": {"type": "loha", "dropout": 0.1}}, "loha adapters have no input dropout"),
        ({"model": {"name_or_path": model, "size": "flux-dev"}}, "model.size: a random-init preset"),
        ({"sample": {"num_samples": 3, "prompt_embeds": [data + "/0000.safetensors"]}}, "sample.num_samples: picks"),
        ({"synthetic": {"num_samples": 4}}, "synthetic: given together with datasets"),
        ({"name": "a/b"}, "name: a non-empty name without"),
        ({"log_every": 0}, "log_every: must be >= 1"),
    ]
    for change, expect in cases:
        with pytest.raises(ConfigError) as ei:
            config_from_dict({**base, **change})
        assert expect in str(ei.value), (change, str(ei.value))


def test_logit_normal_takes_its_mean_and_std(files):
    tmp, data, model = files
    cfg = config_from_dict({"datasets": [{"folder_path": data}],
                            "train": {"timestep_type": "logit_normal", "logit_mean": 1.5, "logit_std": 0.5}})
    from flame_core import Generator
    from flame_models.training import get_family
    obj = get_family("flux").objective(cfg.train)
    s = obj.sample_timesteps(20000, generator=Generator("cpu").manual_seed(0), num_tokens=16, device="cpu").numpy()
    logit = np.log(s) - np.log1p(-s)
    assert abs(logit.mean() - 1.5) < 0.02 and abs(logit.std() - 0.5) < 0.02


def test_empty_folder_and_yaml_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds neither images nor precomputed samples"):
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
                            "datasets": [{"folder_path": data}], "train": {"optimizer": "adamw"}})
    assert (cfg.name, cfg.network.linear, cfg.network.linear_alpha, cfg.train.optimizer) == ("flat", 8, 4.0, "adamw")
    assert {"network.linear", "network.linear_alpha", "train.optimizer", "datasets", "name"} <= cfg.given
    with pytest.raises(ConfigError, match="given twice"):
        config_from_dict({"network": {"rank": 8, "linear": 4}, "datasets": [{"folder_path": data}]})


def test_defaults_need_only_a_dataset():
    assert validate(TrainConfig(), check_files=False) == [
        "datasets: no dataset (give datasets: [{folder_path: ...}] or synthetic: {...})"]


def test_model_quantize_takes_fp8_names_and_fp8_compute_needs_it(files):
    tmp, data, model = files
    base = {"datasets": [{"folder_path": data}]}
    for value in (True, "fp8", "qfloat8", "FP8"):
        cfg = config_from_dict({**base, "model": {"quantize": value}, "train": {"fp8_compute": True}})
        assert cfg.model.quantize is True and cfg.train.fp8_compute is True
    assert config_from_dict(base).model.quantize is False and config_from_dict(base).train.fp8_compute is False
    with pytest.raises(ConfigError, match="model.quantize: true, false or 'fp8'.*got 'int8'"):
        config_from_dict({**base, "model": {"quantize": "int8"}})
    with pytest.raises(ConfigError, match="train.fp8_compute: computes with the fp8 weights of model.quantize"):
        config_from_dict({**base, "train": {"fp8_compute": True}})
    # every adapter kind trains on fp8 weights (DoRA reads the base rows dequantised)
    for kind in ("lora", "locon", "dora", "lokr", "loha"):
        assert config_from_dict({**base, "model": {"quantize": "fp8"}, "network": {"type": kind}}).model.quantize
    # ai-toolkit's pair: quantize: true with qtype qfloat8 (its default); another qtype asks for what FLAME lacks
    assert config_from_dict({**base, "model": {"quantize": True, "qtype": "qfloat8"}}).model.quantize is True
    with pytest.raises(ConfigError, match="model.qtype: FLAME quantises the frozen weights to fp8.*'qint4'"):
        config_from_dict({**base, "model": {"quantize": True, "qtype": "qint4"}})
    # train.checkpoint_save: none (default) or attention (selective checkpointing: the attention outputs kept)
    assert config_from_dict(base).train.checkpoint_save == "none"
    assert config_from_dict({**base, "train": {"checkpoint_save": "attention"}}).train.checkpoint_save == "attention"
    with pytest.raises(ConfigError, match="train.checkpoint_save: 'none' or 'attention', got 'mlp'"):
        config_from_dict({**base, "train": {"checkpoint_save": "mlp"}})
    with pytest.raises(ConfigError, match="train.checkpoint_save: 'attention' is what checkpointed blocks keep; set "
                                          "train.gradient_checkpointing: true"):
        config_from_dict({**base, "train": {"checkpoint_save": "attention", "gradient_checkpointing": False}})
    # train.fp8_scaling: current (default) or delayed, the latter only with fp8 compute
    fp8c = {**base, "model": {"quantize": "fp8"}, "train": {"fp8_compute": True}}
    assert config_from_dict(fp8c).train.fp8_scaling == "current"
    assert config_from_dict({**fp8c, "train": {"fp8_compute": True, "fp8_scaling": "delayed"}}).train.fp8_scaling \
        == "delayed"
    with pytest.raises(ConfigError, match="train.fp8_scaling: 'current' or 'delayed', got 'lazy'"):
        config_from_dict({**fp8c, "train": {"fp8_compute": True, "fp8_scaling": "lazy"}})
    with pytest.raises(ConfigError, match="train.fp8_scaling: 'delayed' scales the activations of fp8 compute"):
        config_from_dict({**base, "model": {"quantize": "fp8"}, "train": {"fp8_scaling": "delayed"}})


def test_fp8_cache_transposes_takes_auto_true_false_and_auto_resolves_to_fp8_compute_without_a_budget(files):
    from flame_models.training.config import fp8_cache_transposes_on
    tmp, data, model = files
    base = {"datasets": [{"folder_path": data}]}
    fp8c = {**base, "model": {"quantize": "fp8"}}

    def train(**kw):
        return config_from_dict({**fp8c, "train": kw}).train
    assert config_from_dict(base).train.fp8_cache_transposes == "auto"    # the default (measured faster on the GPU)
    for value, want in (("auto", "auto"), ("AUTO", "auto"), (True, True), ("true", True), (False, False),
                        ("False", False)):
        assert train(fp8_compute=True, fp8_cache_transposes=value).fp8_cache_transposes == want
    for bad in ("yes", 1, None, ["auto"]):
        with pytest.raises(ConfigError, match="train.fp8_cache_transposes: 'auto', true or false, got"):
            train(fp8_compute=True, fp8_cache_transposes=bad)
    with pytest.raises(ConfigError, match="train.fp8_cache_transposes: true keeps the transposed fp8 weights of fp8 "
                                          "compute; set train.fp8_compute: true"):
        train(fp8_cache_transposes=True)
    assert train(fp8_cache_transposes=False).fp8_cache_transposes is False   # off needs nothing
    # auto: fp8 compute and no max_gpu_memory; true / false as given (true under a budget: the resident blocks')
    assert fp8_cache_transposes_on(train(fp8_compute=True), budget=None) is True           # the default: auto
    auto = dict(fp8_compute=True, fp8_cache_transposes="auto")
    assert fp8_cache_transposes_on(train(**auto), budget=None) is True
    assert fp8_cache_transposes_on(train(**auto), budget=2**30) is False
    assert fp8_cache_transposes_on(train(fp8_cache_transposes="auto"), budget=None) is False
    assert fp8_cache_transposes_on(train(fp8_compute=True, fp8_cache_transposes=True), budget=2**30) is True
    assert fp8_cache_transposes_on(train(fp8_compute=True, fp8_cache_transposes=False), budget=None) is False


@pytest.mark.parametrize("arch", ["flux", "flux_kontext", "chroma", "sd3", "qwen_image"])
def test_quantize_te_is_taken_by_every_family_with_a_large_text_encoder(arch):
    """model.quantize_te (T5's, or Qwen-Image's Qwen2.5-VL's, Linears in fp8; ai-toolkit's key): Qwen-Image's family
    read it but its config refused it."""
    cfg = config_from_dict({"model": {"arch": arch, "quantize_te": True}, "synthetic": {}}, check_files=False)
    assert cfg.model.quantize_te is True


def test_low_vram_is_a_memory_hint_said_not_used(files):
    """ai-toolkit's model.low_vram (its memory placement; the Qwen-Image example sets it): a warning that names
    max_gpu_memory, nothing when false."""
    tmp, data, model = files
    cfg = config_from_dict({"datasets": [{"folder_path": data}], "model": {"low_vram": True}})
    assert cfg.warnings == ["model.low_vram: not used: FLAME places a run's memory by max_gpu_memory (give it to "
                            "bound the GPU's)"]
    assert config_from_dict({"datasets": [{"folder_path": data}], "model": {"low_vram": False}}).warnings == []


def test_short_side_buckets_train_and_are_refused_under_a_budget(tmp_path):
    """datasets' resolution_mode short_side (SimpleTuner's resolution_type pixel) trains; under max_gpu_memory it is
    refused: its buckets vary in area, and auto-fit measures one step."""
    from .conftest import image_config
    images = draw_images(tmp_path / "img")
    ds = {"folder_path": images, "resolution": 64, "bucket_tolerance": 32, "resolution_mode": "short_side"}
    with pytest.raises(ConfigError, match=r"datasets\[0\].resolution_mode: short_side buckets hold up to max_aspect"):
        image_config(tmp_path, "budget", None, images, datasets=[ds], max_gpu_memory="4GiB",
                     model={"name_or_path": None})
    image_config(tmp_path, "square", None, images, datasets=[dict(ds, max_aspect=1)], max_gpu_memory="4GiB",
                 model={"name_or_path": None})   # (square buckets: one area)
    from flame_models.training.trainer import Trainer
    result = Trainer(image_config(tmp_path, "edge", None, images, steps=2, datasets=[ds],
                                  model={"name_or_path": None}), verbose=False).train()
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
