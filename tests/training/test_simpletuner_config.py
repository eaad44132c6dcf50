"""SimpleTuner's config.json and the multidatabackend.json it names read as a FLAME run (--simpletuner-config): each
option to its FLAME setting with SimpleTuner's defaults where one is absent, each backend to a dataset, notes for
what changes nothing, and an error naming the file and key for everything FLAME would not apply; then a run trains
from it."""
import json
import os
import re

import pytest

from flame_models import train
from flame_models.training.config import ConfigError
from flame_models.training.simpletuner_config import FLUX_TARGETS, read_simpletuner_config
from flame_models.training.trainer import Trainer

from .conftest import draw_images

# SimpleTuner's flux.peft-lora example (simpletuner/examples), its data backend beside it, with some keys written the
# way its config/config.json.example writes them ("--" and strings)
CONFIG = {
    "--base_model_precision": "fp8-torchao", "checkpoint_step_interval": 10, "controlnet": False,
    "data_backend_config": "multidatabackend.json", "disable_bucket_pruning": True, "flow_schedule_shift": 3,
    "fuse_qkv_projections": False, "grad_clip_method": "value", "gradient_checkpointing": True,
    "hub_model_id": "simpletuner-example-flux-peft-lora", "--learning_rate": "1e-4", "lora_alpha": 16,
    "lora_rank": 16, "lora_type": "standard", "lr_scheduler": "constant", "max_train_steps": 100,
    "mixed_precision": "bf16", "model_family": "flux", "model_type": "lora", "num_eval_images": 25,
    "num_train_epochs": 0, "optimizer": "adamw_bf16", "output_dir": "output/examples/flux.peft-lora",
    "push_checkpoints_to_hub": False, "push_to_hub": "false", "quantize_via": "cpu", "report_to": "none",
    "seed": 42, "tracker_project_name": "lora-training", "train_batch_size": 1, "use_ema": False,
    "vae_batch_size": 1, "validation_disable_unconditional": True, "validation_guidance": 4.0,
    "validation_guidance_rescale": 0.0, "validation_negative_prompt": "ugly, cropped",
    "validation_num_inference_steps": 16, "validation_prompt": "a photo of ohwx", "validation_prompt_library": False,
    "validation_resolution": "1024x768", "validation_seed": 42, "validation_steps": 50,
}
BACKENDS = [
    {"id": "subject", "type": "local", "instance_data_dir": "{images}", "caption_strategy": "textfile",
     "resolution": 1024, "resolution_type": "pixel_area", "minimum_image_size": 1024, "repeats": 2,
     "cache_dir_vae": "cache/vae/flux/subject", "crop": False},
    {"id": "text-embeds", "dataset_type": "text_embeds", "default": True, "type": "local",
     "cache_dir": "cache/text/flux"},
]


def _write(tmp_path, config=None, backends=None, images="/data/images"):
    folder = tmp_path / "st"
    folder.mkdir(exist_ok=True)
    (folder / "multidatabackend.json").write_text(json.dumps(
        [{k: (v.format(images=images) if isinstance(v, str) else v) for k, v in b.items()}
         for b in (BACKENDS if backends is None else backends)]))
    path = folder / "config.json"
    path.write_text(json.dumps(CONFIG if config is None else config))
    return str(path)


def test_each_option_maps_to_its_setting(tmp_path):
    proc, notes = read_simpletuner_config(_write(tmp_path))
    assert proc["model"] == {"name_or_path": "black-forest-labs/flux.1-krea-dev", "arch": "flux", "quantize": "fp8"}
    assert (proc["training_folder"], proc["name"]) == (os.path.normpath("output/examples"), "flux.peft-lora")
    assert proc["network"] == {"type": "lora", "linear": 16, "linear_alpha": 16, "dropout": 0.1,
                               "target": FLUX_TARGETS["all"]}                      # (lora_dropout's default 0.1)
    t = proc["train"]
    assert (t["lr"], t["optimizer"], t["optimizer_params"]) == (1e-4, "adamw", {"betas": (0.9, 0.999),
                                                                                "weight_decay": 1e-2, "eps": 1e-6})
    assert (t["lr_scheduler"], t["lr_warmup_steps"], t["max_grad_value"], t["max_grad_norm"]) == \
        ("constant", 0, 2.0, 0.0)                     # SimpleTuner clips by value at its default max_grad_norm 2.0
    assert (t["steps"], t["batch_size"], t["gradient_checkpointing"], t["seed"], t["dtype"]) == \
        (100, 1, True, 42, "bf16")
    assert (t["timestep_type"], t["shift"], t["sigmoid_scale"]) == ("shift", 3, 1.0)
    assert "epochs" not in t and "ema_config" not in t
    assert proc["save"] == {"save_every": 10, "max_step_saves_to_keep": 5}
    assert proc["sample"] == {"prompts": ["a photo of ohwx"], "sample_every": 50, "sample_steps": 16,
                              "guidance_scale": 4.0, "seed": 42, "width": 1024, "height": 768}
    assert proc["datasets"] == [{"folder_path": "/data/images", "num_repeats": 3, "caption_ext": "txt",
                                 "caption_lines": "random", "caption_dropout_rate": 0.1, "resolution": 1024}]
    said = "\n".join(notes)
    for words in ("model_flavour: krea: the model is black-forest-labs/flux.1-krea-dev",
                  "base_model_precision: fp8-torchao: FLAME stores the blocks' weights in fp8",
                  "vae_batch_size: not used", "hub_model_id: a Hub setting: not used without push_to_hub",
                  "tracker_project_name: not used in this configuration",
                  "validation_negative_prompt: Flux's previews take no negative prompt",
                  "a text_embeds backend", "cache_dir_vae: FLAME caches latents itself",
                  "minimum_image_size 1024: FLAME leaves out each image smaller than its bucket",
                  "num_eval_images: no eval backend: not used"):
        assert words in said, words


def test_simpletuners_defaults_fill_what_the_file_leaves_out(tmp_path):
    """A bare config: SimpleTuner's learning rate (4e-7), batch size (4), schedule (constant_with_warmup), LoRA alpha
    (= the rank), caption dropout (0.1), resolution (1024 pixel_area) and filename captions with upscaling."""
    cfg = {"model_family": "sdxl", "model_type": "lora", "optimizer": "bnb-adamw8bit", "output_dir": "out",
           "data_backend_config": "multidatabackend.json", "max_train_steps": 10, "num_train_epochs": 0,
           "lora_rank": 8, "seed": 1, "grad_clip_method": "norm", "max_grad_norm": 1.5}
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg, [{"id": "a", "instance_data_dir": "/d"}]))
    assert proc["model"] == {"name_or_path": "stabilityai/stable-diffusion-xl-base-1.0", "arch": "sdxl"}
    t = proc["train"]
    assert (t["lr"], t["batch_size"], t["lr_scheduler"], t["optimizer"], t["max_grad_norm"]) == \
        (4e-7, 4, "constant_with_warmup", "adamw8bit", 1.5)
    assert "timestep_type" not in t and "max_grad_value" not in t                    # (SDXL: DDPM timesteps)
    assert proc["network"]["linear_alpha"] == 8 and proc["network"]["target"] == ["to_q", "to_k", "to_v", "to_out.0"]
    assert proc["datasets"] == [{"folder_path": "/d", "caption_from": "filename", "caption_dropout_rate": 0.1,
                                 "resolution": 1024, "allow_upscale": True}]
    assert proc["sample"] == {"sample_every": 0} and any("validation_prompt: none: no previews" in n for n in notes)


def test_backends_captions_crops_sizes_and_kontext_pairs(tmp_path):
    cfg = dict(CONFIG, model_flavour="kontext", caption_dropout_probability=0.0)
    del cfg["--base_model_precision"]
    backends = [
        {"id": "edits", "instance_data_dir": "/e", "caption_strategy": "instanceprompt",
         "instance_prompt": "make it red", "resolution": 1.0, "resolution_type": "area", "crop": True,
         "crop_style": "center", "conditioning_data": "refs"},
        {"id": "refs", "dataset_type": "conditioning", "conditioning_type": "reference_strict",
         "instance_data_dir": "/r"},
        {"id": "more", "instance_data_dir": "/m", "caption_strategy": "filename", "prepend_instance_prompt": True,
         "instance_prompt": "ohwx", "crop": True, "crop_aspect": "preserve", "resolution": 512,
         "conditioning_data": ["refs"], "disable_multiline_split": True},
        {"id": "off", "instance_data_dir": "/x", "disabled": True},
    ]
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg, backends))
    assert proc["model"]["arch"] == "flux_kontext" and proc["model"]["name_or_path"].endswith("flux.1-kontext-dev")
    assert proc["datasets"] == [
        {"folder_path": "/e", "caption_from": "default_caption", "default_caption": "make it red", "resolution": 1024,
         "max_aspect": 1.0, "allow_upscale": True, "control_path": "/r"},
        {"folder_path": "/m", "caption_from": "filename", "caption_prefix": "ohwx", "resolution": 512,
         "random_crop": True, "allow_upscale": True, "control_path": "/r"}]
    said = "\n".join(notes)
    # 1 MP: a 1000 px side, to the nearest multiple of 64
    assert "(edits): resolution 1.0 megapixels: buckets of 1024² pixels (1.049 MP" in said
    assert "(off): disabled: skipped" in said


def test_lycoris_schnell_and_the_cli(tmp_path):
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "lycoris_config.json").write_text(json.dumps(   # (SimpleTuner's SDXL LoKr example's, + one)
        {"bypass_mode": True, "algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16,
         "full_matrix": True, "apply_preset": {"target_module": ["Attention"],
                                               "module_algo_map": {"Attention": {"factor": 12}}}}))
    cfg = dict(CONFIG, lora_type="lycoris", lycoris_config="lycoris_config.json", model_family="sdxl",
               lr_scheduler="polynomial", lr_power=1.0, optimizer_config="weight_decay=0.0,eps=1e-8",
               optimizer_beta2=0.99, use_ema="true", ema_decay=0.999, report_to="tensorboard",
               validation_lycoris_strength=0.8)
    del cfg["--base_model_precision"]
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg))
    assert proc["network"] == {"type": "lokr", "linear": 10000, "linear_alpha": 1, "lokr_factor": 12,
                               "lokr_full_rank": True, "target": ["to_q", "to_k", "to_v", "to_out.0"]}
    assert proc["sample"]["network_multiplier"] == 0.8 and any("bypass_mode: LyCORIS's" in n for n in notes)
    t = proc["train"]
    assert t["lr_scheduler_params"] == {"lr_end": 4e-7, "power": 1.0}
    assert t["optimizer_params"] == {"betas": (0.9, 0.99), "weight_decay": 0.0, "eps": 1e-8}
    assert t["ema_config"] == {"use_ema": True, "ema_decay": 0.999} and proc["logging"] == {"use_tensorboard": True}
    schnell = dict(CONFIG, model_flavour="schnell")
    proc, notes = read_simpletuner_config(_write(tmp_path, schnell))
    assert proc["model"]["assistant_lora_path"] == "ostris/FLUX.1-schnell-training-adapter"
    with pytest.raises(ConfigError, match="--config, --kohya-config and --simpletuner-config each give"):
        train.build_config(train.parser().parse_args(["--simpletuner-config", "a.json", "--config", "b.yaml"]))
    for flag, names in (("--simpletuner-config", "data_backend_config"), ("--kohya-config", "dataset_config")):
        with pytest.raises(ConfigError, match=f"--dataset-config: {flag} names its {names}; give it there"):
            train.build_config(train.parser().parse_args([flag, "a", "--dataset-config", "d.toml"]))


@pytest.mark.parametrize("change, words", [
    ({"push_to_hub": True}, "push_to_hub: FLAME does not upload"),
    ({"--base_model_precision": "int8-quanto"}, "base_model_precision: 'int8-quanto': FLAME stores weights in fp8"),
    ({"quantize_activations": True}, "quantize_activations: FLAME quantises weights only"),
    ({"strict_epoch_limit": "true"}, "strict_epoch_limit: with max_train_steps"),
    ({"lr_scheduler": "cosine"}, "lr_scheduler: 'cosine': FLAME follows SimpleTuner's constant"),
    ({"optimizer": "prodigy"}, "optimizer: 'prodigy': FLAME has adamw_bf16"),
    ({"tread_config": {"routes": []}}, "tread_config: not supported by FLAME's SimpleTuner reader"),
    ({"model_family": "pixart"}, "model_family: 'pixart': FLAME trains flux, sd3, sdxl, chroma, qwen_image"),
    ({"num_train_epochs": 2}, "num_train_epochs: 2 with max_train_steps 100: SimpleTuner refuses both"),
    ({"flux_guidance_mode": "mobius"}, "flux_guidance_mode: 'mobius': FLAME trains Flux at one guidance value"),
    ({"flux_guidance_mode": "random-range", "flux_guidance_min": 3, "flux_guidance_max": 1},
     "flux_guidance_max: 1 is below flux_guidance_min 3"),
    ({"validation_resolution": "1024x1024,512x512"}, "validation_resolution: one WxH or N"),
    ({"model_flavour": "edit-v1", "model_family": "qwen_image"}, "model_flavour: 'edit-v1': FLAME reads qwen_image's"),
    ({"flux_lora_target": "ai-toolkit"}, "flux_lora_target: 'ai-toolkit': FLAME reads all, context"),
    ({"lora_rank": "16.5"}, "lora_rank: an integer >= 1, got '16.5'"),
    ({"max_train_steps": "many"}, "max_train_steps: an integer >= 0, got 'many'"),
    ({"model_type": None}, "model_type: lora or full"),
    ({"validation_guidance_real": 0.5}, "validation_guidance_real: a number >= 1, got 0.5"),
    ({"validation_guidance_real": 3, "model_family": "sdxl"}, "validation_guidance_real: real CFG is for Flux's"),
    ({"validation_guidance_real": 3, "validation_no_cfg_until_timestep": -1},
     "validation_no_cfg_until_timestep: an integer >= 0, got -1"),
])
def test_what_flame_would_not_apply_is_named(tmp_path, change, words):
    cfg = dict(CONFIG)
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(ConfigError) as e:
        read_simpletuner_config(_write(tmp_path, cfg))
    assert words in str(e.value) and "config.json" in str(e.value)


def test_validation_guidance_rescale_is_sdxls(tmp_path):
    sdxl = dict(CONFIG, model_family="sdxl", validation_guidance_rescale=0.7)
    sdxl.pop("--base_model_precision")
    proc, _ = read_simpletuner_config(_write(tmp_path, sdxl))
    assert proc["sample"]["guidance_rescale"] == 0.7
    for change, words in (({"validation_guidance_rescale": 0.7}, "FLAME rescales SDXL's previews' guidance; the flux"),
                          ({"validation_guidance_rescale": 1.5, "model_family": "sdxl"}, "a number in [0, 1]")):
        with pytest.raises(ConfigError) as e:
            read_simpletuner_config(_write(tmp_path, dict(CONFIG, **change)))
        assert "validation_guidance_rescale: " + words in str(e.value)


def test_resolution_type_pixel_keeps_the_shorter_side(tmp_path):
    b = dict(BACKENDS[0], resolution_type="pixel", resolution=768, minimum_image_size=768)
    proc, _ = read_simpletuner_config(_write(tmp_path, backends=[b, BACKENDS[1]]))
    d = proc["datasets"][0]
    assert (d["resolution"], d["resolution_mode"]) == (768, "short_side")
    proc, _ = read_simpletuner_config(_write(tmp_path))
    assert "resolution_mode" not in proc["datasets"][0]              # pixel_area: FLAME's area buckets


def test_real_cfg_is_the_flux_previews_true_cfg(tmp_path):
    """validation_guidance_real > 1: true CFG against validation_negative_prompt from step
    validation_no_cfg_until_timestep (SimpleTuner's default 2) on; 1 (the default) runs none."""
    proc, _ = read_simpletuner_config(_write(tmp_path, dict(CONFIG, validation_guidance_real=4)))
    smp = proc["sample"]
    assert (smp["true_cfg"], smp["true_cfg_start"], smp["neg"], smp["guidance_scale"]) == (4.0, 2, "ugly, cropped",
                                                                                          4.0)
    proc, _ = read_simpletuner_config(_write(tmp_path, dict(CONFIG, validation_guidance_real="1.5",
                                                            validation_no_cfg_until_timestep=0)))
    assert (proc["sample"]["true_cfg"], proc["sample"]["true_cfg_start"]) == (1.5, 0)
    proc, notes = read_simpletuner_config(_write(tmp_path, dict(CONFIG, validation_no_cfg_until_timestep=3)))
    assert not {"true_cfg", "true_cfg_start", "neg"} & set(proc["sample"])
    assert any("validation_no_cfg_until_timestep: no real CFG" in n for n in notes)


@pytest.mark.parametrize("backend, words", [
    ({"type": "aws"}, "type 'aws': FLAME reads local folders"),
    ({"probability": 0.5}, "probability 0.5: FLAME draws every image"),
    ({"resolution_type": "edge"}, "resolution_type 'edge': FLAME reads pixel_area, area (megapixels) and pixel"),
    ({"resolution_type": "pixel", "resolution": 1000}, "resolution 1000: FLAME's buckets are multiples of 64 px"),
    ({"caption_strategy": "parquet"}, "caption_strategy 'parquet'"),
    ({"minimum_image_size": 512}, "minimum_image_size 512: FLAME either upscales"),
    ({"crop": True, "crop_aspect": "random"}, "crop_aspect 'random'"),
    ({"crop": True, "vae_cache_clear_each_epoch": True}, "vae_cache_clear_each_epoch with random crops"),
    ({"repeats": -1}, "repeats: an integer >= 0"),
    ({"instance_data_dir": None}, "instance_data_dir: required"),
    ({"caption_filter_list": "x.txt"}, "caption_filter_list: not supported"),
    ({"conditioning_data": "nope"}, "conditioning_data 'nope': names no conditioning backend"),
])
def test_backend_problems_are_named(tmp_path, backend, words):
    b = dict(BACKENDS[0], **backend)
    b = {k: v for k, v in b.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        read_simpletuner_config(_write(tmp_path, backends=[b]))
    assert words in str(e.value) and "multidatabackend.json backend #1 (subject)" in str(e.value)


def test_a_run_trains_from_it(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images", n_concept=2, n_other=2)
    cfg = {"model_family": "flux", "model_type": "lora", "pretrained_model_name_or_path": tiny_model,
           "optimizer": "optimi-adamw", "learning_rate": 1e-3, "lora_rank": 4, "max_train_steps": 2,
           "num_train_epochs": 0, "train_batch_size": 2, "mixed_precision": "no", "output_dir": str(tmp_path / "out"),
           "data_backend_config": "multidatabackend.json", "checkpoint_step_interval": 2, "seed": 3}
    backends = [{"id": "a", "instance_data_dir": images, "caption_strategy": "textfile", "resolution": 64}]
    path = _write(tmp_path, cfg, backends)
    config, demo, notes = train.build_config(train.parser().parse_args(["--simpletuner-config", path, "--device",
                                                                        "cpu"]))
    assert not demo and config.name == "out" and config.train.max_grad_value == 2.0 and config.network.linear == 4
    assert config.datasets[0].allow_upscale and config.datasets[0].caption_lines == "random"
    tr = Trainer(config, verbose=False)
    result = tr.train()
    assert len(result["losses"]) == 2 and all(v == v for v in result["losses"])
    assert os.path.isfile(result["lora"])


@pytest.mark.parametrize("lycoris, words", [
    ({"algo": "full"}, "algo 'full': FLAME trains lora, locon, loha, lokr"),
    ({"algo": "lokr", "multiplier": 0.5}, "multiplier 0.5: FLAME's adapters train at weight 1"),
    ({"algo": "lokr", "apply_preset": {"target_module": ["Attention", "FeedForward"]}},
     "apply_preset: FLAME reads target_module [\"Attention\"]"),
    ({"algo": "lokr", "use_tucker": True}, "use_tucker: not supported"),
])
def test_lycoris_configs_flame_would_not_apply_are_named(tmp_path, lycoris, words):
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "lycoris_config.json").write_text(json.dumps(lycoris))
    cfg = dict(CONFIG, lora_type="lycoris", lycoris_config="lycoris_config.json")
    with pytest.raises(ConfigError) as e:
        read_simpletuner_config(_write(tmp_path, cfg))
    assert words in str(e.value) and "lycoris_config" in str(e.value)


def test_its_config_toml_reads_as_its_config_json(tmp_path):
    path = _write(tmp_path)
    toml = tmp_path / "st" / "config.toml"
    lines = []
    for k, v in CONFIG.items():
        lines.append(f'"{k}" = ' + (json.dumps(v) if not isinstance(v, bool) else str(v).lower()))
    toml.write_text("\n".join(lines) + "\n")
    assert read_simpletuner_config(str(toml))[0] == read_simpletuner_config(path)[0]


def test_an_eval_backend_is_the_validation_loss(tmp_path):
    backends = [dict(BACKENDS[0], instance_data_dir="/train"),
                {"id": "held", "dataset_type": "eval", "instance_data_dir": "/held", "caption_strategy": "textfile",
                 "resolution": 1024, "minimum_image_size": 1024}]
    cfg = dict(CONFIG, eval_steps_interval=25, num_eval_images=4)
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg, backends))
    assert proc["validation"] == {"folder_path": "/held", "every": 25, "timesteps": 28, "seed": 0, "max_batches": 4}
    assert [d["folder_path"] for d in proc["datasets"]] == ["/train"]
    assert any("eval_timesteps: 28 evenly spaced timesteps" in n for n in notes)
    # without an interval SimpleTuner does not evaluate: nor does FLAME
    proc, notes = read_simpletuner_config(_write(tmp_path, CONFIG, backends))
    assert "validation" not in proc and any("eval_steps_interval: not set" in n for n in notes)
    # the held-out images are read with the first backend's caption and bucket settings
    backends[1]["caption_strategy"] = "filename"
    with pytest.raises(ConfigError, match=r"\(held\): FLAME reads the held-out images with the first image backend's "
                                          r"caption and bucket settings; this one differs in caption_ext, "
                                          r"caption_from, caption_lines"):
        read_simpletuner_config(_write(tmp_path, cfg, backends))
    with pytest.raises(ConfigError, match="2 eval backends"):
        read_simpletuner_config(_write(tmp_path, cfg, backends + [dict(backends[1], id="again")]))


def test_memory_and_speed_settings_are_notes(tmp_path):
    cfg = dict(CONFIG, vae_cache_ondemand=True, gradient_checkpointing_interval=2,
               conditioning_multidataset_sampling="random")
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg))
    said = "\n".join(notes)
    assert proc == read_simpletuner_config(_write(tmp_path, CONFIG))[0]       # nothing else changed
    for words in ("vae_cache_ondemand: FLAME encodes every image once", "gradient_checkpointing_interval: FLAME "
                  "checkpoints every block", "conditioning_multidataset_sampling: FLAME pairs each edit"):
        assert words in said, words


def test_text_encoder_precisions_and_the_default_dtype(tmp_path):
    cfg = dict(CONFIG, text_encoder_1_precision="no_change", text_encoder_2_precision="fp8-torchao",
               base_model_default_dtype="fp32")
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg))
    assert proc["model"]["quantize_te"] is True and proc["model"]["dtype"] == "fp32"
    assert any("text_encoder_2_precision: fp8-torchao: FLAME stores the text encoder's Linear weights in fp8" in n
               for n in notes)
    for key, value, words in (("text_encoder_1_precision", "fp8-torchao", "stores this text encoder as it is"),
                              ("text_encoder_2_precision", "int8-quanto", "in fp8 (any fp8-*) or as it is"),
                              ("base_model_default_dtype", "fp16", "bf16 or fp32, got 'fp16'")):
        with pytest.raises(ConfigError, match=rf"{key}: .*{re.escape(words)}"):
            read_simpletuner_config(_write(tmp_path, dict(CONFIG, **{key: value})))


def test_regularisation_data_trains_toward_the_adapter_free_model(tmp_path):
    b = dict(BACKENDS[0], is_regularisation_data=True)
    proc, notes = read_simpletuner_config(_write(tmp_path, backends=[dict(BACKENDS[0], instance_data_dir="/a"), b]))
    assert "prior_reg" not in proc["datasets"][0] and proc["datasets"][1]["prior_reg"] is True
    assert "is_reg" not in proc["datasets"][1]                  # (drawn with the others, as SimpleTuner samples it)
    assert any("is_regularisation_data: these images train toward the model's own prediction" in n for n in notes)
    proc, notes = read_simpletuner_config(_write(tmp_path, dict(CONFIG, model_type="full"), [b]))
    assert "prior_reg" not in proc["datasets"][0] and any("with model_type full: trained like" in n for n in notes)


def test_an_option_unused_in_this_configuration_is_a_note(tmp_path):
    """lora_rank in a full fine-tune, the validation settings without a prompt: SimpleTuner leaves them unused,
    and so does FLAME, saying so; an option it does not know stays an error."""
    cfg = dict(CONFIG, model_type="full")
    del cfg["validation_prompt"]
    proc, notes = read_simpletuner_config(_write(tmp_path, cfg))
    assert proc["network"] == {"type": "full"} and proc["sample"] == {"sample_every": 0}
    said = "\n".join(notes)
    for k in ("lora_rank", "lora_alpha", "validation_num_inference_steps", "validation_seed", "validation_steps"):
        if k == "validation_steps":
            k = "validation_step_interval"      # (SimpleTuner's alias, read under its own name)
        assert f"{k}: not used in this configuration" in said, k


def test_odd_values_are_config_errors_never_crashes(tmp_path):
    """Someone else's file: every option the reader knows and every backend key, given a number, a text, a list, an
    object, a bool, a huge number or null, reads or fails with a ConfigError (nothing else escapes)."""
    from flame_models.training import simpletuner_config as S
    keys = set(S.DEFAULTS) | set(S._HINTS) | set(S._HUB) | set(S._INERT) | set(CONFIG) | {"model_flavour", "seed"}
    keys = {k[2:] if k.startswith("--") else k for k in keys}
    values = (1, "x", [1, 2], {"a": 1}, True, -5, 1e30, None)
    for k in sorted(keys):
        for v in values:
            cfg = {kk: vv for kk, vv in CONFIG.items() if kk.lstrip("-") != k}
            cfg[k] = v
            try:
                read_simpletuner_config(_write(tmp_path, cfg))
            except ConfigError:
                pass
    for k in list(BACKENDS[0]) + ["conditioning_data", "instance_prompt", "crop_aspect", "probability"]:
        for v in values:
            try:
                read_simpletuner_config(_write(tmp_path, backends=[dict(BACKENDS[0], **{k: v})]))
            except ConfigError:
                pass
