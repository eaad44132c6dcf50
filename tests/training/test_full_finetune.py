"""Full fine-tuning (network.type full): the denoiser's own weights train in float32 under the run's autocast, for
every family; network_kwargs' filters pick them by native or diffusers names; the written file is the whole model in
its checkpoint layout and loads back through the family's loader; a restart resumes exactly; the settings a full
fine-tune has no use for, or cannot train with yet, are refused naming the field."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.training import full_finetune
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_sd_families import SD3_MODEL, sdxl_model  # noqa: F401  (the module fixture)


def full_config(tmp_path, name, arch="flux", steps=4, dtype="bf16", network=None, train=None, **top):
    """A tiny random model of `arch` on synthetic samples, full fine-tuning, on the cpu in `dtype`."""
    t = {"steps": steps, "batch_size": 2, "optimizer": "adamw", "lr": 1e-3, "dtype": dtype,
         "gradient_checkpointing": False, "seed": 0}
    t.update(train or {})
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu",
         "network": {"type": "full", **(network or {})},
         "synthetic": {"num_samples": 4, "height": 32, "width": 32, "text_length": 8, "seed": 0},
         "train": t, "model": {"arch": arch, "dtype": dtype},
         "sample": {"sample_every": 0}, "save": {"save_every": 2, "dtype": "bf16"}}
    d.update(top)
    return config_from_dict(d)


def sai_run_config(tmp_path, name, steps=2, save_dtype="bf16", save_format="safetensors"):
    """A full fine-tune of SDXL from an SAI single file of the tiny parts (UNet, VAE, CLIP-L, CLIP-G) on drawn
    images: (config, the base file)."""
    import os
    import sys

    from flame_models.sdxl import save_sdxl
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from sdxl_tiny import SDXL_FIXTURE, sdxl_tiny_parts
    base = str(tmp_path / "sdxl_tiny_sai.safetensors")
    save_sdxl(sdxl_tiny_parts(), base, layout="sai")
    cfg = image_config(tmp_path, name, base, draw_images(tmp_path / "images", 2, 2), steps=steps,
                       model={"arch": "sdxl", "t5_max_length": None, "tokenizer_path": SDXL_FIXTURE})
    cfg.network.type, cfg.save.dtype, cfg.save.save_format = "full", save_dtype, save_format
    return cfg, base


def _numpy(p):
    return p.detach().float().numpy().copy()


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl", "chroma", "qwen_image", "flux_kontext"])
def test_every_weight_trains_in_float32_and_the_file_loads_back(tmp_path, arch):
    tr = Trainer(full_config(tmp_path, arch, arch=arch, steps=3, meta={"author": "[name]'s maker"}),
                 verbose=False).setup()
    named = dict(tr.model.named_parameters())
    assert tr.params and len(tr.params) == len(named) == tr.n_adapted
    assert all(p.requires_grad and p.dtype == flame.float32 for p in named.values())
    before = {n: _numpy(p) for n, p in named.items()}
    result = tr.train()
    assert np.isfinite(result["losses"]).all()
    changed = [n for n, p in named.items() if not np.array_equal(_numpy(p), before[n])]
    assert len(changed) > 0.9 * len(named), (len(changed), len(named))    # (a zero-initialised output may not move)
    from flame_core import io
    meta = io.load_metadata(result["lora"])   # the run's: ai-toolkit's meta, its steps and base; no LoRA's keys
    assert meta["author"] == f"{arch}'s maker" and meta["flame.steps"] == "3" and meta["flame.network"] == "full"
    assert not any(k.startswith(("modelspec.", "ss_")) for k in meta)
    fam = get_family(arch)
    back = fam.load_model(result["lora"], fam.read_spec(result["lora"]), flame.bfloat16, "cpu")
    got = dict(back.named_parameters())
    assert set(got) == set(named)
    for n, p in named.items():   # the trained float32 values, rounded once to save.dtype
        np.testing.assert_array_equal(got[n].detach().float().numpy(), p.detach().to(flame.bfloat16).float().numpy(),
                                      err_msg=n)


def test_small_updates_land_on_the_float32_weights(tmp_path):
    """lr 1e-5 on a bf16 model: one AdamW step moves each weight by ~1e-5, far below bf16's spacing at the weights'
    scale (2^-8 of the value), so a bf16 weight would keep its value; the float32 weights take it."""
    tr = Trainer(full_config(tmp_path, "small", steps=1, train={"lr": 1e-5, "lr_warmup_steps": 0}),
                 verbose=False).setup()
    w = dict(tr.model.named_parameters())["double_blocks.0.img_attn.qkv.weight"]
    w0 = _numpy(w)
    assert np.array_equal(w0, w.detach().to(flame.bfloat16).float().numpy())   # loaded from bf16
    tr.train_step()
    w1 = _numpy(w)
    moved = w1 != w0
    assert moved.mean() > 0.9
    step = np.abs(w1 - w0)[moved]
    assert np.median(step) == pytest.approx(1e-5, rel=0.2)       # Adam's first step: lr per element
    as_bf16 = w.detach().to(flame.bfloat16).float().numpy()
    assert (as_bf16 == w0).mean() > 0.9                              # what a bf16 weight would have kept


def test_filters_pick_weights_by_native_and_diffusers_names(tmp_path):
    tr = Trainer(full_config(tmp_path, "only", network={"network_kwargs": {"only_if_contains": ["double_blocks."]}}),
                 verbose=False).setup()
    named = dict(tr.model.named_parameters())
    trained = {n for n, _ in full_finetune.trained_parameters(tr.model)}
    assert trained == {n for n in named if n.startswith("double_blocks.")}
    assert all(named[n].dtype == flame.bfloat16 and not named[n].requires_grad for n in set(named) - trained)
    frozen = {n: _numpy(named[n]) for n in set(named) - trained}
    tr.train_step()
    assert all(np.array_equal(_numpy(named[n]), v) for n, v in frozen.items())   # the rest never moves
    # a diffusers name (attn.to_q: a third of the fused img_attn.qkv) selects the fused weight that holds it
    tr2 = Trainer(full_config(tmp_path, "ignore", network={"network_kwargs": {"ignore_if_contains": ["attn.to_q"]}}),
                  verbose=False).setup()
    left = {n for n, _ in full_finetune.trained_parameters(tr2.model)}
    assert "double_blocks.0.img_attn.qkv.weight" not in left and "double_blocks.0.img_attn.proj.weight" in left
    with pytest.raises(ConfigError, match="leave no parameter"):
        Trainer(full_config(tmp_path, "none", network={"network_kwargs": {"only_if_contains": ["nowhere"]}}),
                verbose=False).setup()


def test_restart_resumes_exactly(tmp_path):
    full = Trainer(full_config(tmp_path, "resume", steps=6, dtype="fp32"), verbose=False).setup()
    for _ in range(2):
        full.train_step()
    full.save_checkpoint()
    want_loss = [full.train_step()[0] for _ in range(2)]
    want = [_numpy(p) for p in full.params]
    again = Trainer(full_config(tmp_path, "resume", steps=6, dtype="fp32"), verbose=False).setup()
    assert again.resumed_from and again.step == 2
    got_loss = [again.train_step()[0] for _ in range(2)]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for a, b in zip(again.params, want):
        np.testing.assert_allclose(_numpy(a), b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("extra, field", [
    ({"network": {"type": "full", "linear": 8}}, "network.linear"),
    ({"network": {"type": "full", "target": "all_linear"}}, "network.target"),
    ({"network": {"type": "full", "loraplus_lr_ratio": 16}}, "network.loraplus_lr_ratio"),
    ({"save": {"format": "peft"}}, "save.format"),
    ({"model": {"arch": "flux", "quantize": True}}, "model.quantize"),
])
def test_settings_a_full_fine_tune_cannot_take_are_refused(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        full_config(tmp_path, "refused", **extra)


def test_too_large_a_selection_is_refused_before_anything_converts():
    fam = get_family("flux")
    model = fam.model_class(fam.preset("flux-tiny"), dtype=flame.bfloat16)
    from flame_models.training.config import NetworkConfig
    selected = full_finetune.select(model, NetworkConfig(type="full"))
    count = sum(p.numel() for _, p in selected)
    need = count * (2 + 4 + 8)   # bf16 -> float32, the float32 gradient, AdamW's two moments
    assert full_finetune.problems(selected, "cpu", need, "adamw") == []
    msg = full_finetune.problems(selected, "cpu", need - 1, "adamw")[0]
    assert f"{count:,} parameters" in msg and "max_gpu_memory" in msg
    assert all(p.dtype == flame.bfloat16 for _, p in selected)   # nothing converted by the check


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_the_written_model_generates_beside_its_folders_parts(tmp_path, arch, tiny_model, sdxl_model):  # noqa: F811
    """A full fine-tune of a diffusers folder's model, then generate --model <the file> with the folder's VAE,
    text encoders and tokenizers: the README's workflow."""
    import os

    from flame_models import generate
    folder = {"flux": tiny_model, "sd3": SD3_MODEL, "sdxl": sdxl_model}[arch]
    images = draw_images(tmp_path / "images", 2, 2)
    model = {"arch": arch} if arch == "sd3" else {"arch": arch, "t5_max_length": None} if arch == "sdxl" else {}
    cfg = image_config(tmp_path, "full", folder, images, steps=2, **({"model": model} if model else {}))
    cfg.network.type = "full"   # (image_config's LoRA settings are not read by a full fine-tune)
    result = Trainer(cfg, verbose=False).train()
    encoders = {"flux": ["--clip-l", "text_encoder", "--t5", "text_encoder_2"],
                "sd3": ["--clip-l", "text_encoder", "--clip-g", "text_encoder_2", "--t5", "text_encoder_3"],
                "sdxl": ["--clip-l", "text_encoder", "--clip-g", "text_encoder_2"]}[arch]
    parts = [a if a.startswith("--") else os.path.join(folder, a) for a in ["--vae", "vae"] + encoders]
    out = tmp_path / "generated"
    assert generate.main(["--model", result["lora"], *parts, "--tokenizer", folder, "--prompt", "ohwx",
                          "--width", "64", "--height", "64", "--steps", "2", "--seed", "1", "--output", str(out)]) == 0
    assert [f for f in os.listdir(out) if f.endswith(".png")]


def test_full_bf16_keeps_the_weights_in_bf16_and_rounds_updates_stochastically(tmp_path):
    """train.full_bf16 (kohya's): no float32 copies -- the weights, their gradients stay bf16 -- and AdamW8bit's
    stochastic rounding moves them by updates far below bf16's spacing (lr 1e-5); a restart continues bit for bit
    (the rounding's bits come from the step and the parameter's ordinal)."""
    def cfg(name):
        return full_config(tmp_path, name, steps=6, train={"lr": 1e-5, "optimizer": "adamw8bit", "full_bf16": True,
                                                           "lr_warmup_steps": 0})
    tr = Trainer(cfg("bf16"), verbose=False).setup()
    named = dict(tr.model.named_parameters())
    assert all(p.dtype == flame.bfloat16 and p.requires_grad for p in named.values())
    w = named["double_blocks.0.img_mlp.0.weight"]
    w0 = _numpy(w)
    for _ in range(3):
        tr.train_step()
    assert w.dtype == flame.bfloat16
    moved = np.abs(_numpy(w) - w0)
    assert 0.02 < (moved > 0).mean() < 0.9          # some weights stepped a whole spacing, most did not (yet)
    tr.save_checkpoint()
    want = [tr.train_step()[0] for _ in range(2)]
    want_w = [_numpy(p) for p in tr.params]
    again = Trainer(cfg("bf16"), verbose=False).setup()
    assert again.step == 3
    assert [again.train_step()[0] for _ in range(2)] == pytest.approx(want, rel=1e-6)
    for a, b in zip(again.params, want_w):
        np.testing.assert_array_equal(_numpy(a), b)


def test_full_bf16_trains_with_adafactor_too(tmp_path):
    tr = Trainer(full_config(tmp_path, "adafactor", steps=2, train={
        "full_bf16": True, "optimizer": "adafactor", "lr": 1e-5,
        "optimizer_params": {"relative_step": False, "scale_parameter": False}}), verbose=False).setup()
    w = dict(tr.model.named_parameters())["double_blocks.0.img_mlp.0.weight"]
    w0 = _numpy(w)
    losses = [tr.train_step()[0] for _ in range(2)]
    assert np.isfinite(losses).all() and w.dtype == flame.bfloat16 and (_numpy(w) != w0).any()


@pytest.mark.parametrize("train, network, field", [
    ({"full_bf16": True, "optimizer": "adamw"}, {"type": "full"}, "train.full_bf16"),
    ({"full_bf16": True, "optimizer": "adamw8bit"}, {"type": "lora"}, "train.full_bf16"),
])
def test_full_bf16_needs_a_full_fine_tune_and_adamw8bit(tmp_path, train, network, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        full_config(tmp_path, "refused", train=train, network=network)


def test_the_size_check_counts_what_each_precision_and_optimizer_keeps():
    """keep_dtype (full_bf16): bf16 gradients and the state, the values already held; Adafactor's state: a row and a
    column mean per matrix (a Flux-dev full_bf16 Adafactor run was refused at 66.5 GiB when it was counted as 4 bytes
    a weight)."""
    fam = get_family("flux")
    model = fam.model_class(fam.preset("flux-tiny"), dtype=flame.bfloat16)
    from flame_models.training.config import NetworkConfig
    selected = full_finetune.select(model, NetworkConfig(type="full"))
    count = sum(p.numel() for _, p in selected)
    factored = sum(4 * (p.numel() // p.shape[-1] + p.numel() // p.shape[-2]) if p.ndim >= 2 else 4 * p.numel()
                   for _, p in selected)
    for optimizer, keep, need in [("adamw8bit", True, count * (2 + 2)), ("adafactor", True, count * 2 + factored),
                                  ("adamw", False, count * (2 + 4 + 8)), ("adafactor", False, count * 6 + factored)]:
        assert full_finetune.problems(selected, "cpu", need, optimizer, keep_dtype=keep) == [], optimizer
        assert full_finetune.problems(selected, "cpu", need - 1, optimizer, keep_dtype=keep), optimizer
    ema = count * (4 + 2)   # EMA's float32 shadow, and the bf16 values its swap saves
    assert full_finetune.problems(selected, "cpu", count * 4 + ema, "adamw8bit", keep_dtype=True, ema=True) == []
    msg = full_finetune.problems(selected, "cpu", count * 4 + ema - 1, "adamw8bit", keep_dtype=True, ema=True)[0]
    assert "EMA" in msg
    with_beta1 = count * 2 + factored + 4 * count
    assert full_finetune.problems(selected, "cpu", with_beta1 - 1, "adafactor", keep_dtype=True,
                                  optimizer_params={"beta1": 0.9})


def test_the_demo_with_network_full_drops_its_lora_settings(tmp_path):
    """`python examples/train_flux_lora.py --network full`: the demo's rank, alpha, target and file layout are LoRA
    settings (not given to a full fine-tune), its lr is 5e-4 unless --lr says otherwise; an adapter flag with
    --network full is refused naming it."""
    from flame_models import train
    quick = ["--network", "full", "--output", str(tmp_path), "--demo-base-steps", "0"]
    cfg, demo, _ = train.build_config(train.parser().parse_args(quick))
    assert demo and cfg.network.type == "full" and cfg.train.lr == pytest.approx(5e-4)
    assert not {"network.linear", "network.target", "save.format"} & cfg.given
    cfg, _, _ = train.build_config(train.parser().parse_args(quick + ["--lr", "1e-3", "--name", "b"]))
    assert cfg.train.lr == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match=r"network\.linear"):
        train.build_config(train.parser().parse_args(quick + ["--rank", "8", "--name", "c"]))


def test_ema_of_every_weight_is_what_the_file_holds(tmp_path):
    """train.ema_config.use_ema with a full fine-tune: the float32 average of every weight is swapped in to write
    the model (as for a LoRA's adapters), the trained values come back after."""
    tr = Trainer(full_config(tmp_path, "ema", steps=3, train={"ema_config": {"use_ema": True, "ema_decay": 0.5}}),
                 verbose=False).setup()
    result = tr.train()
    names = [n for n, _ in full_finetune.trained_parameters(tr.model)]
    fam = get_family("flux")
    back = dict(fam.load_model(result["lora"], fam.read_spec(result["lora"]), flame.bfloat16, "cpu").named_parameters())
    differs = 0
    for n, s, p in zip(names, tr.ema.shadow, tr.params):
        np.testing.assert_array_equal(back[n].detach().float().numpy(), s.to(flame.bfloat16).float().numpy(),
                                      err_msg=n)
        differs += not np.array_equal(_numpy(s), _numpy(p))
    assert differs > 0.9 * len(names)     # the average, not the last values


def test_an_sai_files_fine_tune_is_a_whole_checkpoint_that_generates_alone(tmp_path):
    """SDXL trained from an SAI single file (UNet, VAE, CLIP-L, CLIP-G): the written file holds the trained UNet and
    the base's VAE and text encoders bit for bit -- a checkpoint A1111's or ComfyUI's checkpoint loader takes, and
    generate --model reads alone."""
    import os

    from sdxl_tiny import SDXL_FIXTURE

    from flame_core import io
    from flame_models import generate
    cfg, base = sai_run_config(tmp_path, "sai")
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    with io.safe_open(base) as f:
        others = {k: f.get_array(k) for k in f.keys() if not k.startswith("model.diffusion_model.")}
    assert others and any(k.startswith("first_stage_model.") for k in others) \
        and any(k.startswith("conditioner.") for k in others)
    with io.safe_open(result["lora"]) as f:
        keys = set(f.keys())
        assert set(others) <= keys
        for k, v in others.items():   # the base's other parts, bit for bit, in their own dtypes
            np.testing.assert_array_equal(f.get_array(k), v, err_msg=k)
        unet = {k for k in keys if k.startswith("model.diffusion_model.")}
        assert len(unet) == len(dict(tr.model.named_parameters()))
        w = dict(tr.model.named_parameters())["out.2.weight"]
        np.testing.assert_array_equal(f.get_array("model.diffusion_model.out.2.weight").astype(np.float32),
                                      w.detach().to(flame.bfloat16).float().numpy())
    out = tmp_path / "generated"
    assert generate.main(["--model", result["lora"], "--tokenizer", SDXL_FIXTURE, "--prompt", "ohwx", "--width", "64",
                          "--height", "64", "--steps", "2", "--seed", "1", "--output", str(out)]) == 0
    assert [f for f in os.listdir(out) if f.endswith(".png")]


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_save_format_diffusers_writes_a_pipeline_folder_that_generates_alone(tmp_path, arch, tiny_model,
                                                                            sdxl_model):  # noqa: F811
    """save.save_format: diffusers (ai-toolkit's) from a diffusers folder: the trained denoiser in its subfolder
    (config.json + diffusion_pytorch_model.safetensors), the base's other components hard-linked beside it, its
    model_index.json: a whole pipeline that generate --model reads alone; the weights are the trained ones."""
    import os

    from flame_core import io
    folder = {"flux": tiny_model, "sd3": SD3_MODEL, "sdxl": sdxl_model}[arch]
    images = draw_images(tmp_path / "images", 2, 2)
    model = {"arch": arch} if arch == "sd3" else {"arch": arch, "t5_max_length": None} if arch == "sdxl" else {}
    cfg = image_config(tmp_path, "diff", folder, images, steps=2, **({"model": model} if model else {}))
    cfg.network.type, cfg.save.save_format, cfg.save.dtype = "full", "diffusers", "bf16"
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    out = result["lora"]
    sub = "unet" if arch == "sdxl" else "transformer"
    assert os.path.isdir(out) and out == str(tmp_path / "diff" / "diff")
    assert sorted(os.listdir(os.path.join(out, sub))) == ["config.json", "diffusion_pytorch_model.safetensors"]
    base_index = io_json(os.path.join(folder, "model_index.json"))
    assert io_json(os.path.join(out, "model_index.json")) == base_index
    for name in (k for k, v in base_index.items() if isinstance(v, list) and v[0] and k != sub
                 and os.path.isdir(os.path.join(folder, k))):   # (the tiny folders have no scheduler/)
        assert sorted(os.listdir(os.path.join(out, name))) == sorted(os.listdir(os.path.join(folder, name))), name
        for f in os.listdir(os.path.join(out, name)):   # the same files (hard links here), not new copies
            if os.path.isfile(os.path.join(out, name, f)):
                assert os.path.samefile(os.path.join(out, name, f), os.path.join(folder, name, f)), (name, f)
    assert not [f for f in os.listdir(tmp_path / "diff") if ".partial-" in f or ".old-" in f]
    weights = os.path.join(out, sub, "diffusion_pytorch_model.safetensors")
    meta = io.load_metadata(weights)
    assert meta["flame.steps"] == "2" and meta["flame.network"] == "full"
    fam = get_family(arch)
    back = dict(fam.load_model(out, fam.read_spec(out), flame.bfloat16, "cpu").named_parameters())
    named = dict(tr.model.named_parameters())
    assert set(back) == set(named)
    for n, p in named.items():
        np.testing.assert_array_equal(back[n].detach().float().numpy(), p.detach().to(flame.bfloat16).float().numpy(),
                                      err_msg=n)
    generates_alone(out, tmp_path / "generated")


def generates_alone(model, folder, *extra):
    """generate --model `model` with nothing else beside it (but `extra` arguments) writes an image."""
    import os

    from flame_models import generate
    assert generate.main(["--model", str(model), "--prompt", "ohwx", "--width", "64", "--height", "64", "--steps", "2",
                          "--seed", "1", "--output", str(folder), *extra]) == 0
    assert [f for f in os.listdir(folder) if f.endswith(".png")]


def io_json(path):
    import json
    with open(path) as f:
        return json.load(f)


def test_diffusers_folders_of_the_steps_are_pruned_and_a_finished_run_is_found(tmp_path):
    """Step folders name_<step>/ follow the checkpoints (max_step_saves_to_keep); without a diffusers base the
    folder holds the denoiser's subfolder alone; a second run of the finished config trains nothing and reports the
    folder; --fresh's clear removes the folders."""
    import os

    from flame_models.training import run_folder
    cfg = lambda: full_config(tmp_path, "steps", steps=6, save={"save_every": 2, "dtype": "bf16",  # noqa: E731
                                                                 "max_step_saves_to_keep": 1,
                                                                 "save_format": "diffusers"})
    result = Trainer(cfg(), verbose=False).train()
    run = tmp_path / "steps"
    assert result["lora"] == str(run / "steps")
    assert sorted(os.listdir(result["lora"])) == ["transformer"]   # (synthetic data: no base pipeline to copy)
    assert sorted(f for f in os.listdir(run) if f.startswith("steps")) == ["steps", "steps_000006"]
    again = Trainer(cfg(), verbose=False).train()
    assert again["finished_before"] and again["lora"] == result["lora"] and again["steps"] == 6
    gone = run_folder.clear(str(run), "steps")
    assert str(run / "steps") in gone and str(run / "steps_000006") in gone
    assert not [f for f in os.listdir(run) if f.startswith("steps")]


def test_save_format_diffusers_is_for_a_full_fine_tune(tmp_path):
    with pytest.raises(ConfigError, match=r"save\.save_format: diffusers writes a full fine-tune"):
        full_config(tmp_path, "lora", network={"type": "lora"}, save={"save_format": "diffusers"})
    with pytest.raises(ConfigError, match=r"save\.save_format"):
        full_config(tmp_path, "bad", save={"save_format": "ckpt"})


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_diffusers_reads_the_written_folder(tmp_path, arch):
    """The oracle: diffusers' own model class loads the folder's denoiser (from_pretrained with the subfolder) with
    every key it expects and nothing else, the values the file's (where torch and diffusers are installed: the GPU
    machine)."""
    diffusers = pytest.importorskip("diffusers")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    cls, sub = {"flux": (diffusers.FluxTransformer2DModel, "transformer"),
                "sd3": (diffusers.SD3Transformer2DModel, "transformer"),
                "sdxl": (diffusers.UNet2DConditionModel, "unet")}[arch]
    cfg = full_config(tmp_path, arch, arch=arch, steps=1, save={"save_every": 5, "dtype": "fp32",
                                                                 "save_format": "diffusers"})
    out = Trainer(cfg, verbose=False).train()["lora"]
    model = cls.from_pretrained(out, subfolder=sub)
    want = model.state_dict()
    got = load_file(f"{out}/{sub}/diffusion_pytorch_model.safetensors")
    assert set(want) == set(got)
    for k, v in want.items():
        assert torch.equal(v, got[k].to(v.dtype)), k


def test_an_sai_files_fine_tune_as_diffusers_is_a_whole_pipeline(tmp_path):
    """SDXL trained from an SAI single file with save.save_format: diffusers: unet/ (the trained weights) and the
    base's VAE, CLIP-L, CLIP-G (OpenCLIP names converted), the run's tokenizers, a scheduler and model_index.json --
    a pipeline that load_sdxl and generate --model read alone, every part's weights the base's."""
    import os

    from flame_models.sdxl import load_sdxl
    cfg, base = sai_run_config(tmp_path, "saidiff", save_format="diffusers")
    tr = Trainer(cfg, verbose=False)
    out = tr.train()["lora"]
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "text_encoder", "text_encoder_2", "tokenizer",
                                       "tokenizer_2", "unet", "vae"]
    got, want = load_sdxl(out, device="cpu"), load_sdxl(base, device="cpu")
    for part in ("vae", "clip_l", "clip_g"):
        a, b = dict(getattr(got, part).state_dict()), dict(getattr(want, part).state_dict())
        assert set(a) == set(b), part
        for k in a:
            np.testing.assert_array_equal(a[k].float().numpy(), b[k].float().numpy(), err_msg=f"{part} {k}")
    trained = dict(tr.model.named_parameters())
    for k, v in got.unet.named_parameters():
        np.testing.assert_array_equal(v.float().numpy(), trained[k].detach().to(flame.bfloat16).float().numpy(),
                                      err_msg=k)
    generates_alone(out, tmp_path / "generated")


@pytest.mark.parametrize("text_encoders", [False, True])
def test_diffusers_runs_the_pipeline_of_an_sai_files_fine_tune(tmp_path, text_encoders):
    """The oracle (where torch and diffusers are installed): StableDiffusionXLPipeline.from_pretrained loads the
    folder an SAI file's fine-tune wrote -- every component -- and generates; its UNet (and, with
    train.train_text_encoder, its text encoders) holds the trained weights."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("torch")
    cfg, _ = sai_run_config(tmp_path, "oracle", steps=1, save_dtype="fp32", save_format="diffusers")
    cfg.train.train_text_encoder = text_encoders
    tr = Trainer(cfg, verbose=False)
    out = tr.train()["lora"]
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(out)
    image = pipe("ohwx", num_inference_steps=2, height=64, width=64, output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    from flame_models.sdxl.keys import sai_to_diffusers_key
    trained = {sai_to_diffusers_key(k, tr.model.config.num_res_blocks): p for k, p in tr.model.named_parameters()}
    sd = pipe.unet.state_dict()
    assert set(sd) == set(trained)
    for k, v in sd.items():
        np.testing.assert_array_equal(v.float().numpy(), trained[k].detach().float().numpy(), err_msg=k)
    if text_encoders:   # transformers' CLIP modules hold the trained weights (its 5.x names drop "text_model.")
        for comp, module in (("te1", pipe.text_encoder), ("te2", pipe.text_encoder_2)):
            mine = {k.removeprefix("text_model."): v for k, v in tr.text_encoders.modules()[comp].state_dict().items()}
            theirs = {k.removeprefix("text_model."): v for k, v in module.state_dict().items()}
            shared = set(theirs) & set(mine)
            assert len(shared) > 0.9 * len(mine), (comp, sorted(set(mine) - shared)[:5])
            for k in shared:
                np.testing.assert_array_equal(theirs[k].float().numpy(), mine[k].detach().float().numpy(),
                                              err_msg=f"{comp} {k}")


@pytest.mark.parametrize("layout", ["safetensors", "diffusers"])
def test_text_encoders_train_in_full_and_go_into_the_written_checkpoint(tmp_path, layout, sdxl_model):  # noqa: F811
    """train.train_text_encoder with network.type full (kohya's sdxl_train.py --train_text_encoder): CLIP-L and
    CLIP-G's own weights train in float32 at train.text_encoder_lr beside the UNet; the written model holds the
    trained UNet and encoders (rounded to save.dtype) with the base's VAE -- from an SAI file as one SAI checkpoint
    or a diffusers folder, from a diffusers folder as a pipeline folder whose VAE is linked and whose encoders are
    new -- and generate reads it alone; a restart resumes the encoders' weights exactly."""
    import os

    from flame_models.sdxl import load_sdxl
    if layout == "safetensors":
        cfg, base = sai_run_config(tmp_path, "te", steps=2)
    else:
        base = sdxl_model
        cfg = image_config(tmp_path, "te", base, draw_images(tmp_path / "images", 2, 2), steps=2,
                           model={"arch": "sdxl", "t5_max_length": None})
        cfg.network.type, cfg.save.dtype, cfg.save.save_format = "full", "bf16", "diffusers"
    cfg.train.train_text_encoder, cfg.train.text_encoder_lr = True, 1e-4
    tr = Trainer(cfg, verbose=False).setup()
    te = tr.text_encoders
    assert te.full and te.n_adapted == len(te.params) > 10
    assert all(p.requires_grad and p.dtype == flame.float32 for p in te.params)
    assert [g["lr"] for g in tr.optimizer.param_groups] == [cfg.train.lr, 1e-4]
    before = {k: _numpy(p) for k, p in te.named_parameters()}
    out = tr.train()["lora"]
    after = dict(te.named_parameters())
    moved = [k for k in before if not np.array_equal(before[k], _numpy(after[k]))]
    assert len(moved) > 0.5 * len(before)
    got = load_sdxl(out, device="cpu")
    for comp, mine in (("clip_l", te.modules()["te1"]), ("clip_g", te.modules()["te2"])):
        written = dict(getattr(got, comp).state_dict())
        for k, v in mine.state_dict().items():
            np.testing.assert_array_equal(written[k].float().numpy(), v.detach().to(flame.bfloat16).float().numpy(),
                                          err_msg=f"{comp} {k}")
    base_vae = dict(load_sdxl(base, device="cpu").vae.state_dict())
    for k, v in got.vae.state_dict().items():
        np.testing.assert_array_equal(v.float().numpy(), base_vae[k].float().numpy(), err_msg=f"vae {k}")
    if layout == "diffusers":
        assert not os.path.samefile(os.path.join(out, "text_encoder", "model.safetensors"),
                                    os.path.join(base, "text_encoder", "model.safetensors"))
        vae = [f for f in os.listdir(os.path.join(out, "vae")) if f.endswith(".safetensors")][0]
        assert os.path.samefile(os.path.join(out, "vae", vae), os.path.join(base, "vae", vae))
    # (the tiny fixture's CLIPs embed its own small vocabulary: an SAI file holds no tokenizer)
    from sdxl_tiny import SDXL_FIXTURE
    generates_alone(out, tmp_path / "generated", *(["--tokenizer", SDXL_FIXTURE] if layout == "safetensors" else []))


def test_full_text_encoder_training_is_for_sdxl_with_a_base(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.train_text_encoder: with network\.type full only for SDXL"):
        full_config(tmp_path, "flux_te", train={"train_text_encoder": True})


def test_full_text_encoder_training_resumes_exactly(tmp_path):
    def run():
        cfg, _ = sai_run_config(tmp_path, "te_resume", steps=6)
        cfg.train.train_text_encoder = True
        return Trainer(cfg, verbose=False).setup()
    full = run()
    for _ in range(2):
        full.train_step()
    full.save_checkpoint()
    want_loss = [full.train_step()[0] for _ in range(2)]
    want = {k: _numpy(p) for k, p in full.text_encoders.named_parameters()}
    again = run()
    assert again.resumed_from and again.step == 2
    got_loss = [again.train_step()[0] for _ in range(2)]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    got = dict(again.text_encoders.named_parameters())
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(_numpy(got[k]), v, err_msg=k)
