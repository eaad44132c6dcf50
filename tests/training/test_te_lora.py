"""SDXL with train.train_text_encoder, end to end on the CPU with the tiny SDXL pipeline fixture: captions kept as
token ids (no text-embedding cache), LoRA on CLIP-L / CLIP-G's attention and MLP Linears trained in their own
optimizer group, the LoRA file's lora_te1_ / lora_te2_ (kohya) or text_encoder. / text_encoder_2. (PEFT) parts
loaded by the SDXL generator's load_text_encoders giving the trained encoders' embeddings, previews encoded by the
trained encoders, exact resume, and the config errors."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io
from flame_models.data import SyntheticDataset
from flame_models.sdxl.conditioning import load_text_encoders
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from . import test_sd_families as _families
from .conftest import FIXTURES, fixture_script, image_config
from .test_sd_families import PROMPTS, SD3_MODEL

# that file's fixtures, used here too (bound by assignment: the tests' arguments of the same name are what pytest fills)
images, sdxl_config, sdxl_model = _families.images, _families.sdxl_config, _families.sdxl_model

TE_TRAIN = {"train_text_encoder": True, "text_encoder_lr": 5e-3}


def _encode(encoders, prompt):
    return {k: v.numpy() for k, v in encoders.encode([prompt]).items()}


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_sdxl_text_encoder_lora_trains_saves_and_loads_in_the_generator(tmp_path, images, sdxl_model, fmt):
    # alpha 2 of rank 4: the file's scale (kohya's .alpha, FLAME's recorded PEFT alphas) matters
    cfg = sdxl_config(tmp_path, f"te_{fmt}", sdxl_model, images, steps=2, train=TE_TRAIN, save={"format": fmt},
                      network={"linear_alpha": 2},
                      sample={"sample_every": 2, "sample_steps": 2, "prompts": PROMPTS[:1], "neg": "blurry"})
    tr = Trainer(cfg, verbose=False).setup()
    te = tr.text_encoders
    assert te is not None and tr.prepared.encoded["text"] == 0
    assert not os.path.exists(os.path.join(images, ".flame_cache", "text"))       # nothing cached
    assert "" in tr.loader.dataset.texts.table                                      # the dropout caption
    # kohya's CLIP targets: the 4 attention and 2 MLP Linears of every layer of both encoders
    layers = sum(m.config.num_hidden_layers for _, m in te.parts)
    assert te.n_adapted == 6 * layers
    assert {(ad.rank, ad.scale) for _, m in te.parts for _, _, ad in A.adapter_modules(m)} == {(4, 0.5)}
    assert [g["lr"] for g in tr.optimizer.param_groups] == [3e-3, 5e-3]
    assert tr.optimizer.param_groups[1]["params"] == te.params
    batch = tr.loader.dataset.collate([tr.loader.dataset.get(0, 0)])
    assert batch["clip_l_ids"].shape == (1, 1, 77) and "prompt_embeds" not in batch
    before = {k: p.detach().numpy().copy() for k, p in te.named_parameters()}
    result = tr.train()
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    changed = {k for k, p in te.named_parameters() if np.abs(p.detach().numpy() - before[k]).max() > 0}
    # every TE adapter tensor trained (up started at 0) but CLIP-L's last layer's: SDXL reads its penultimate
    # state, so that layer gets no gradient (kohya and diffusers adapt it all the same)
    last = f"te1/text_model.encoder.layers.{te.parts[0][1].config.num_hidden_layers - 1}."
    assert changed == {k for k in before if not k.startswith(last)} and len(changed) < len(before)

    # the file: the UNet part as before, plus both encoders'
    sd = io.load_file(result["lora"])
    if fmt == "kohya":
        want = ["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                "lora_te1_text_model_encoder_layers_1_mlp_fc2.alpha",
                "lora_te2_text_model_encoder_layers_1_self_attn_out_proj.lora_up.weight",
                "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"]
    else:
        want = ["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
                "text_encoder_2.text_model.encoder.layers.1.mlp.fc1.lora_B.weight",
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"]
    assert all(k in sd for k in want), [k for k in want if k not in sd]
    n_te = sum(k.startswith(("lora_te", "text_encoder")) and k.endswith(("lora_down.weight", "lora_A.weight"))
               for k in sd)
    assert n_te == te.n_adapted
    with io.safe_open(result["lora"]) as f:
        meta = f.metadata()
    assert (meta["ss_network_train_unet_only"], meta["ss_text_encoder_lr"]) == ("False", "0.005")
    if fmt == "kohya":
        assert float(sd["lora_te2_text_model_encoder_layers_0_mlp_fc1.alpha"].numpy()) == 2.0
    else:
        assert "text_model.encoder.layers.0.mlp.fc1" in json.loads(meta["flame.alphas.te2"])

    # the generator's encoders with the file's text-encoder parts give the trained encoders' embeddings
    te.train(False)
    prompt = "ohwx on a blue background"
    trained = _encode(te.encoders, prompt)
    base = load_text_encoders(sdxl_model, dtype=flame.float32, device="cpu")
    plain = _encode(base, prompt)
    with load_text_encoders(sdxl_model, dtype=flame.float32, device="cpu", loras=[(result["lora"], 1.0)]) as gen:
        got = _encode(gen, prompt)
    for k in trained:
        assert np.abs(trained[k] - plain[k]).max() > 1e-4, "the TE LoRA changes nothing: the check is vacuous"
        np.testing.assert_allclose(got[k], trained[k], rtol=1e-4, atol=1e-5)

    # the preview at step 2 was encoded by the trained encoders (the negative prompt too)
    cond = tr.previews.prompts[0].cond
    np.testing.assert_allclose(cond["prompt_embeds"], _encode(te.encoders, tr.prepared.prompt_texts[0])
                               ["prompt_embeds"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cond["negative_pooled_prompt_embeds"],
                               _encode(te.encoders, "blurry")["pooled_prompt_embeds"][0], rtol=1e-5, atol=1e-6)
    assert np.abs(cond["prompt_embeds"] - _encode(base, tr.prepared.prompt_texts[0])["prompt_embeds"][0]).max() > 1e-4


def test_sdxl_text_encoder_lora_resumes_exactly_with_gradient_checkpointing(tmp_path, images, sdxl_model):
    train = {**TE_TRAIN, "gradient_checkpointing": True}

    def run(name, steps):
        return Trainer(sdxl_config(tmp_path, name, sdxl_model, images, steps=steps, train=train), verbose=False)
    full = run("full", 4).setup()
    assert all(layer.gradient_checkpointing for _, m in full.text_encoders.parts for layer in m.checkpointed_blocks())
    want = [full.train_step()[0] for _ in range(4)]
    first = run("part", 2).setup()
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    saved = io.load_file(os.path.join(first.out, "checkpoints", os.listdir(os.path.join(first.out, "checkpoints"))[0],
                                      "adapter.safetensors"))
    assert any(k.startswith("te2/text_model.encoder.layers.1.mlp.fc2") for k in saved)
    again = run("part", 4).setup()
    assert again.step == 2
    np.testing.assert_allclose([again.train_step()[0] for _ in range(2)], want[2:], rtol=1e-6)
    names = [k for k, _ in again.named_adapter_parameters()]
    assert names == [k for k, _ in full.named_adapter_parameters()] and any(k.startswith("te1/") for k in names)
    for a, b in zip(again.params, full.params):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_a_finished_text_encoder_run_reruns_with_its_adapters_and_nothing_encoded(tmp_path, images, sdxl_model,
                                                                                  monkeypatch):
    cfg = lambda: sdxl_config(tmp_path, "done", sdxl_model, images, steps=1, train=TE_TRAIN)  # noqa: E731
    first = Trainer(cfg(), verbose=False)
    first.train()
    fam = first.family

    def called(name):
        def fail(*a, **k):
            raise AssertionError(f"{name} was called on a finished run's rerun")
        return fail
    for name in ("load_vae", "encode_images", "caption_tokens", "encode_prompts", "decode"):
        monkeypatch.setattr(fam, name, called(name))
    again = Trainer(cfg(), verbose=False)
    assert again.train()["finished_before"]
    # the encoders are loaded for their adapters (the checkpoint's), nothing is tokenised
    got, want = dict(again.named_adapter_parameters()), dict(first.named_adapter_parameters())
    assert sorted(got) == sorted(want) and any(k.startswith("te2/") for k in got)
    for k in want:
        np.testing.assert_array_equal(got[k].detach().numpy(), want[k].detach().numpy())


def test_default_keeps_the_text_embedding_cache(tmp_path, images, sdxl_model):
    tr = Trainer(sdxl_config(tmp_path, "off", sdxl_model, images, steps=1), verbose=False).setup()
    assert tr.text_encoders is None and tr.prepared.text_encoders is None and tr.prepared.encoded["text"] > 0
    assert len(tr.optimizer.param_groups) == 1 and "prompt_embeds" in tr.loader.next_batch()
    assert not any(k.startswith("te") for k, _ in tr.named_adapter_parameters())


def test_text_encoder_config_errors(tmp_path, images, sdxl_model):
    with pytest.raises(ConfigError) as ei:
        image_config(tmp_path, "x", SD3_MODEL, images, train=TE_TRAIN, model={"arch": "sd3"})
    assert "train.train_text_encoder: the sd3 family cannot train its text encoders (available for sdxl)" \
        in str(ei.value)
    with pytest.raises(ConfigError, match="train.text_encoder_lr: only used with train.train_text_encoder"):
        sdxl_config(tmp_path, "x", sdxl_model, images, train={"text_encoder_lr": 1e-4})
    with pytest.raises(ConfigError, match=r"train.text_encoder_lr: must be > 0, got -1"):
        sdxl_config(tmp_path, "x", sdxl_model, images, train={**TE_TRAIN, "text_encoder_lr": -1.0})
    with pytest.raises(ConfigError, match="train.train_text_encoder: needs captions to encode -- image folders"):
        sdxl_config(tmp_path, "x", sdxl_model, images, train=TE_TRAIN, datasets=[],
                    synthetic={"num_samples": 2, "height": 64, "width": 64})
    ready = SyntheticDataset(2, 64, 64, {"prompt_embeds": (77, 40), "pooled_prompt_embeds": (32,)}, latent_channels=4)
    with pytest.raises(ConfigError, match="needs image folders with captions; this run was given precomputed"):
        Trainer(sdxl_config(tmp_path, "ready", sdxl_model, images, train=TE_TRAIN), dataset=ready,
                verbose=False).setup()
    samples = tmp_path / "samples"
    samples.mkdir()
    io.save_file({"latents": np.zeros((4, 8, 8), np.float32)}, str(samples / "a.safetensors"))
    with pytest.raises(ConfigError, match="holds precomputed samples, but train.train_text_encoder needs image"):
        sdxl_config(tmp_path, "x", sdxl_model, images, train=TE_TRAIN, datasets=[{"folder_path": str(samples)}])


# ----------------------------------------------------------------------------- diffusers reads the same files
@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_diffusers_load_lora_weights_reads_the_text_encoder_parts_as_flame_means_them(fmt):
    """tests/fixtures/make_te_lora_flame_files.py wrote the files with save_adapters(text_encoders=...) as the trainer
    does; make_te_lora_diffusers.py loaded them with StableDiffusionXLPipeline.load_lora_weights and encoded prompts.
    FLAME's generator encoders, loading the same files, give the same embeddings."""
    out = os.path.join(FIXTURES, "te_lora")
    with open(os.path.join(out, "diffusers_outputs.json")) as f:
        report = json.load(f)
    assert report["files"][fmt] == {"loaded": {"text_encoder": 12, "text_encoder_2": 18, "unet": 17}}, report
    golden = {k: v.numpy() for k, v in io.load_file(os.path.join(out, "diffusers_outputs.safetensors")).items()}
    files = fixture_script("make_te_lora_flame_files").pipeline_files()
    with load_text_encoders(files, dtype=flame.float32, device="cpu") as enc:
        base = {k: v.numpy() for k, v in enc.encode(report["prompts"]).items()}
    with load_text_encoders(files, dtype=flame.float32, device="cpu",
                            loras=[(os.path.join(out, f"sdxl_te_{fmt}.safetensors"), 1.0)]) as enc:
        got = {k: v.numpy() for k, v in enc.encode(report["prompts"]).items()}
    for k in ("prompt_embeds", "pooled_prompt_embeds"):
        scale = np.abs(golden[f"base_{k}"]).max()
        assert np.abs(base[k] - golden[f"base_{k}"]).max() < 1e-4 * scale
        assert np.abs(golden[f"{fmt}_{k}"] - golden[f"base_{k}"]).max() > 1e-2 * scale   # the LoRA matters
        assert np.abs(got[k] - golden[f"{fmt}_{k}"]).max() < 1e-4 * scale, k


def test_the_random_tiny_preset_trains_its_text_encoders(tmp_path, images):
    cfg = image_config(tmp_path, "tiny", None, images, steps=2, train=TE_TRAIN,
                       model={"arch": "sdxl", "size": "sdxl-tiny", "name_or_path": None, "t5_max_length": None})
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert np.isfinite(result["losses"]).all() and tr.text_encoders.n_adapted == 24
    assert any(k.startswith("lora_te2_") for k in io.load_file(result["lora"]))


def test_a_run_on_a_pretrained_lora_continues_its_text_encoder_adapters(tmp_path, images, sdxl_model):
    """network.pretrained_lora_path with the text encoders trained: the file's lora_te1_ / lora_te2_ adapters start
    CLIP-L's and CLIP-G's (as the UNet's start from its lora_unet_ ones); without train.train_text_encoder such a
    file is refused, naming it, before anything is encoded (the cached embeddings would drop that part)."""
    first = sdxl_config(tmp_path, "te_first", sdxl_model, images, steps=2, train=TE_TRAIN, network={"linear_alpha": 2})
    path = Trainer(first, verbose=False).train()["lora"]
    drop = ("network.type", "network.linear", "network.linear_alpha", "network.target")
    cfg = sdxl_config(tmp_path, "te_second", sdxl_model, images, steps=2, train=TE_TRAIN, drop=drop,
                      network={"pretrained_lora_path": path})
    tr = Trainer(cfg, verbose=False).setup()
    assert (tr.cfg.network.linear, tr.cfg.network.linear_alpha) == (4, 2.0)
    for comp, te in tr.text_encoders.parts:
        want = A.formats.load(path, [n for n, _ in te.named_modules()], component=comp)[0]
        got = A.adapter_state(te)
        assert want and set(got) == set(want), comp
        for m in want:
            for g, w in zip(got[m], want[m]):
                assert g.scale == pytest.approx(w.scale)
                for k in w.tensors:
                    np.testing.assert_allclose(g.tensors[k], w.tensors[k], rtol=1e-6, err_msg=f"{comp} {m} {k}")
    unet = A.formats.load(path, [n for n, _ in tr.model.named_modules()], name_map=tr.name_map)[0]
    assert set(A.adapter_state(tr.model)) == set(unet)
    assert np.isfinite(tr.train()["losses"]).all()
    off = sdxl_config(tmp_path, "te_off", sdxl_model, images, steps=2, drop=drop,
                      network={"pretrained_lora_path": path})
    trainer = Trainer(off, verbose=False)
    with pytest.raises(ConfigError, match="holds text-encoder adapters .*train.train_text_encoder: true"):
        trainer.setup()
    assert trainer.prepared is None


def test_trained_encoders_encode_each_prompts_own_negative(tmp_path, images, sdxl_model):
    """A sample prompt's --n with the text encoders trained: the previews' conditioning is encoded at each preview
    by the encoders as they are, each prompt with its own negative (or none)."""
    cfg = sdxl_config(tmp_path, "te_neg", sdxl_model, images, steps=2, train=TE_TRAIN,
                      sample={"sample_every": 2, "sample_steps": 1, "prompts": ["a red square --n dark", "a circle"]})
    tr = Trainer(cfg, verbose=False).setup()
    assert tr.prepared.negatives == ["dark", None]
    got = tr.text_encoders.preview_conditioning(tr.prepared.prompt_texts, tr.prepared.negatives)
    dark = tr.text_encoders.preview_conditioning(["dark"])[0]
    assert set(got[1]) == set(dark) and {k[len("negative_"):] for k in got[0] if k.startswith("negative_")} == set(dark)
    for k, v in dark.items():
        np.testing.assert_array_equal(got[0][f"negative_{k}"], v)
    assert len(tr.sample()) == 2
    # a prompt's --m weighs the encoders' adapters too: 0 is the base encoders' reading (and 1 again afterwards)
    for _ in range(2):
        tr.train_step()
    te = tr.text_encoders
    weighed = te.preview_conditioning(["a red square", "a red square"], None, [0.0, None])
    for _, enc in te.parts:
        A.set_adapter_weight(enc, "default", 0.0)
    te.train(False)
    with flame.no_grad():
        base = {k: v[0] for k, v in tr.family.encode_prompts(te.encoders, ["a red square"]).items()}
    te.train(True)
    for _, enc in te.parts:
        A.set_adapter_weight(enc, "default", 1.0)
    assert all(m._weights["default"] == 1.0 for _, enc in te.parts for _, m in A.adapted_modules(enc))
    for k, v in base.items():
        np.testing.assert_array_equal(weighed[0][k], v)
    assert any(not np.array_equal(weighed[1][k], v) for k, v in base.items())


def test_the_text_encoders_adapters_take_kohyas_dropouts(tmp_path, images, sdxl_model):
    cfg = sdxl_config(tmp_path, "te_drop", sdxl_model, images, steps=2, train=TE_TRAIN,
                      network={"rank_dropout": 0.2, "module_dropout": 0.05})
    tr = Trainer(cfg, verbose=False).setup()
    got = {(ad.rank_dropout, ad.module_dropout) for _, te in tr.text_encoders.parts
           for _, _, ad in A.adapter_modules(te)}
    assert got == {(0.2, 0.05)}
    assert np.isfinite(tr.train()["losses"]).all()
