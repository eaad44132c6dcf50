"""Qwen-Image as a trainer family on the CPU with its tiny random preset: a LoRA run through `python -m
flame_models.train` on synthetic samples (random latents and text states), a run on precomputed sample files with a
padding mask and a preview, the preview sampler with CFG, the PEFT and kohya files' names (diffusers'
QwenImagePipeline.load_lora_weights names), an image-folder run with the tiny preset's random stand-in VAE / text
encoder / tokenizer and CFG previews, and the parts a lone file lacks."""
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models import train
from flame_models.data.samples import write_sample
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .conftest import draw_images


def _qwen(tmp_path, name, save=None, **top):
    """A qwen-image-tiny run of 3 steps on synthetic samples (tiny_config's), the family's LoRA file format unless
    `save` names one."""
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu",
         "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
         "synthetic": {"num_samples": 8, "height": 32, "width": 32, "text_length": 8, "seed": 0},
         "train": {"steps": 3, "batch_size": 2, "lr": 3e-3, "lr_warmup_steps": 0, "dtype": "fp32",
                   "gradient_checkpointing": False, "seed": 0},
         "model": {"arch": "qwen_image", "dtype": "fp32"}, "sample": {"sample_every": 0},
         "save": {"save_every": 3, "dtype": "fp32", **(save or {})}}
    for k, v in top.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return config_from_dict(d)


def _lora_keys(folder, name):
    path = os.path.join(folder, name, f"{name}.safetensors")
    with io.safe_open(path) as f:
        return sorted(f.keys()), f.metadata() or {}


def test_the_train_command_trains_the_tiny_random_qwen_image(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"training_folder: {tmp_path}\nmodel: {{arch: qwen_image}}\ndevice: cpu\n"
                    f"synthetic: {{num_samples: 4, height: 32, width: 48, text_length: 6}}\n"
                    f"train: {{steps: 2, batch_size: 2, lr_warmup_steps: 0, dtype: fp32, "
                    f"gradient_checkpointing: false}}\nsample: {{sample_every: 0}}\n"
                    f"network: {{linear: 4, linear_alpha: 4}}\n")
    assert train.main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "RANDOM qwen-image-tiny (qwen_image)" in out
    keys, meta = _lora_keys(str(tmp_path), "qwen_image_lora")
    # PEFT names = diffusers' module names under transformer. (the default 'attention' preset: the image stream's)
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert "transformer.transformer_blocks.1.attn.to_out.0.lora_B.weight" in keys
    assert not any("add_q_proj" in k or "lora_down" in k for k in keys)
    assert len(keys) == 2 * 4 * 2                                     # 2 blocks x 4 Linears x (A, B)
    assert meta.get("modelspec.architecture") == "qwen-image/lora"


def test_precomputed_samples_with_a_padding_mask_train_and_preview(tmp_path, monkeypatch):
    fam = get_family("qwen_image")
    folder = tmp_path / "samples"
    folder.mkdir()
    rng = np.random.default_rng(0)
    J = fam.preset("qwen-image-tiny").joint_attention_dim
    for i in range(4):
        mask = np.zeros(7, np.float32)
        mask[:4 + i % 3] = 1
        write_sample(str(folder / f"{i:04d}.safetensors"), latents=rng.standard_normal((16, 4, 6)).astype(np.float32),
                     prompt_embeds=(rng.standard_normal((7, J)) * mask[:, None]).astype(np.float32),
                     prompt_mask=mask)
    emb = tmp_path / "prompt.safetensors"
    write_sample(str(emb), prompt_embeds=rng.standard_normal((5, J)).astype(np.float32),
                 prompt_mask=np.ones(5, np.float32))
    seen, forward = [], fam.forward

    def spy(model, x_t, t, cond):
        seen.append((tuple(x_t.shape), tuple(cond["txt_mask"].shape), tuple(cond["grid"].shape)))
        return forward(model, x_t, t, cond)
    monkeypatch.setattr(fam, "forward", spy)
    calls, sample = [], fam.sample

    def spy_sample(model, cond, **kw):
        calls.append(sorted(cond))
        return sample(model, cond, **kw)
    monkeypatch.setattr(fam, "sample", spy_sample)
    cfg = _qwen(tmp_path, "pre", synthetic=None, datasets=[{"folder_path": str(folder)}],
                sample={"sample_every": 3, "prompt_embeds": [str(emb)], "width": 32, "height": 32,
                        "sample_steps": 2})
    trainer = Trainer(cfg, verbose=False)
    trainer.train()
    assert seen and all(s == ((2, 6, 64), (2, 7), (2, 3)) for s in seen)      # (4, 6) latents: 2 x 3 tokens
    assert calls and calls[0] == ["prompt_embeds", "prompt_mask"]      # no negative given: no CFG, as the pipeline
    assert os.path.exists(os.path.join(str(tmp_path), "pre", "pre.safetensors"))


def test_the_tiny_preset_trains_from_an_image_folder_with_cfg_previews(tmp_path, monkeypatch):
    from flame_models.qwen_image import family_parts as P
    images = draw_images(tmp_path / "img")
    seen, encode = [], P.QwenImageTextEncoders.encode

    def spy(self, prompts, **kw):
        out = encode(self, prompts, **kw)
        seen.append((len(prompts), tuple(out["prompt_embeds"].shape), out["prompt_mask"].numpy().sum(axis=1)))
        return out
    monkeypatch.setattr(P.QwenImageTextEncoders, "encode", spy)
    cfg = _qwen(tmp_path, "img", synthetic=None, trigger_word="ohwx",
                datasets=[{"folder_path": images, "resolution": 64, "bucket_tolerance": 32}],
                sample={"sample_every": 3, "sample_steps": 2, "prompts": ["[trigger] on a blue background"],
                        "neg": "blurry"})
    result = Trainer(cfg, verbose=False).train()
    assert result["samples_decoded"] and np.isfinite(result["losses"]).all()
    assert seen and all(shape[1:] == (32, 48) for _, shape, _ in seen)        # TEXT_LENGTH tokens, 48 wide
    assert all(0 < n < 32 for _, _, counts in seen for n in counts)          # the template prefix dropped
    lat = io.load_file(os.path.join(str(tmp_path), "img", "samples", "step_000003.safetensors"))["latents"].numpy()
    assert lat.shape == (1, 16, 8, 8)


def test_the_text_encoder_is_held_in_fp8_and_streamed_as_t5(tmp_path, monkeypatch):
    """Qwen2.5-VL while captions are encoded, as T5 (training.family_parts.t5_storage): bfloat16, fp8 when
    model.quantize_te asks or the budget needs it, its layers streamed when even fp8 does not fit; the cache key
    and the description say which; the stand-in encodes the same states streamed as resident."""
    from flame_models.qwen_image import family_parts as P
    from flame_nn.offload.fp8 import is_fp8_linear
    GiB = 2 ** 30
    model = _qwen(tmp_path, "te").model
    monkeypatch.setattr(P, "_te_params", lambda m: 7_070_000_000)            # the released 7B's language model
    assert P.te_storage(model, "cuda", None) == "bf16"
    assert P.te_storage(model, "cuda", 24 * GiB) == "bf16"
    assert P.te_storage(model, "cuda", 12 * GiB) == "fp8"
    assert P.te_storage(model, "cuda", 8 * GiB) == "fp8+stream"
    assert P.te_loading("fp8+stream") == ("fp8", True) and P.te_loading("bf16") == (None, False)
    assert "fp8+stream" in P.describe(model, "cuda", 8 * GiB)
    monkeypatch.undo()
    assert P.te_storage(model, "cpu", None) == "float32"
    plain = P.load_text_encoders_for(model, "cpu")
    want = plain.encode(["a red square", "a cat"])
    model.quantize_te = True
    assert P.te_storage(model, "cpu", None) == "fp8"
    assert P.text_id(model, "cpu") != P.text_id(_qwen(tmp_path, "te").model, "cpu")      # fp8 states: own cache
    fp8 = P.load_text_encoders_for(model, "cpu")
    assert all(is_fp8_linear(layer.mlp.up_proj) for layer in fp8.text_encoder.layers)
    got = fp8.encode(["a red square", "a cat"])
    np.testing.assert_array_equal(got["prompt_mask"].numpy(), want["prompt_mask"].numpy())
    a, b = got["prompt_embeds"].numpy(), want["prompt_embeds"].numpy()
    assert 0 < np.abs(a - b).max() < 0.1 * np.abs(b).max()
    monkeypatch.setattr(P, "te_storage", lambda m, d, b: "fp8+stream")
    streamed = P.load_text_encoders_for(model, "cpu")
    assert "2 streamed" in str(streamed.text_encoder.streamer)
    np.testing.assert_allclose(streamed.encode(["a red square", "a cat"])["prompt_embeds"].numpy(), a, rtol=1e-6,
                               atol=1e-6)
    streamed.free()
    with pytest.raises(RuntimeError, match="were freed"):
        streamed.encode(["a cat"])


def test_a_file_without_its_pipeline_folder_names_the_missing_parts(tmp_path):
    from flame_models.qwen_image import QwenImageTransformer2DModel, save_qwen_image
    flame.manual_seed(0)
    path = str(tmp_path / "qwen.safetensors")
    save_qwen_image(QwenImageTransformer2DModel("qwen-image-tiny", dtype=flame.float32, device="cpu"), path)
    images = draw_images(tmp_path / "img", n_concept=1, n_other=1)
    with pytest.raises(ConfigError, match="the VAE: .* set model.vae_path(.|\n)*the text encoder: (.|\n)*the "
                                          "tokenizer: "):
        _qwen(tmp_path, "f", synthetic=None, model={"arch": "qwen_image", "name_or_path": path},
              datasets=[{"folder_path": images, "resolution": 64}])

def test_the_family_defaults_and_a_kohya_file(tmp_path):
    cfg = _qwen(tmp_path, "k", save={"format": "kohya"}, network={"target": "attention_all"})
    assert cfg.train.timestep_type == "uniform" and cfg.name == "k"
    Trainer(cfg, verbose=False).train()
    keys, _ = _lora_keys(str(tmp_path), "k")
    assert "lora_unet_transformer_blocks_0_attn_add_k_proj.lora_down.weight" in keys
    assert "lora_unet_transformer_blocks_1_attn_to_add_out.alpha" in keys


def test_sampling_follows_the_pipelines_schedule_and_rescales_cfg():
    from flame_models.qwen_image import sampling as S
    s = S.sigmas(4, 4096)
    assert s[0] == pytest.approx(1.0) and s[-2] == pytest.approx(0.02) and s[-1] == 0.0
    assert np.all(np.diff(s) < 0)
    assert S.shift_mu(4096) == pytest.approx(0.6935, abs=1e-4)
    assert S.sigmas(1, 4096).tolist() == [1.0, 0.0]                       # one step: from noise straight to x0
    rng = np.random.default_rng(0)
    pos = flame.tensor(rng.standard_normal((1, 3, 8)).astype(np.float32))
    neg = flame.tensor(rng.standard_normal((1, 3, 8)).astype(np.float32))
    v = S.guided_velocity(pos, neg, 4.0).numpy()
    c = neg.numpy() + 4.0 * (pos.numpy() - neg.numpy())
    np.testing.assert_allclose(np.linalg.norm(v, axis=-1), np.linalg.norm(pos.numpy(), axis=-1), rtol=1e-5)
    np.testing.assert_allclose(v / np.linalg.norm(v, axis=-1, keepdims=True),
                               c / np.linalg.norm(c, axis=-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_the_preview_sampler_guides_only_with_a_negative_prompt():
    from flame_models.qwen_image import QwenImageTransformer2DModel
    from flame_models.qwen_image import sampling as S
    flame.manual_seed(0)
    model = QwenImageTransformer2DModel("qwen-image-tiny", dtype=flame.float32, device="cpu")
    rng = np.random.default_rng(1)
    J = model.params.joint_attention_dim
    mask = np.array([[1, 1, 1, 0]], np.float32)
    pos = {"prompt_embeds": rng.standard_normal((1, 4, J)).astype(np.float32), "prompt_mask": mask}
    neg = {"prompt_embeds": rng.standard_normal((1, 2, J)).astype(np.float32), "prompt_mask": np.ones((1, 2))}
    kw = dict(height=32, width=48, steps=3, seeds=[7])
    plain = S.sample_latents(model, pos, None, **kw).numpy()
    assert plain.shape == (1, 16, 4, 6) and np.isfinite(plain).all()
    assert np.array_equal(plain, S.sample_latents(model, pos, neg, cfg=1.0, **kw).numpy())     # cfg 1: unguided
    guided = S.sample_latents(model, pos, neg, cfg=4.0, **kw).numpy()
    assert np.isfinite(guided).all() and not np.allclose(guided, plain, atol=1e-4)
    # the padded 4th token is masked: any value there gives the same latents
    pos2 = {"prompt_embeds": pos["prompt_embeds"].copy(), "prompt_mask": mask}
    pos2["prompt_embeds"][0, 3] = 100.0
    np.testing.assert_allclose(S.sample_latents(model, pos2, None, **kw).numpy(), plain, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    return tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "Qwen-Image-tiny", seed=4)


def test_a_lora_trained_on_a_pipeline_folder_changes_what_generate_draws(tmp_path, qwen_folder, capsys):
    from flame_models.generate import generate, main
    images = draw_images(tmp_path / "img")
    cfg = _qwen(tmp_path, "f", synthetic=None, model={"arch": "qwen_image", "name_or_path": qwen_folder},
                datasets=[{"folder_path": images, "resolution": 64, "bucket_tolerance": 32}],
                network={"target": "all_linear"}, train={"lr": 0.05, "steps": 2})
    result = Trainer(cfg, verbose=False).train()
    keys = set(io.load_file(result["lora"]))
    assert "transformer.transformer_blocks.1.img_mlp.net.0.proj.lora_A.weight" in keys
    kw = dict(width=32, height=32, steps=2, seed=3, device="cpu", progress=False, log=lambda *a: None)
    base = np.asarray(generate(qwen_folder, "a red square", **kw)[0], np.int16)
    assert base.shape == (32, 32, 3)
    again = np.asarray(generate(qwen_folder, "a red square", **kw)[0], np.int16)
    np.testing.assert_array_equal(base, again)                                  # same seed, same image
    tuned = np.asarray(generate(qwen_folder, "a red square", loras=[result["lora"]], **kw)[0], np.int16)
    assert np.abs(base - tuned).max() > 0
    guided = np.asarray(generate(qwen_folder, "a red square", negative_prompt="blurry", cfg=4.0, **kw)[0], np.int16)
    assert np.abs(base - guided).max() > 0                       # CFG runs only with a negative prompt
    assert np.array_equal(base, np.asarray(generate(qwen_folder, "a red square", cfg=4.0, **kw)[0], np.int16))
    out = tmp_path / "png"
    assert main(["--model", qwen_folder, "--prompt", "a cat", "--width", "32", "--height", "32", "--steps", "1",
                 "--negative-prompt", "", "--output", str(out), "--device", "cpu", "--no-progress"]) == 0
    assert len(os.listdir(out)) == 1


def test_the_released_size_without_files_draws_the_released_language_model(tmp_path, monkeypatch):
    """model.size qwen-image without files (the benches' real-size runs): the released Qwen2.5-VL-7B language model at
    random with the stand-in tokenizer; its parameter count (7.07e9) decides the storage under a budget."""
    import dataclasses

    from flame_models.qwen_image import family_parts as P
    from flame_models.text_encoders import qwen2_5_vl as Q
    GiB = 2 ** 30
    model = dataclasses.replace(_qwen(tmp_path, "rel").model, size="qwen-image")
    assert P._te_params(model) == P.released_te_params() == 7_070_619_136
    assert P.te_storage(model, "cuda", 24 * GiB) == "bf16" and P.te_storage(model, "cuda", 12 * GiB) == "fp8"
    assert P.text_length(model) == 512
    REAL = Q.Qwen2_5_VLTextConfig

    @dataclasses.dataclass(frozen=True)
    class Small(REAL):  # the released config's defaults, narrowed so that the cpu test holds the model
        hidden_size: int = 64
        intermediate_size: int = 96
        num_hidden_layers: int = 2
        num_attention_heads: int = 4
        num_key_value_heads: int = 2
        mrope_section: tuple = (2, 3, 3)
    monkeypatch.setattr(Q, "Qwen2_5_VLTextConfig", Small)
    enc = P.load_text_encoders_for(model, "cpu")
    assert enc.text_encoder.embed_tokens.weight.shape == (REAL().vocab_size, 64)  # the released vocabulary
    out = enc.encode(["a red square"])
    assert out["prompt_embeds"].shape == (1, 512, 64) and 0 < out["prompt_mask"].numpy().sum() < 512
