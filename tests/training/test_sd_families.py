"""SD3 / SD3.5 and SDXL as trainer families, end to end on the CPU with tiny models on disk (the pipeline fixtures
of tests/fixtures/sd3_pipeline and sdxl_pipeline: diffusers' tiny random parts): every stage from an image folder
(latent and text caches, training, decoded previews with a negative prompt), LoRA files in kohya and PEFT names
loaded back by flame_nn.adapters with the same outputs, exact resume, SDXL's size conditioning from the dataset, the
random presets, and bad configs refused before any model is loaded."""
import json
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_core import io
from flame_models.sd3 import load_sd3
from flame_models.sdxl import load_unet, make_y
from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
SD3_MODEL = os.path.join(FIXTURES, "sd3_pipeline", "pipeline")
PROMPTS = ["[trigger] on a blue background", "a yellow square on a purple background"]


@pytest.fixture(scope="module")
def sdxl_model(tmp_path_factory):
    """The SDXL pipeline fixture (FLAME's SAI file of diffusers' tiny parts) as a diffusers folder."""
    from sdxl_tiny import sdxl_tiny_folder
    return sdxl_tiny_folder(tmp_path_factory.mktemp("sdxl") / "sdxl-tiny")


@pytest.fixture
def images(tmp_path):
    return draw_images(tmp_path / "images", n_concept=2, n_other=2, wide=1)


def sd3_config(tmp_path, name, images, **top):
    top.setdefault("model", {})
    top["model"] = {"arch": "sd3", **top["model"]}
    return image_config(tmp_path, name, SD3_MODEL, images, **top)


def sdxl_config(tmp_path, name, model_path, images, **top):
    top.setdefault("model", {})
    top["model"] = {"arch": "sdxl", "t5_max_length": None, **top["model"]}
    return image_config(tmp_path, name, model_path, images, **top)


def _png(path):
    return np.asarray(Image.open(path).convert("RGB"), np.float32) / 255


def _check_decoded_preview(tr, family, step):
    """The preview PNG of prompt 0 at `step` is the family's decode of the sampled latents."""
    lat = io.load_file(os.path.join(tr.out, "samples", f"step_{step:06d}.safetensors"))["latents"].numpy()
    vae = family.load_vae(tr.cfg.model, tr.device)
    want = np.clip(family.decode(vae, lat) / 2 + 0.5, 0, 1)[0].transpose(1, 2, 0)
    np.testing.assert_allclose(_png(os.path.join(tr.out, "samples", f"step_{step:06d}_0.png")), want,
                               atol=1 / 255 + 1e-6)


def _outputs(model, call):
    with flame.no_grad():
        return call(model).numpy()


def _loads_back(tr, lora, fresh, call):
    """The LoRA file, loaded by flame_nn.adapters into a fresh base model, gives the trained model's outputs."""
    tr.model.eval()
    want = _outputs(tr.model, call)
    A.load_adapters(fresh, lora)
    got = _outputs(fresh, call)
    base = _outputs(fresh, lambda m: (A.disable_adapters(m), call(m))[1])
    assert np.abs(want - base).max() > 1e-4, "the LoRA changes nothing: the check would pass vacuously"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- SD3
def _sd3_call(spec):
    rng = np.random.default_rng(3)
    x = flame.tensor(rng.standard_normal((1, 16, 8, 8)).astype(np.float32), device="cpu")
    ctx = flame.tensor(rng.standard_normal((1, 12, spec.context_in_dim)).astype(np.float32), device="cpu")
    y = flame.tensor(rng.standard_normal((1, spec.pooled_in_dim)).astype(np.float32), device="cpu")
    t = flame.tensor(np.array([600.0], np.float32), device="cpu")
    return lambda m: m(x, t, y, ctx)


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_sd3_trains_from_an_image_folder_with_decoded_cfg_previews_and_a_lora_that_loads_back(tmp_path, images, fmt):
    cfg = sd3_config(tmp_path, f"sd3_{fmt}", images, steps=2, save={"format": fmt},
                     sample={"sample_every": 2, "sample_steps": 2, "prompts": PROMPTS, "neg": "a blurry photo"})
    assert (cfg.train.timestep_type, cfg.sample.guidance_scale) == ("logit_normal", 4.5)   # SD3's defaults
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    # 5 images in two buckets encoded once; the captions, the prompts, the negative and the empty caption
    assert result["encoded"]["latents"] == 5
    texts = set(tr.dataset.prompts([0]) + ["ohwx on a blue background", "a yellow square on a purple background",
                                           "a blurry photo", "", "ohwx"])  # (+ the dropout caption)
    assert result["encoded"]["text"] == len(texts)
    p0 = tr.previews.prompts[0]
    neg = tr.prepared.texts.load("a blurry photo")
    np.testing.assert_array_equal(p0.cond["negative_prompt_embeds"], neg["prompt_embeds"])
    assert p0.cond["prompt_embeds"].shape == (77 + 8, 48)                    # CLIP 77 ++ T5 8 tokens
    assert result["samples_decoded"]
    _check_decoded_preview(tr, get_family("sd3"), 2)
    if fmt == "kohya":
        _sd3_previews_use_the_negative_and_slg(tr, p0)
    sd = io.load_file(result["lora"])
    with io.safe_open(result["lora"]) as f:
        meta = f.metadata()
    if fmt == "kohya":
        assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight" in sd
        assert meta["ss_network_module"] == "networks.lora_sd3"
        assert meta["modelspec.architecture"] == "stable-diffusion-3-5-m/lora"      # an MMDiT-X (dual attention)
    else:
        assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in sd
        assert "transformer.transformer_blocks.1.attn.add_k_proj.lora_B.weight" in sd
    fresh = load_sd3(SD3_MODEL, dtype=flame.float32, device="cpu")
    _loads_back(tr, result["lora"], fresh, _sd3_call(tr.spec))


def _sd3_previews_use_the_negative_and_slg(tr, p0):
    """The step-2 preview is CFG against the encoded negative; without it (zeros) or with skip-layer guidance
    (sample.slg_scale) the latents differ."""
    import copy
    fam = get_family("sd3")
    kw = dict(height=64, width=64, steps=2, guidance=4.5, seed=tr.cfg.sample.seed, device=tr.device)
    tr.model.eval()
    with flame.no_grad():
        z = fam.sample(tr.model, p0.cond, **kw).numpy()
        no_neg = fam.sample(tr.model, {k: v for k, v in p0.cond.items() if not k.startswith("negative_")},
                            **kw).numpy()
        cfg = copy.deepcopy(tr.cfg)
        cfg.sample.slg_scale, cfg.sample.slg_layers = 2.0, [1]
        options = fam.sample_options(cfg)
        assert options["slg"].layers == (1,) and options["slg"].scale == 2.0
        options["slg"] = type(options["slg"])(layers=(1,), scale=2.0, start=0.0, stop=1.0)  # active at step 1 of 2
        slg = fam.sample(tr.model, p0.cond, **kw, **options).numpy()
    saved = io.load_file(os.path.join(tr.out, "samples", "step_000002.safetensors"))["latents"].numpy()[0]
    np.testing.assert_allclose(z[0], saved, rtol=1e-5, atol=1e-6)
    assert np.abs(no_neg - z).max() > 1e-3 and np.abs(slg - z).max() > 1e-3


def test_sd3_forward_feeds_1000_sigma_and_resume_is_exact(tmp_path, images):
    fam = get_family("sd3")

    def run(name, steps):
        return Trainer(sd3_config(tmp_path, name, images, steps=steps,
                                  train={"weighting_scheme": "cosmap", "timestep_type": "shift"}), verbose=False)
    full = run("full", 4).setup()
    x0, cond = fam.training_inputs(full.model, full.loader.next_batch(), full.device, full.cfg.train)
    t = flame.tensor(np.array([0.25, 0.75], np.float32), device="cpu")
    with flame.no_grad():
        np.testing.assert_array_equal(fam.forward(full.model, x0, t, cond).numpy(),
                                      full.model(x0, t * 1000, cond["y"], cond["context"]).numpy())
    full = run("full", 4).setup()   # (fresh: the batch above moved the loader)
    want = [full.train_step()[0] for _ in range(4)]
    first = run("part", 2).setup()
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    again = run("part", 4).setup()
    assert again.resumed_from and again.step == 2
    np.testing.assert_allclose([again.train_step()[0] for _ in range(2)], want[2:], rtol=1e-6)
    for a, b in zip(again.params, full.params):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- SDXL
def _sdxl_call(c):
    rng = np.random.default_rng(4)
    x = flame.tensor(rng.standard_normal((1, 4, 8, 8)).astype(np.float32), device="cpu")
    ctx = flame.tensor(rng.standard_normal((1, 77, c.context_dim)).astype(np.float32), device="cpu")
    y = flame.tensor(rng.standard_normal((1, c.adm_in_channels)).astype(np.float32), device="cpu")
    t = flame.tensor(np.array([500.0], np.float32), device="cpu")
    return lambda m: m(x, t, ctx, y)


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_sdxl_trains_from_an_image_folder_with_decoded_previews_and_a_lora_that_loads_back(tmp_path, images,
                                                                                          sdxl_model, fmt):
    cfg = sdxl_config(tmp_path, f"sdxl_{fmt}", sdxl_model, images, steps=2, save={"format": fmt},
                      sample={"sample_every": 2, "sample_steps": 3, "prompts": PROMPTS, "neg": "blurry",
                              "sampler": "euler_a" if fmt == "kohya" else "dpmpp_2m"})
    assert (cfg.train.noise_scheduler, cfg.sample.guidance_scale, cfg.name) == ("ddpm", 5.0, f"sdxl_{fmt}")
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert result["encoded"]["latents"] == 5
    assert tr.previews.prompts[0].cond["prompt_embeds"].shape == (77, 40)
    assert "negative_pooled_prompt_embeds" in tr.previews.prompts[0].cond
    _check_decoded_preview(tr, get_family("sdxl"), 2)
    sd = io.load_file(result["lora"])
    with io.safe_open(result["lora"]) as f:
        meta = f.metadata()
    if fmt == "kohya":
        assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in sd
        assert "lora_unet_middle_block_1_transformer_blocks_1_ff_net_2.lora_up.weight" in sd
        assert (meta["ss_network_module"], meta["ss_base_model_version"]) == ("networks.lora", "sdxl_base_v1-0")
    else:
        assert "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight" in sd
        assert "unet.up_blocks.0.attentions.2.proj_out.lora_B.weight" in sd
    fresh = load_unet(sdxl_model, dtype=flame.float32, device="cpu")
    _loads_back(tr, result["lora"], fresh, _sdxl_call(tr.spec))


def test_sdxl_size_conditioning_comes_from_each_samples_crop_and_bucket(tmp_path, images, sdxl_model):
    cfg = sdxl_config(tmp_path, "sizes", sdxl_model, images)
    tr = Trainer(cfg, verbose=False).setup()
    fam = get_family("sdxl")
    wide = next(i for i in range(len(tr.dataset)) if tr.dataset.original_size(i) == (64, 192))
    assert tr.dataset.target_size(wide) == (32, 96)                     # the 3:1 image's bucket
    batch = tr.loader.dataset.collate([tr.loader.dataset.get(wide, 0)])
    np.testing.assert_array_equal(batch["original_size"], [[64, 192]])
    crop = tuple(batch["crop_coords"][0])
    _, cond = fam.training_inputs(tr.model, batch, tr.device, cfg.train)
    pooled = flame.tensor(batch["pooled_prompt_embeds"], device="cpu")
    want = make_y(pooled, (64, 192), crop, (32, 96), size_embed_dim=tr.spec.size_embed_dim)
    np.testing.assert_allclose(cond["y"].numpy(), want.numpy(), rtol=1e-6)
    other = dict(batch, crop_coords=np.asarray([[crop[0], crop[1] + 8]], np.int64))
    _, moved = fam.training_inputs(tr.model, other, tr.device, cfg.train)
    d = np.abs(moved["y"].numpy() - cond["y"].numpy())
    P = tr.spec.pooled_dim
    assert d[:, :P].max() == 0 and d[:, P:].max() > 1e-3                 # only the size embeddings moved


def test_sdxl_resume_is_exact_with_v_prediction_min_snr_and_noise_offset(tmp_path, images, sdxl_model):
    train = {"prediction_type": "v_prediction", "zero_terminal_snr": True, "min_snr_gamma": 5.0,
             "noise_offset": 0.1, "min_timestep": 100, "max_timestep": 900}

    def run(name, steps):
        return Trainer(sdxl_config(tmp_path, name, sdxl_model, images, steps=steps, train=train), verbose=False)
    full = run("full", 4).setup()
    assert full.objective.prediction_type == "v_prediction" and full.objective.schedule.alphas_cumprod[-1] < 1e-12
    want = [full.train_step() for _ in range(4)]
    assert all(100 <= ts <= 899 for _, _, ts in want)
    first = run("part", 2).setup()
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    again = run("part", 4).setup()
    np.testing.assert_allclose([again.train_step()[0] for _ in range(2)], [w[0] for w in want[2:]], rtol=1e-6)
    for a, b in zip(again.params, full.params):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_sdxl_locon_trains_saves_conv_adapters_loads_back_and_resumes(tmp_path, images, sdxl_model):
    network = {"type": "locon", "linear": 4, "linear_alpha": 4, "conv": 2, "conv_alpha": 1, "target": "attention"}

    def run(name, steps):
        return Trainer(sdxl_config(tmp_path, name, sdxl_model, images, steps=steps, network=network), verbose=False)
    tr = run("locon", 2)
    result = tr.train()
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    adapted = {m: ad for m, _, ad in A.adapter_modules(tr.model)}
    conv3 = [m for m in adapted if m.endswith(("in_layers.2", "out_layers.3", ".op", ".conv"))]
    want3 = [n for n, m in tr.model.named_modules() if isinstance(m, flame_nn.Conv2d) and m.kernel_size == (3, 3)
             and n not in ("input_blocks.0.0", "out.2")]          # kohya leaves conv_in and conv_out alone
    assert conv3 == want3 and len(conv3) > 10
    assert all(adapted[m].rank == 2 and adapted[m].scale == 0.5 for m in conv3)
    skips = [m for m in adapted if m.endswith("skip_connection")]
    assert skips and all(adapted[m].rank == 4 and adapted[m].kernel_size == (1, 1) for m in skips)
    assert any(m.endswith("emb_layers.1") for m in adapted) and "input_blocks.0.0" not in adapted
    sd = io.load_file(result["lora"])
    down = sd["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"]
    assert down.ndim == 4 and down.shape[0] == 2 and down.shape[2:] == (3, 3)
    assert sd["lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight"].shape[1:] == (2, 1, 1)
    assert float(sd["lora_unet_input_blocks_1_0_in_layers_2.alpha"].numpy()) == 1.0
    with io.safe_open(result["lora"]) as f:
        assert json.loads(f.metadata()["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "1"}
    assert any(k.endswith("_op.lora_down.weight") for k in sd) and any("skip_connection" in k for k in sd)
    conv_ups = [adapted[m].lora_B for m in conv3]
    assert any(np.abs(p.detach().numpy()).max() > 0 for p in conv_ups)     # the conv adapters trained (up was 0)
    fresh = load_unet(sdxl_model, dtype=flame.float32, device="cpu")
    _loads_back(tr, result["lora"], fresh, _sdxl_call(tr.spec))
    # resume: the checkpoint's conv adapters come back
    first = run("part", 2).setup()
    first.train_step()
    first.save_checkpoint()
    again = run("part", 3).setup()
    assert len(again.params) == len(first.params)
    for a, b in zip(again.params, first.params):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
    # config errors
    with pytest.raises(ConfigError) as ei:
        sdxl_config(tmp_path, "x", sdxl_model, images, network={"conv": -1})
    assert "network.conv: the convolutions' rank, >= 1" in str(ei.value)
    with pytest.raises(ConfigError, match="network.conv_alpha: only used with network.conv"):
        sdxl_config(tmp_path, "x", sdxl_model, images, network={"conv_alpha": 4})


# ----------------------------------------------------------------------------- random presets, no files
@pytest.mark.parametrize("arch, size, channels", [("sd3", "sd3.5-tiny", 16), ("sdxl", "sdxl-tiny", 4)])
def test_random_tiny_presets_train_from_an_image_folder_without_files(tmp_path, images, arch, size, channels):
    cfg = image_config(tmp_path, arch, None, images, steps=2,
                       model={"arch": arch, "size": size, "name_or_path": None, "t5_max_length": 8 if arch == "sd3"
                              else None},
                       sample={"sample_every": 2, "sample_steps": 2, "prompts": PROMPTS})
    result = Trainer(cfg, verbose=False).train()
    assert result["samples_decoded"] and len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    lat = io.load_file(os.path.join(tmp_path, arch, "samples", "step_000002.safetensors"))["latents"].numpy()
    assert lat.shape == (2, channels, 8, 8)


# ----------------------------------------------------------------------------- refused before any model loads
def _before_any_model(monkeypatch, arch):
    fam = get_family(arch)

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the bad input was found")
    for name in ("load_vae", "load_text_encoders", "build_model"):
        monkeypatch.setattr(fam, name, loaded)


def test_bad_configs_are_named_before_anything_loads(tmp_path, images, sdxl_model, flux_file, monkeypatch):
    _before_any_model(monkeypatch, "sdxl")
    _before_any_model(monkeypatch, "sd3")
    with pytest.raises(ConfigError, match=r"model.name_or_path: .*flux-tiny.safetensors is not an SDXL UNet: it "
                                          r"looks like a Flux transformer .*\(model.arch: flux trains it\)"):
        image_config(tmp_path, "x", flux_file, images, model={"arch": "sdxl", "t5_max_length": None})
    with pytest.raises(ConfigError, match=r"is not an SD3 / SD3.5 MMDiT: it looks like a diffusers "
                                          r"StableDiffusionXLPipeline folder"):
        image_config(tmp_path, "x", sdxl_model, images, model={"arch": "sd3"})
    with pytest.raises(ConfigError) as ei:
        sdxl_config(tmp_path, "x", sdxl_model, images, network={"type": "dora", "target": ["re:.*in_layers\\.2"],
                                                                "conv": 4},
                    train={"timestep_type": "shift", "min_snr_gamma": 0},
                    sample={"slg_scale": 2.0, "sampler": "pndm", "scheduler": "karras"})
    msg = str(ei.value)
    for want in ("network.conv: convolution adapters are LoRA (LoCon) only; network.type is 'dora'",
                 "network.target: 're:.*in_layers\\\\.2' selects convolutions (input_blocks.1.0.in_layers.2",
                 "which dora cannot adapt (convolutions take LoRA / LoCon only)",
                 "train.timestep_type: not available: SDXL trains with the DDPM objective",
                 "train.min_snr_gamma: must be > 0", "sample.slg_scale: not available: skip-layer guidance",
                 "sample.sampler: 'pndm' is not one of ",
                 "sample.scheduler: a flow-matching families' option (SD3, Flux, Flux Kontext, Chroma, Qwen-Image); "
                 "SDXL previews use the model's own sigmas, got 'karras'"):
        assert want in msg, (want, msg)
    with pytest.raises(ConfigError, match=r"sample.sample_steps: lcm previews take at most 50 steps"):
        sdxl_config(tmp_path, "x", sdxl_model, images, sample={"sampler": "lcm", "sample_steps": 60})
    with pytest.raises(ConfigError, match=r"network.target: 'attention' selects row ranges of fused Linears "
                                          r"\(e.g. joint_blocks.0.x_block.attn.qkv\), which lokr cannot adapt"):
        sd3_config(tmp_path, "x", images, network={"type": "lokr", "target": "attention"})
    with pytest.raises(ConfigError) as ei:
        sd3_config(tmp_path, "x", images, train={"min_snr_gamma": 5, "weighting_scheme": "mode",
                                                 "timestep_type": "logit_normal"},
                   model={"clip_g_path": os.path.join(SD3_MODEL, "vae")}, sample={"slg_scale": 1.0,
                                                                              "slg_layers": [0, 5]},
                   network={"conv": 8, "conv_alpha": 4})
    msg = str(ei.value)
    for want in ("train.min_snr_gamma: not available: SD3 trains with flow matching",
                 "train.weighting_scheme: 'mode' names a timestep density",
                 "model: clip_g (model.clip_g_path): ", "is not a CLIP text encoder (CLIP-G): it looks like a VAE",
                 "sample.slg_layers: [0, 5] are not all joint blocks of this MMDiT (depth 2)",
                 "network.conv: the sd3 model has no convolutions to adapt"):
        assert want in msg, (want, msg)


def test_ai_toolkit_family_flags(tmp_path, images, sdxl_model):
    cfg = image_config(tmp_path, "xl", sdxl_model, images, model={"is_xl": True, "is_v_pred": True,
                                                                  "t5_max_length": None})
    assert (cfg.model.arch, cfg.train.prediction_type) == ("sdxl", "v_prediction")
    with pytest.raises(ConfigError, match=r"model.is_v3: true contradicts model.arch 'sdxl'"):
        sdxl_config(tmp_path, "xl", sdxl_model, images, model={"is_v3": True})
    with pytest.raises(ConfigError, match=r"model.is_v_pred: true contradicts train.prediction_type 'epsilon'"):
        sdxl_config(tmp_path, "xl", sdxl_model, images, model={"is_v_pred": True},
                    train={"prediction_type": "epsilon"})
    with pytest.raises(ConfigError, match=r"model.is_v2: not available: SD 1.x / 2.x"):
        sdxl_config(tmp_path, "xl", sdxl_model, images, model={"is_v2": True})


# ----------------------------------------------------------------------------- memory: fp8 storage of the blocks
@pytest.mark.parametrize("arch", ["sd3", "sdxl"])
@pytest.mark.parametrize("fp8_compute, budget, kind", [(False, None, "lora"), (True, None, "lora"),
                                                       (False, "1GiB", "lora"), (False, None, "dora")])
def test_model_quantize_stores_the_block_linears_in_fp8_and_trains(tmp_path, images, sdxl_model, arch, fp8_compute,
                                                                   budget, kind, monkeypatch):
    """The blocks' Linear weights of a model read from its file go to fp8 as they are read (checkpoint_io.fp8_on_read:
    the model is never whole on the device in its dtype), per tensor for fp8 compute, kept in host memory for the
    streamer under max_gpu_memory; the adapters go on top."""
    from flame_models import checkpoint_io as CIO
    from flame_nn.offload import is_fp8_linear
    train = {"fp8_compute": True} if fp8_compute else {}
    top = {"max_gpu_memory": budget} if budget else {}
    top["network"] = {"type": kind}       # (DoRA reads the fp8 rows dequantised: adapters.layer.base_rows)
    cfg = (sd3_config(tmp_path, arch, images, steps=2, model={"quantize": True}, train=train, **top) if arch == "sd3"
           else sdxl_config(tmp_path, arch, sdxl_model, images, steps=2, model={"quantize": True}, train=train, **top))
    on_read, real = [], CIO.fp8_on_read

    def spy(stacks, **kw):
        on_read.append(kw)
        return real(stacks, **kw)
    monkeypatch.setattr(CIO, "fp8_on_read", spy)
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert on_read == [{"per_tensor": fp8_compute, "device": tr.device, "keep": "cpu" if budget else None}]
    assert (tr.streamer is not None) == bool(budget)
    stacks = tuple(s + "." for s in get_family(arch).block_stacks(tr.model))
    fp8 = {n for n, m in tr.model.named_modules() if is_fp8_linear(m)}
    linears = {n for n, m in tr.model.named_modules() if n.startswith(stacks) and type(m).__name__.endswith("Linear")}
    assert fp8 and fp8 == linears                                     # every block Linear, nothing outside them
    assert all(tr.model.get_submodule(n).fp8_compute is fp8_compute for n in fp8)
    assert np.isfinite(result["losses"]).all()


@pytest.mark.parametrize("stream", [False, True])
def test_random_t5_with_quantize_te_holds_its_block_linears_in_fp8(stream):
    # the random-weights T5 (model.size without files) quantises each block as drawn: with the blocks still
    # trainable the fp8 conversion would skip them and a real-size T5 would sit in bfloat16
    from flame_models.text_encoders import T5Config
    from flame_models.training import family_parts as S
    from flame_nn.offload import is_fp8_linear
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
    t5 = S.random_t5(cfg, "cpu", flame.Generator(flame.device("cpu")).manual_seed(0), True, stream)
    linears = [m for m in t5.encoder.block.modules() if type(m).__name__.endswith("Linear")]
    assert len(linears) == 2 * 7 and all(is_fp8_linear(m) for m in linears)
    assert not any(p.requires_grad for p in t5.parameters())
    if stream:   # packed to host memory: nothing of the blocks stays on the device as a trainable parameter
        assert len(t5.streamer.streamed) == 2


# ----------------------------------------------------------------------------- T5 optional; the example script
def test_sd3_without_t5_encodes_zeros_in_its_place(tmp_path, images):
    cfg = sd3_config(tmp_path, "no_t5", images, model={"use_t5": False},
                     sample={"sample_every": 0, "prompts": ["a red square"]})
    tr = Trainer(cfg, verbose=False).setup()
    with_t5 = Trainer(sd3_config(tmp_path, "t5", images, sample={"sample_every": 0, "prompts": ["a red square"]}),
                      verbose=False).setup()
    a, b = tr.previews.prompts[0].cond["prompt_embeds"], with_t5.previews.prompts[0].cond["prompt_embeds"]
    assert a.shape == b.shape == (77 + 8, 48)
    assert np.all(a[77:] == 0) and np.abs(b[77:]).max() > 0            # T5's tokens: zeros / encoded
    np.testing.assert_allclose(a[:77], b[:77], rtol=1e-6)              # the CLIP part is the same
    assert "t5:none" in tr.family.text_encoder_id(cfg.model, tr.device, None)


def test_the_example_script_trains_sd3_and_sdxl(tmp_path, images, sdxl_model, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "train_flux_lora", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--data", images, "--resolution", "64", "--steps", "2", "--output", str(tmp_path), "--device", "cpu",
              "--sample-every", "0", "--batch-size", "1", "--optimizer", "adamw"]
    assert example.main(["--arch", "sd3", "--model", SD3_MODEL] + common) == 0
    assert example.main(["--arch", "sdxl", "--model", sdxl_model] + common) == 0
    for name in ("sd3_lora", "sdxl_lora"):                            # the families' default run names
        assert os.path.isfile(os.path.join(tmp_path, name, f"{name}.safetensors"))
    capsys.readouterr()
    assert example.main(["--arch", "sdxl", "--model", SD3_MODEL] + common) == 2
    assert "is not an SDXL UNet: it looks like a diffusers StableDiffusion3Pipeline folder" in capsys.readouterr().err
