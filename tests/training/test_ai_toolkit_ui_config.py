"""A job written by ai-toolkit's UI (its defaultJobConfig with a Flux model: `type: ui_trainer`, every field it
writes) trains as it is: its sample items become prompts with flags, `gradient_accumulation` is the accumulation,
null means the default, the settings the UI writes into every job that do nothing here are warnings that say so,
and what would change training without FLAME doing it is still an error. Also ai-toolkit's
bypass_guidance_embedding: Flux-dev trained without its guidance embedding."""
import copy

import numpy as np
import pytest

import flame_core as flame
from flame_models.flux import Flux
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.trainer import Trainer

from .conftest import draw_images


def ui_job(out, images, model):
    """ai-toolkit's UI default job (ui/src/app/jobs/new/jobConfig.ts) for Flux, on the tiny model, the cpu."""
    dataset = {"folder_path": images, "control_path": None, "mask_path": None, "mask_min_value": 0.1,
               "default_caption": "", "caption_ext": "txt", "caption_dropout_rate": 0.05,
               "cache_latents_to_disk": False, "is_reg": False, "network_weight": 1, "resolution": [64],
               "controls": [], "shrink_video_to_frames": True, "num_frames": 1, "do_i2v": True, "flip_x": False,
               "flip_y": False}
    process = {
        "type": "ui_trainer", "training_folder": out, "sqlite_db_path": "./aitk_db.db", "device": "cpu",
        "trigger_word": None, "performance_log_every": 10,
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "conv": 16, "conv_alpha": 16,
                    "lokr_full_rank": True, "lokr_factor": -1, "network_kwargs": {"ignore_if_contains": []}},
        "save": {"dtype": "fp32", "save_every": 250, "max_step_saves_to_keep": 4, "save_format": "diffusers",
                 "push_to_hub": False},
        "datasets": [dataset],
        "train": {"batch_size": 1, "bypass_guidance_embedding": False, "steps": 2, "gradient_accumulation": 1,
                  "train_unet": True, "train_text_encoder": False, "gradient_checkpointing": True,
                  "noise_scheduler": "flowmatch", "optimizer": "adamw8bit", "timestep_type": "sigmoid",
                  "content_or_style": "balanced", "optimizer_params": {"weight_decay": 1e-4},
                  "unload_text_encoder": False, "cache_text_embeddings": False, "lr": 0.0001,
                  "ema_config": {"use_ema": False, "ema_decay": 0.99}, "skip_first_sample": False,
                  "force_first_sample": False, "disable_sampling": False, "dtype": "fp32",
                  "diff_output_preservation": False, "diff_output_preservation_multiplier": 1.0,
                  "diff_output_preservation_class": "person", "switch_boundary_every": 1},
        "model": {"name_or_path": model, "quantize": False, "qtype": "qfloat8", "quantize_te": False,
                  "qtype_te": "qfloat8", "arch": "flux", "low_vram": False, "model_kwargs": {}},
        "sample": {"sampler": "flowmatch", "sample_every": 250, "width": 64, "height": 64,
                   "samples": [{"prompt": "woman with red hair, playing chess at the park"},
                               {"prompt": "a bear building a log cabin", "width": 96, "seed": 7,
                                "network_multiplier": 0.5, "neg": ""}],   # (an empty field: none)
                   "neg": "", "seed": 42, "walk_seed": True, "guidance_scale": 4, "sample_steps": 2, "num_frames": 1,
                   "fps": 1}}
    return {"job": "extension", "config": {"name": "my_first_lora_v1", "process": [process]},
            "meta": {"name": "[name]", "version": "1.0"}}


@pytest.fixture
def job(tmp_path, tiny_model):
    images = draw_images(tmp_path / "images", n_concept=2, n_other=1)
    return ui_job(str(tmp_path / "output"), images, tiny_model)


def test_a_ui_job_reads_with_its_inert_defaults_as_warnings(job):
    cfg = config_from_dict(job)
    assert cfg.sample.prompts == ["woman with red hair, playing chess at the park",
                                  "a bear building a log cabin --w 96 --seed 7 --m 0.5"]
    assert cfg.train.gradient_accumulation_steps == 1 and cfg.datasets[0].control_path is None
    assert cfg.performance_log_every == 10 and cfg.model.qtype_te == "qfloat8"
    said = "\n".join(cfg.warnings)
    for field in ("sqlite_db_path", "train.cache_text_embeddings", "train.unload_text_encoder",
                  "network.lokr_factor", "network.lokr_full_rank", "network.conv", "save.save_format",
                  "datasets[0].mask_min_value"):
        assert f"config.process[0].{field}: not used" in said, field


@pytest.mark.parametrize("where, key, value, words", [
    ("train", "content_or_style", "texture", "content_or_style: one of balanced, content, style"),
    ("train", "timestep_type", "weighted", "'weighted' is not one of sigmoid"),
    ("model", "model_kwargs", {"x": 1}, "not available"),
    ("model", "qtype_te", "qint4", "FLAME quantises the frozen weights to fp8"),
    ("datasets", "num_frames", 33, "only 1 is accepted"),
    ("datasets", "network_weight", 0.5, "only 1 is accepted"),
    ("sample", "samples", [{"prompt": "x", "ctrl_idx": 2}], r"samples\[0\]\.ctrl_idx: not available"),
])
def test_what_would_change_training_is_still_an_error(job, where, key, value, words):
    bad = copy.deepcopy(job)
    proc = bad["config"]["process"][0]
    (proc["datasets"][0] if where == "datasets" else proc[where])[key] = value
    with pytest.raises(ConfigError, match=words):
        config_from_dict(bad)


def test_outside_a_ui_job_an_inert_setting_stays_an_error(job):
    hand = copy.deepcopy(job)
    hand["config"]["process"][0]["type"] = "sd_trainer"
    with pytest.raises(ConfigError, match="network.lokr_factor: only used by network type 'lokr'"):
        config_from_dict(hand)


def test_a_ui_job_trains(job, tmp_path):
    out = Trainer(config_from_dict(job), verbose=False).train()
    assert out["lora"].endswith(".safetensors")


def test_bypass_guidance_embedding_trains_flux_dev_without_it(job):
    """The conditioning vector without guidance_in's term: the output does not depend on the guidance value and
    equals the model's with guidance_in's output layer zeroed; training inputs carry no guidance."""
    flame.manual_seed(0)
    model = Flux("flux-tiny")
    rng = np.random.default_rng(0)
    t = lambda *s: flame.tensor(rng.standard_normal(s).astype(np.float32))   # noqa: E731
    img, txt, y = t(1, 16, 64), t(1, 8, 32), t(1, 16)
    ids = dict(img_ids=flame.zeros(16, 3), txt_ids=flame.zeros(8, 3))
    args = dict(img=img, txt=txt, timesteps=flame.tensor([0.5]), y=y, **ids)
    with flame.no_grad():
        a = model(**args, guidance=flame.tensor([1.0]), bypass_guidance=True).numpy()
        b = model(**args, bypass_guidance=True).numpy()
        c = model(**args, guidance=flame.tensor([3.0])).numpy()
        model.guidance_in.out_layer.weight.zero_()
        model.guidance_in.out_layer.bias.zero_()
        d = model(**args, guidance=flame.tensor([3.0])).numpy()
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-4                                    # the guidance term matters otherwise
    np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-6)
    on = copy.deepcopy(job)
    on["config"]["process"][0]["train"]["bypass_guidance_embedding"] = True
    tr = Trainer(config_from_dict(on), verbose=False)
    tr.setup()
    _, cond = tr.family.training_inputs(tr.model, tr.loader.next_batch(), tr.device, tr.cfg.train)
    assert "guidance" not in cond
    assert np.isfinite(tr.train_step()[0])
    on["config"]["process"][0]["train"]["guidance"] = 2.0
    with pytest.raises(ConfigError, match="train.guidance: not used: train.bypass_guidance_embedding"):
        config_from_dict(on)


@pytest.mark.parametrize("arch, changes, warned", [
    ("sdxl", {"train": {"noise_scheduler": "ddpm"}, "sample": {"sampler": "euler_a", "guidance_scale": 6}},
     "train.timestep_type"),                            # (the UI hides the section for SDXL but writes it)
    ("qwen_image", {"model": {"low_vram": True}}, "model.low_vram"),
])
def test_other_architectures_ui_defaults(job, arch, changes, warned):
    j = copy.deepcopy(job)
    proc = j["config"]["process"][0]
    proc["model"]["arch"] = arch
    for section, values in changes.items():
        proc[section].update(values)
    cfg = config_from_dict(j, check_files=False)
    assert any(w.startswith(f"config.process[0].{warned}: not used") for w in cfg.warnings)


def test_content_or_style_biases_a_flow_familys_timesteps_only(job):
    styled = copy.deepcopy(job)
    styled["config"]["process"][0]["train"]["content_or_style"] = "style"
    cfg = config_from_dict(styled)
    assert cfg.train.content_or_style == "style"
    assert Trainer(cfg, verbose=False).setup().objective.kwargs["bias"] == "style"
    styled["config"]["process"][0]["model"]["arch"] = "sdxl"
    styled["config"]["process"][0]["train"]["noise_scheduler"] = "ddpm"
    with pytest.raises(ConfigError, match="content_or_style: 'style' biases a flow-matching family's timesteps"):
        config_from_dict(styled, check_files=False)
