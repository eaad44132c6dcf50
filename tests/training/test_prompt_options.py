"""Sample prompts' own options (kohya's and ai-toolkit's flags: --w --h --d/--seed --s/--steps --l/--cfg/--g --n --ss
--ctrl_img): read exactly, refused when unknown, repeated or out of range (naming the prompt, before anything loads),
and applied -- each preview sampled at its own size, seed, steps, guidance, sampler and negative prompt, its latents
and PNG at that size, the grid holding rows of several sizes."""
import os

import numpy as np
import pytest
from PIL import Image

from flame_core import io
from flame_models.training.config import ConfigError
from flame_models.training.prompt_options import PromptOptionError, PromptOptions, parse
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_sd_families import SD3_MODEL


def test_flags_read_as_kohya_and_ai_toolkit_write_them():
    assert parse("a photo of ohwx") == PromptOptions("a photo of ohwx")
    o = parse("a photo --w 768 --h 512 --d 7 --s 28 --l 3.5 --n blurry, low  quality --ss heun")
    assert o == PromptOptions("a photo", width=768, height=512, seed=7, steps=28, cfg=3.5,
                              negative="blurry, low  quality", sampler="heun")
    assert o.scale == 3.5
    assert parse("x --seed 0 --steps 4 --cfg 2") == PromptOptions("x", seed=0, steps=4, cfg=2.0)
    assert parse("x --g 4").scale == 4.0 and parse("x --n").negative == ""
    assert parse("x --l 1 --g 3.5").scale == 3.5                  # kohya's Flux prompt: embedded guidance, no CFG
    assert parse("x --m 0.5").multiplier == 0.5 and parse("x --network_multiplier 0").multiplier == 0.0
    assert parse("well--known a--w 5") == PromptOptions("well--known a--w 5")     # a flag starts a word
    assert parse("edit --ctrl_img /a b/c.png --w 64").ctrl_img == "/a b/c.png"
    assert parse("--w 64") == PromptOptions("", width=64)
    assert o.size(100, 200) == (512, 768) and parse("x --w 64").size(100, 200) == (100, 64)


@pytest.mark.parametrize("prompt, words", [
    ("x --gr 0.7", "--gr: not a sample-prompt option here"),
    ("x --m inf", "--m: a finite weight"),
    ("x --w 64 --w 32", "--w: the prompt sets its width twice"),
    ("x --d 1 --seed 2", "--seed: the prompt sets its seed twice"),
    ("x --w big", "--w: an integer, got 'big'"),
    ("x --w 0", "--w: the preview's width in pixels, 1 to 16384, got 0"),
    ("x --s 0", "--s: sampling steps, 1 to 1000"),
    ("x --d -1", "--d: a seed"),
    ("x --l nan", "--l: a finite guidance scale"),
    ("x --g 2 --g 3", "--g: the prompt sets its guidance twice"),
    ("x --l", "--l: a number, got ''"),
    ("x --ss", "--ss: a sampler name"),
])
def test_bad_flags_are_errors_that_name_them(prompt, words):
    with pytest.raises(PromptOptionError) as e:
        parse(prompt)
    assert words in str(e.value)


@pytest.fixture
def images(tmp_path):
    return draw_images(tmp_path / "images", n_concept=2, n_other=2)


def _flux(tmp_path, images, name="p", **sample):
    return image_config(tmp_path, name, None, images, steps=2, model={"name_or_path": None, "t5_max_length": 8},
                        sample={"sample_every": 2, "sample_steps": 2, "width": 64, "height": 64, **sample})


@pytest.mark.parametrize("prompts, words", [
    (["a --n blurry"], r"sample.prompts\[0\]: --n: this flux preview runs no true CFG, so no negative prompt"),
    (["a --g 3.5 --l 1 --n blurry"], r"sample.prompts\[0\]: --n: this flux preview runs no true CFG"),
    (["a", "b --w 40"], r"sample.prompts\[1\]: --w 40: the flux family's previews take multiples of 16 px"),
    (["a --ss dpm_2"], r"sample.prompts\[0\]: --ss dpm_2: Flux previews use"),
    (["a --frames 3"], r"sample.prompts\[0\]: --frames: not a sample-prompt option here"),
    (["a --g 3.5 --l 0.5"], r"sample.prompts\[0\]: --l 0.5 beside --g: the true-CFG scale, >= 1"),
    (["a --ctrl_img x.png"], r"sample.prompts\[0\]: --ctrl_img: the flux family takes no control image"),
])
def test_config_errors_name_the_prompt(tmp_path, images, prompts, words):
    with pytest.raises(ConfigError, match=words):
        _flux(tmp_path, images, prompts=prompts)


def test_a_size_over_the_models_table_is_refused_before_anything_loads(tmp_path, images):
    cfg = image_config(tmp_path, "big", SD3_MODEL, images, steps=2, model={"arch": "sd3"},
                       sample={"sample_every": 2, "prompts": ["a", "b --w 512 --h 256"], "width": 64, "height": 64})
    tr = Trainer(cfg, verbose=False)
    with pytest.raises(ConfigError, match=r"sample.prompts\[1\]: --w 512 --h 256: exceeds 128 px a side"):
        tr.setup()
    assert tr.prepared is None


def test_each_preview_is_sampled_with_its_own_options(tmp_path, images):
    prompts = ["[trigger] wide --w 64 --h 32 --d 3 --s 3 --l 2.5", "a square --seed 9 --ss heun", "plain"]
    cfg = _flux(tmp_path, images, prompts=prompts, seed=5, guidance_scale=4.0)
    tr = Trainer(cfg, verbose=False).setup()
    assert [p.label for p in tr.previews.prompts] == ["ohwx wide", "a square", "plain"]   # flags taken out
    files = tr.sample()
    fam = tr.family
    lat = io.load_file(os.path.join(tr.out, "samples", "step_000000.safetensors"))
    assert sorted(lat) == ["latents_0", "latents_1", "latents_2"]                       # sizes differ: one each
    assert lat["latents_0"].shape == (16, 4, 8) and lat["latents_1"].shape == lat["latents_2"].shape == (16, 8, 8)
    want = [dict(height=32, width=64, steps=3, guidance=2.5, seed=3, sampler="euler"),
            dict(height=64, width=64, steps=2, guidance=4.0, seed=9, sampler="heun"),
            dict(height=64, width=64, steps=2, guidance=4.0, seed=5, sampler="euler")]
    tr.model.eval()
    for i, kw in enumerate(want):
        z = fam.sample(tr.model, tr.previews.prompts[i].cond, device=tr.device, scheduler="simple", **kw)
        np.testing.assert_array_equal(lat[f"latents_{i}"].numpy(), z[0].float().cpu().numpy(), err_msg=str(i))
    pngs = [f for f in files if str(f).endswith(".png")]
    assert [Image.open(f).size for f in pngs] == [(64, 32), (64, 64), (64, 64)]
    grid = tr.previews.save_grid(os.path.join(tr.out, "samples.png"))
    assert Image.open(grid).size[1] > 32 + 64 + 64                                        # rows of their own heights
    # a resumed run's grid reads the step back from its per-prompt latents file
    assert [x.shape for x in tr.previews.restore(0)[0][1]] == [(32, 64, 3), (64, 64, 3), (64, 64, 3)]


def test_a_prompts_negative_is_encoded_for_it(tmp_path, images):
    """SD3 (CFG previews): --n gives that prompt its own negative; the others keep sample.neg."""
    def run(name, neg, prompts):
        cfg = image_config(tmp_path, name, SD3_MODEL, images, steps=2, model={"arch": "sd3"},
                           sample={"sample_every": 2, "sample_steps": 1, "width": 64, "height": 64, "neg": neg,
                                   "prompts": prompts})
        return Trainer(cfg, verbose=False).setup().previews.prompts
    got = run("n1", "foggy", ["a square --n blurry dark", "a circle"])
    again = run("n2", "blurry dark", ["a square", "a circle --n foggy"])
    keys = [k for k in got[0].cond if k.startswith("negative_")]
    assert keys
    for k in keys:
        np.testing.assert_array_equal(got[0].cond[k], again[0].cond[k])       # "blurry dark" both times
        np.testing.assert_array_equal(got[1].cond[k], again[1].cond[k])       # "foggy" both times
        assert not np.array_equal(got[0].cond[k], got[1].cond[k])


def test_a_prompts_multiplier_weighs_the_adapters_while_it_samples(tmp_path, images):
    """--m 0 samples the base model, --m 1 (or none) the LoRA as trained; the weight is 1 again afterwards. A full
    fine-tune has no adapters to weigh: refused."""
    import flame_nn.adapters as A
    cfg = _flux(tmp_path, images, prompts=["a red square --m 0", "a red square", "a red square --m 0.5"])
    tr = Trainer(cfg, verbose=False).setup()
    for _ in range(2):
        tr.train_step()                                   # adapters away from their zero start
    tr.sample()
    lat = io.load_file(os.path.join(tr.out, "samples", "step_000002.safetensors"))["latents"].numpy()
    assert all(m._weights["default"] == 1.0 for _, m in A.adapted_modules(tr.model))
    tr.model.eval()
    fam, sm, cond = tr.family, tr.cfg.sample, tr.previews.prompts[0].cond
    kw = dict(height=64, width=64, steps=2, guidance=sm.guidance_scale, seed=sm.seed, device=tr.device,
              **fam.sample_options(tr.cfg))
    for i, m in ((0, 0.0), (1, 1.0), (2, 0.5)):
        A.set_adapter_weight(tr.model, "default", m)
        np.testing.assert_array_equal(lat[i], fam.sample(tr.model, cond, **kw)[0].float().cpu().numpy(), err_msg=m)
    A.set_adapter_weight(tr.model, "default", 1.0)
    assert not np.array_equal(lat[0], lat[1])
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: --m: a full fine-tune has no adapters"):
        image_config(tmp_path, "full", None, images, steps=2, model={"name_or_path": None, "t5_max_length": 8},
                     network={"type": "full"}, drop=("network.linear", "network.linear_alpha", "network.target"),
                     sample={"prompts": ["a --m 0.5"]}, save={"save_every": 2, "dtype": "fp32"})


def test_g_and_l_together(tmp_path, images):
    """kohya's Flux prompt `--l 1 --g 3.5` reads as guidance 3.5; on a CFG family --g and --l are one setting."""
    cfg = _flux(tmp_path, images, prompts=["a --l 1 --g 3.5"])
    assert Trainer(cfg, verbose=False).setup().previews._settings(0)["guidance"] == 3.5
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: --g and --l \(--cfg\) both set the sd3 previews"):
        image_config(tmp_path, "sd3g", SD3_MODEL, images, steps=2, model={"arch": "sd3"},
                     sample={"sample_every": 2, "prompts": ["a --g 3 --l 4"], "width": 64, "height": 64})


def test_sample_network_multiplier_weighs_the_previews_without_their_own_m(tmp_path, monkeypatch):
    """ai-toolkit's sample.network_multiplier: every preview without --m samples with the adapters at that weight (a
    prompt's --m wins); back to 1 after; refused for a full fine-tune."""
    import flame_nn.adapters as A
    from flame_models.training import samples as samples_module
    from flame_models.training.config import config_from_dict

    from .conftest import tiny_config
    seen = []
    real = samples_module.Previews.run

    def spy(self, model, step, progress_file=None):
        def sample(*a, **k):
            seen.append(next(m._weights["default"] for _, m in A.adapted_modules(model)))
            return self_sample(*a, **k)
        self_sample = self.family.sample
        monkeypatch.setattr(self.family, "sample", sample)
        try:
            return real(self, model, step, progress_file)
        finally:
            monkeypatch.setattr(self.family, "sample", self_sample)
    monkeypatch.setattr(samples_module.Previews, "run", spy)
    c = tiny_config(tmp_path, "mult", steps=3, sample={"sample_every": 0, "sample_steps": 2, "num_samples": 2,
                                                       "network_multiplier": 0.25})
    tr = Trainer(c, verbose=False).setup()
    tr.previews.prompts[1] = tr.previews.prompts[1]._replace(options=parse("x --m 0.75"))
    tr.sample()
    assert seen == [0.25, 0.75]
    assert {m._weights["default"] for _, m in A.adapted_modules(tr.model)} == {1.0}
    with pytest.raises(ConfigError, match="sample.network_multiplier: a full fine-tune has no adapters"):
        config_from_dict({"name": "f", "training_folder": str(tmp_path), "network": {"type": "full"},
                          "synthetic": {"num_samples": 2}, "model": {"size": "flux-tiny"},
                          "sample": {"network_multiplier": 0.5}})


def test_flux_previews_run_true_cfg_against_their_negative_prompts(tmp_path, images):
    """sample.true_cfg / true_cfg_start / neg (SimpleTuner's validation_guidance_real / no_cfg_until_timestep /
    negative prompt), and kohya's --l beside --g with --n on one prompt; a prompt with --l 1 runs none."""
    prompts = ["a --g 3.5 --l 4 --n blurry", "b", "c --g 3.5 --l 1"]
    cfg = _flux(tmp_path, images, prompts=prompts, true_cfg=2.0, true_cfg_start=1, neg="ugly")
    tr = Trainer(cfg, verbose=False).setup()
    settings = [tr.previews._settings(i) for i in range(3)]
    assert [(a["guidance"], a["true_cfg"], a["true_cfg_start"]) for a in settings] == [
        (3.5, 4.0, 1), (4.0, 2.0, 1), (3.5, 1.0, 1)]
    conds = [p.cond for p in tr.previews.prompts]
    negs = [c["negative_prompt_embeds"] for c in conds]
    assert not np.array_equal(negs[0], negs[1]) and np.array_equal(negs[1], negs[2])   # --n blurry; sample.neg
    tr.sample()
    lat = io.load_file(os.path.join(tr.out, "samples", "step_000000.safetensors"))["latents"].numpy()
    fam = tr.family
    tr.model.eval()
    for i, kw in enumerate(settings):
        z = fam.sample(tr.model, conds[i], device=tr.device, **kw)[0].float().cpu().numpy()
        np.testing.assert_array_equal(lat[i], z, err_msg=str(i))
        plain = fam.sample(tr.model, conds[i], device=tr.device, **{**kw, "true_cfg": 1.0})[0].float().cpu().numpy()
        assert (np.abs(z - plain).max() > 0) == (kw["true_cfg"] > 1), i
    # without true CFG no negative prompt is encoded
    off = Trainer(_flux(tmp_path, images, name="off", prompts=["a", "b --l 3"]), verbose=False).setup()
    assert all("negative_prompt_embeds" not in p.cond for p in off.previews.prompts)
    with pytest.raises(ValueError, match="needs the negative prompt's conditioning"):
        fam.sample(tr.model, off.previews.prompts[0].cond, device=tr.device, **settings[1])


@pytest.mark.parametrize("sample, words", [
    ({"prompts": ["a"], "neg": "ugly"}, r"sample.neg: not available: Flux-dev is guidance-distilled; its previews "
                                        r"take a negative prompt only with true CFG"),
    ({"true_cfg": 2.0}, r"sample.true_cfg: true CFG runs the previews of sample.prompts"),
    ({"prompts": ["a"], "true_cfg": 0.5}, r"sample.true_cfg: the true-CFG scale, >= 1"),
    ({"prompts": ["a"], "true_cfg_start": 2}, r"sample.true_cfg_start: no preview runs true CFG"),
    ({"prompts": ["a"], "true_cfg": 2.0, "true_cfg_start": -1}, r"sample.true_cfg_start"),
])
def test_true_cfg_settings_are_checked(tmp_path, images, sample, words):
    with pytest.raises(ConfigError, match=words):
        _flux(tmp_path, images, **sample)


def test_true_cfg_is_fluxs(tmp_path, images):
    with pytest.raises(ConfigError, match=r"sample.true_cfg: not available: the sd3 family does not use it"):
        image_config(tmp_path, "sd3t", SD3_MODEL, images, steps=2, model={"arch": "sd3"},
                     sample={"sample_every": 2, "prompts": ["a"], "true_cfg": 3.0, "width": 64, "height": 64})
    cfg = _flux(tmp_path, images, name="ai", prompts=["a"], neg="")   # ai-toolkit's Flux configs write neg: ""
    assert Trainer(cfg, verbose=False).setup().previews.prompts[0].cond.get("negative_prompt_embeds") is None


def test_sdxl_previews_rescale_their_guidance(tmp_path, images):
    """sample.guidance_rescale (ai-toolkit's; SimpleTuner's validation_guidance_rescale): SDXL's CFG rescaled as
    diffusers' guidance_rescale (its sampler's golden test: tests/models/test_sdxl_sampling.py); other families
    refuse it."""
    sample = {"sample_every": 2, "sample_steps": 2, "width": 64, "height": 64, "prompts": ["a"],
              "guidance_scale": 5.0, "guidance_rescale": 0.7}
    cfg = image_config(tmp_path, "gr", None, images, steps=2, drop=["model.name_or_path", "model.t5_max_length"],
                       model={"arch": "sdxl", "size": "sdxl-tiny"}, sample=sample)
    tr = Trainer(cfg, verbose=False).setup()
    args = tr.previews._settings(0)
    assert args["guidance_rescale"] == 0.7
    tr.sample()
    lat = io.load_file(os.path.join(tr.out, "samples", "step_000000.safetensors"))["latents"].numpy()
    tr.model.eval()
    cond = tr.previews.prompts[0].cond
    z = tr.family.sample(tr.model, cond, device=tr.device, **args)[0].float().cpu().numpy()
    np.testing.assert_array_equal(lat[0], z)
    plain = tr.family.sample(tr.model, cond, device=tr.device, **{**args, "guidance_rescale": 0.0})
    assert np.abs(plain[0].float().cpu().numpy() - z).max() > 0
    with pytest.raises(ConfigError, match=r"sample.guidance_rescale: a number in \[0, 1\]"):
        image_config(tmp_path, "gr2", None, images, drop=["model.name_or_path", "model.t5_max_length"],
                     model={"arch": "sdxl", "size": "sdxl-tiny"}, sample=dict(sample, guidance_rescale=1.5))
    with pytest.raises(ConfigError, match=r"sample.guidance_rescale: not available"):
        _flux(tmp_path, images, name="fgr", prompts=["a"], guidance_rescale=0.5)
