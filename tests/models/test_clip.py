"""CLIPTextModel / CLIPTextModelWithProjection against transformers' outputs (tests/fixtures/text_encoders), in
every checkpoint layout load_clip reads, and the errors it gives."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from text_encoder_helpers import CLIP_NAMES, TIGHT, config, copy_folder, folder, io, outputs_close, save, shard, weights

import flame_core as flame
import flame_nn
from flame_core.autograd import gradcheck
from flame_core.errors import DTypeError, ShapeError
from flame_models.text_encoders import (
    CLIP_PRESETS,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    TextEncoderCheckpointError,
    TextEncoderConfigError,
    infer_clip_config,
    load_clip,
    quick_gelu,
)
from flame_models.text_encoders.clip import CLIPEncoderLayer
from flame_models.text_encoders.outputs import BaseModelOutputWithPooling

SDXL = os.path.join(os.path.dirname(folder("x")), "sdxl_like.safetensors")


def cfg(name):
    return CLIPTextConfig.from_dict(config(name))


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("name", CLIP_NAMES)
@pytest.mark.parametrize("tag", ["out", "masked"])
def test_matches_transformers(name, tag, device):
    ref = io(name)
    model = load_clip(folder(name), device=device)
    assert type(model) is (CLIPTextModelWithProjection if name == "clip_g_proj" else CLIPTextModel)
    mask = ref["attention_mask"] if tag == "masked" else None
    out = model(ref["input_ids"], attention_mask=mask, output_hidden_states=True)
    checked = outputs_close(out, ref, tag)
    assert "hidden_states" in checked and "last_hidden_state" in checked
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    # the penultimate state SDXL / SD3 use is a layer output without the final LayerNorm
    assert not np.allclose(out.hidden_states[-1].numpy(), out.last_hidden_state.numpy(), atol=1e-3)
    if name == "clip_g_proj":  # transformers' projected output has no pooler_output: check it at the EOS token
        assert "text_embeds" in checked
        pos = ref["input_ids"].argmax(-1)
        np.testing.assert_allclose(out.pooler_output.numpy(), ref[f"{tag}.last_hidden_state"][np.arange(3), pos],
                                   **TIGHT)


def test_masked_and_unmasked_differ_where_padding_is_attended():
    """The fixtures' padding mask changes the outputs of the padded rows only (causal attention never looks past
    a row's EOS, so real tokens are the same either way)."""
    ref = io("clip_l_legacy")
    a, b = ref["out.last_hidden_state"], ref["masked.last_hidden_state"]
    np.testing.assert_allclose(a[0], b[0], atol=1e-6)
    np.testing.assert_allclose(a[1, :7], b[1, :7], atol=1e-5)
    assert np.abs(a[1, 7:] - b[1, 7:]).max() > 1e-3


def test_pooling_rules(device):
    """eos_token_id 2 (legacy): the state at argmax(ids); any other id: at its first occurrence."""
    legacy = load_clip(folder("clip_l_legacy"), device=device)
    ids = io("clip_l_legacy")["input_ids"]
    out = legacy(ids)
    rows = np.arange(ids.shape[0])
    np.testing.assert_array_equal(out.pooler_output.numpy(), out.last_hidden_state.numpy()[rows, ids.argmax(-1)])

    eos = load_clip(folder("clip_l_eos"), device=device)
    ids = io("clip_l_eos")["input_ids"]
    assert eos.config.eos_token_id == 60
    first = (ids == 60).argmax(-1)
    assert (first != ids.argmax(-1)).all()  # the two rules pick different tokens on these ids
    out = eos(ids)
    np.testing.assert_array_equal(out.pooler_output.numpy(), out.last_hidden_state.numpy()[rows, first])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close(dtype, device):
    ref = io("clip_g_proj")
    model = load_clip(folder("clip_g_proj"), dtype=dtype, device=device)
    assert model.dtype == flame.dtypes.dtype(dtype)
    out = model(ref["input_ids"], output_hidden_states=True)
    for name in ("last_hidden_state", "text_embeds"):
        got, want = out[name].float().numpy(), ref[f"out.{name}"]
        rel = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
        assert out[name].dtype == flame.dtypes.dtype(dtype)
        assert rel < (0.02 if dtype == "bfloat16" else 0.003), (name, rel)


def test_fp8_storage_close(device):
    ref = io("clip_l_legacy")
    model = load_clip(folder("clip_l_legacy"), dtype="float32", device=device, quantize="fp8")
    q = model.text_model.encoder.layers[0].mlp.fc1
    assert q.weight.dtype == flame.float8_e4m3fn and q.compute_dtype == flame.float32
    assert model.text_model.embeddings.token_embedding.weight.dtype == flame.float32
    got, want = model(ref["input_ids"]).last_hidden_state.numpy(), ref["out.last_hidden_state"]
    rel = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    assert 1e-3 < rel < 0.1, rel  # fp8's ~2.6% rms weight error per layer (3 layers of width 32), not zero


def test_fp8_storage_runs_q_k_v_with_their_biases_as_one_matmul(device):
    """quantize="fp8": q | k | v (with biases) stacked into one fp8 weight (FusedFp8Projections), the same numbers as
    the three layers; a trained bias or a bias moved off the packed buffer runs them one by one."""
    from flame_models.text_encoders.storage import FusedFp8Projections
    ref = io("clip_l_legacy")
    model = load_clip(folder("clip_l_legacy"), dtype="float32", device=device, quantize="fp8")
    attn = model.text_model.encoder.layers[0].self_attn
    fp = attn.fused_projections
    assert isinstance(fp, FusedFp8Projections) and fp.bias is not None and fp.q.shape[0] == 3 * 32
    fused = model(ref["input_ids"]).last_hidden_state.numpy()
    layers = model.text_model.encoder.layers
    saved = [layer.self_attn.__dict__.pop("fused_projections") for layer in layers]
    separate = model(ref["input_ids"]).last_hidden_state.numpy()
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)
    for layer, f in zip(layers, saved):
        layer.self_attn.__dict__["fused_projections"] = f
    x = flame.tensor(np.random.default_rng(0).standard_normal((2, 5, 32)), dtype=flame.float32, device=device)
    want = flame.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1).numpy()
    np.testing.assert_allclose(fp(x).numpy(), want, rtol=1e-5, atol=1e-5)
    attn.v_proj.bias.requires_grad_(True)
    assert fp(x) is None  # a trained bias: one by one
    attn.v_proj.bias.requires_grad_(False)
    attn.v_proj.bias.data = attn.v_proj.bias.detach().clone()  # moved off the stacked buffer
    assert not fp.matches() and fp(x) is None


def test_fused_projections_match_the_separate_ones(device):
    """Loaded packed, q|k|v run as one matmul; with gradients wanted (or after .to()) they run one by one, with the
    same numbers."""
    ref = io("clip_l_legacy")
    model = load_clip(folder("clip_l_legacy"), device=device)
    attn = model.text_model.encoder.layers[0].self_attn
    assert attn.fused_projections is not None and attn.fused_projections.matches()
    fused = model(ref["input_ids"]).last_hidden_state.numpy()
    model.requires_grad_(True)
    x = flame.tensor(np.random.default_rng(0).standard_normal((2, 5, 32)), dtype=flame.float32, device=device)
    assert attn.fused_projections(x) is None  # gradients wanted: one by one
    separate = model(ref["input_ids"]).last_hidden_state.detach().numpy()
    np.testing.assert_allclose(fused, separate, rtol=1e-6, atol=1e-6)
    model.requires_grad_(False)
    fp = attn.fused_projections
    assert fp.matches() and fp.matches()   # the second check passes on the remembered arrays
    old = attn.k_proj.weight
    attn.k_proj.weight = flame_nn.Parameter(old.detach().clone())   # same values, another buffer: not the view
    assert not fp.matches() and fp(x) is None
    attn.k_proj.weight = old
    assert fp.matches()
    attn.v_proj.bias.data = attn.v_proj.bias.detach().clone()       # a bias moved off the stacked buffer
    assert not fp.matches()
    model.to(flame.float64)
    assert attn.fused_projections is None  # the float32 buffer is no longer the weights': forgotten
    np.testing.assert_allclose(model(ref["input_ids"]).last_hidden_state.numpy(), ref["out.last_hidden_state"],
                               **TIGHT)


# ----------------------------------------------------------------------------- layouts
def test_single_files_comfyui_flat_and_sharded(tmp_path, device):
    """ComfyUI's clip_l.safetensors (transformers keys, no config), transformers 5's keys without `text_model.`,
    and a sharded checkpoint (index JSON, with and without the folder's config.json)."""
    ref = io("clip_l_legacy")
    w = weights("clip_l_legacy")
    c = cfg("clip_l_legacy")
    comfy = save(w, tmp_path / "clip_l.safetensors")
    flat = save({k.replace("text_model.", "", 1): v for k, v in w.items()}, tmp_path / "flat" / "m.safetensors")
    index = shard(w, tmp_path / "sharded")
    for path in (comfy, flat, index):
        out = load_clip(path, config=c, device=device)(ref["input_ids"], output_hidden_states=True)
        outputs_close(out, ref, "out")
    with open(tmp_path / "sharded" / "config.json", "w") as f:
        json.dump(config("clip_l_legacy"), f)
    outputs_close(load_clip(tmp_path / "sharded", device=device)(ref["input_ids"]), ref, "out")


def test_diffusers_folder_subfolders(tmp_path, device):
    root = tmp_path / "sdxl"
    copy_folder("clip_l_legacy", root / "text_encoder")
    copy_folder("clip_g_proj", root / "text_encoder_2")
    (root / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    clip_l = load_clip(root, device=device)
    assert type(clip_l) is CLIPTextModel and clip_l.config.hidden_act == "quick_gelu"
    clip_g = load_clip(root, subfolder="text_encoder_2", device=device)
    assert type(clip_g) is CLIPTextModelWithProjection and clip_g.config.hidden_act == "gelu"
    outputs_close(clip_g(io("clip_g_proj")["input_ids"]), io("clip_g_proj"), "out")
    with pytest.raises(TextEncoderCheckpointError, match="no subfolder 'text_encoder_9'"):
        load_clip(root, subfolder="text_encoder_9")


def test_openclip_and_sdxl_prefixes(device):
    """SDXL's checkpoint: CLIP-L in transformers keys, CLIP-G in OpenCLIP keys (in_proj q|k|v, text_projection
    stored (in, out)), beside a UNet; the fixture's OpenCLIP names come from the fixture script's own mapping."""
    with pytest.raises(TextEncoderCheckpointError, match="holds 2 CLIP text models") as e:
        load_clip(SDXL)
    assert "'conditioner.embedders.0.transformer.'" in str(e.value)
    assert "'conditioner.embedders.1.model.'" in str(e.value)
    g = load_clip(SDXL, prefix="conditioner.embedders.1.model.", config=cfg("clip_g_proj"), device=device)
    assert type(g) is CLIPTextModelWithProjection
    ref = io("clip_g_proj")
    outputs_close(g(ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True), ref,
                  "masked")
    l_model = load_clip(SDXL, prefix="conditioner.embedders.0.transformer.", config=cfg("clip_l_legacy"),
                        device=device)
    outputs_close(l_model(io("clip_l_legacy")["input_ids"]), io("clip_l_legacy"), "out")


def test_sd3_prefix_found_by_itself(tmp_path, device):
    """An SD3-like file: one CLIP under `text_encoders.clip_g.transformer.` beside a T5: no prefix needed."""
    sd = {"text_encoders.clip_g.transformer." + k: v for k, v in weights("clip_g_proj").items()}
    sd.update({"text_encoders.t5xxl.transformer." + k: v for k, v in weights("t5").items()})
    path = save(sd, tmp_path / "sd3.safetensors")
    model = load_clip(path, config=cfg("clip_g_proj"), device=device)
    outputs_close(model(io("clip_g_proj")["input_ids"]), io("clip_g_proj"), "out")


def test_whole_clip_model_text_tower(tmp_path, device):
    """A CLIPModel checkpoint (text and vision towers, its config under text_config): the text tower loads."""
    sd = dict(weights("clip_g_proj"))
    sd.update({"vision_model.embeddings.patch_embedding.weight": np.zeros((32, 3, 4, 4), np.float32),
               "visual_projection.weight": np.zeros((24, 32), np.float32), "logit_scale": np.zeros((), np.float32)})
    save(sd, tmp_path / "clip" / "model.safetensors")
    (tmp_path / "clip" / "config.json").write_text(json.dumps({"model_type": "clip",
                                                               "text_config": config("clip_g_proj")}))
    model = load_clip(tmp_path / "clip", device=device)
    assert type(model) is CLIPTextModelWithProjection
    outputs_close(model(io("clip_g_proj")["input_ids"]), io("clip_g_proj"), "out")


def test_state_dict_names_are_checkpoint_keys(tmp_path, device):
    """The parameters carry the checkpoint's own names: a state dict saved as is loads back as the same model."""
    model = load_clip(folder("clip_g_proj"), device=device)
    sd = model.state_dict()
    assert set(sd) == set(weights("clip_g_proj"))
    again = load_clip(save(sd, tmp_path / "again.safetensors"), config=model.config, device=device)
    for k, v in again.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), sd[k].numpy(), err_msg=k)


def test_save_pretrained_tiny_model_built_at_run_time(tmp_path, device):
    """A tiny model made at run time: save_pretrained writes a transformers folder; its file alone still loads (the
    config rides in the metadata, the weights cannot tell a tiny CLIP's heads or activation)."""
    c = CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=16, hidden_act="gelu", eos_token_id=2,
                       projection_dim=8)
    model = CLIPTextModelWithProjection(c, device=device)
    ids = np.array([[0, 5, 9, 99, 99]])
    want = model(ids).text_embeds.detach().numpy()
    files = model.save_pretrained(tmp_path / "tiny")
    assert json.loads(open(files[0]).read())["model_type"] == "clip_text_model"
    for path in (tmp_path / "tiny", files[1]):
        again = load_clip(path, device=device)
        assert again.config == c
        np.testing.assert_allclose(again(ids).text_embeds.numpy(), want, rtol=1e-6, atol=1e-6)
    plain = CLIPTextModel.from_pretrained(tmp_path / "tiny", device=device)  # as transformers: projection left out
    assert type(plain) is CLIPTextModel
    with pytest.raises(ValueError, match="fp8"):
        load_clip(tmp_path / "tiny", quantize="fp8").save_pretrained(tmp_path / "fp8")


def test_projection_argument(tmp_path, device):
    plain = load_clip(folder("clip_g_proj"), projection=False, device=device)
    assert type(plain) is CLIPTextModel
    outputs_close(plain(io("clip_g_proj")["input_ids"]), io("clip_g_proj"), "out")
    with pytest.raises(TextEncoderCheckpointError, match="missing.*text_projection.weight"):
        load_clip(folder("clip_l_legacy"), projection=True)


# ----------------------------------------------------------------------------- configs
def _released_shapes(c, projection):
    shapes = {"text_model.embeddings.token_embedding.weight": (c.vocab_size, c.hidden_size),
              "text_model.embeddings.position_embedding.weight": (c.max_position_embeddings, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        shapes[f"text_model.encoder.layers.{i}.mlp.fc1.weight"] = (c.intermediate_size, c.hidden_size)
    if projection:
        shapes["text_projection.weight"] = (c.projection_dim, c.hidden_size)
    return shapes


@pytest.mark.parametrize("preset", ["clip-l", "clip-g"])
def test_config_inferred_from_released_shapes(preset):
    c = CLIP_PRESETS[preset]
    assert infer_clip_config(_released_shapes(c, projection=True)) == c


def test_config_from_files_and_dicts(tmp_path):
    c = CLIPTextConfig.from_pretrained(folder("clip_l_eos"))
    assert (c.hidden_size, c.num_attention_heads, c.eos_token_id, c.hidden_act) == (32, 4, 60, "quick_gelu")
    whole = {"model_type": "clip", "text_config": config("clip_g_proj"), "vision_config": {}}
    assert CLIPTextConfig.from_dict(whole).hidden_act == "gelu"
    with pytest.raises(TextEncoderConfigError, match="hidden_act"):
        CLIPTextConfig(hidden_act="relu")
    with pytest.raises(TextEncoderConfigError, match="not divisible"):
        CLIPTextConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(TextEncoderConfigError, match="no config.json"):
        CLIPTextConfig.from_pretrained(tmp_path)


def test_tiny_single_file_needs_a_config(tmp_path):
    path = save(weights("clip_l_legacy"), tmp_path / "clip_l.safetensors")
    with pytest.raises(TextEncoderConfigError, match="config=CLIPTextConfig"):
        load_clip(path)


# ----------------------------------------------------------------------------- errors
def test_other_models_named(tmp_path):
    with pytest.raises(TextEncoderCheckpointError, match=r"holds no CLIP text model: it looks like T5 encoder.*"
                                                         r"use load_t5"):
        load_clip(folder("t5") + "/model.safetensors")
    with pytest.raises(TextEncoderCheckpointError, match="config.json describes T5 encoder"):
        load_clip(folder("t5"))
    vae = save({"encoder.down.0.block.0.conv1.weight": np.zeros((2, 2), np.float32),
                "decoder.up.0.block.0.conv1.weight": np.zeros((2, 2), np.float32)}, tmp_path / "ae.safetensors")
    with pytest.raises(TextEncoderCheckpointError, match="looks like a VAE"):
        load_clip(vae)
    with pytest.raises(FileNotFoundError):
        load_clip(tmp_path / "nope.safetensors")


def test_missing_unexpected_misshaped_named(tmp_path):
    w = weights("clip_l_legacy")
    c = cfg("clip_l_legacy")
    gone = dict(w)
    del gone["text_model.encoder.layers.1.mlp.fc2.bias"]
    with pytest.raises(TextEncoderCheckpointError, match=r"missing \(1\): text_model.encoder.layers.1.mlp.fc2.bias"):
        load_clip(save(gone, tmp_path / "a.safetensors"), config=c)
    bad = dict(w)
    bad["text_model.encoder.layers.0.mlp.fc1.weight"] = np.zeros((64, 31), np.float32)
    with pytest.raises(TextEncoderCheckpointError, match=r"misshaped.*fc1.weight: \(64, 31\) in the file, "
                                                         r"\(64, 32\) in the model"):
        load_clip(save(bad, tmp_path / "b.safetensors"), config=c)
    extra = dict(w)
    extra["text_model.encoder.layers.0.mlp.extra"] = np.zeros(3, np.float32)
    path = save(extra, tmp_path / "c.safetensors")
    with pytest.raises(TextEncoderCheckpointError, match=r"unexpected \(1\): text_model.encoder.layers.0.mlp.extra"):
        load_clip(path, config=c)
    outputs_close(load_clip(path, config=c, strict=False)(io("clip_l_legacy")["input_ids"]), io("clip_l_legacy"),
                  "out")


def test_bad_inputs_named():
    model = load_clip(folder("clip_l_legacy"))
    ids = io("clip_l_legacy")["input_ids"]
    with pytest.raises(DTypeError, match="integer token ids"):
        model(ids.astype(np.float32))
    with pytest.raises(ShapeError, match=r"add the batch dim"):
        model(ids[0])
    with pytest.raises(IndexError, match=r"span \[0, 64\] but the vocabulary has 64"):
        model(np.where(ids == 63, 64, ids))
    with pytest.raises(ValueError, match="more than max_position_embeddings 16"):
        model(np.zeros((1, 17), np.int64))
    with pytest.raises(ShapeError, match="attention_mask of shape"):
        model(ids, attention_mask=np.ones((3, 11)))
    with pytest.raises(ValueError, match="projection"):
        load_clip(folder("clip_l_legacy"), projection="yes")
    with pytest.raises(ValueError, match="quantize"):
        load_clip(folder("clip_l_legacy"), quantize="int8")
    with pytest.raises(ValueError, match="quantize='fp8'"):
        load_clip(folder("clip_l_legacy"), dtype="float8_e4m3fn")


# ----------------------------------------------------------------------------- outputs and gradients
def test_model_output_access():
    a, b = flame.ones(2), flame.zeros(3)
    out = BaseModelOutputWithPooling(last_hidden_state=a, pooler_output=b)
    assert out.keys() == ["last_hidden_state", "pooler_output"] and len(out) == 2
    assert out["pooler_output"] is b and out[1] is b and out.last_hidden_state is a and out.hidden_states is None
    assert "hidden_states" not in out and out.to_tuple() == (a, b)
    with pytest.raises(KeyError, match="hidden_states"):
        out["hidden_states"]
    with pytest.raises(TypeError, match="no field"):
        BaseModelOutputWithPooling(text_embeds=a)


@settings(max_examples=10)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_quick_gelu_gradcheck(shape, seed):
    x = flame.tensor(np.random.default_rng(seed).uniform(-4, 4, shape), dtype=flame.float64, requires_grad=True)
    np.testing.assert_allclose(quick_gelu(x).detach().numpy(),
                               x.detach().numpy() / (1 + np.exp(-1.702 * x.detach().numpy())), rtol=1e-12)
    assert gradcheck(quick_gelu, (x,))


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), L=st.integers(1, 5), act=st.sampled_from(["quick_gelu", "gelu"]),
       masked=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_encoder_layer_gradcheck(B, L, act, masked, seed):
    """A CLIP layer in float64 (causal attention, or causal and a padding mask; either activation): input and
    parameter gradients by central differences."""
    rng = np.random.default_rng(seed)
    c = CLIPTextConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=8, hidden_act=act)
    layer = CLIPEncoderLayer(c, dtype=flame.float64)
    for p in layer.parameters():
        p.data.copy_(flame.tensor(rng.uniform(-0.5, 0.5, tuple(p.shape)), dtype=flame.float64))
    x = flame.tensor(rng.standard_normal((B, L, 8)), dtype=flame.float64, requires_grad=True)
    mask = None
    if masked:
        keep = np.ones((B, L), bool)
        keep[:, L // 2 + 1:] = False
        pos = np.arange(L)
        mask = flame.tensor((pos[:, None] >= pos[None, :])[None, None] & keep[:, None, None, :])
    w = layer.mlp.fc1.weight
    assert gradcheck(lambda x, w: layer(x, mask), (x, w))


def test_fused_add_norms_keep_every_output_and_gradient(device):
    """A layer's adds fused with the norms after them (add_layer_norm, chained into the next layer's layer_norm1 and
    the final norm) give the outputs and gradients of the whole-block path (checkpointed blocks take that one)."""
    rng = np.random.default_rng(7)
    c = CLIPTextConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                       num_attention_heads=2, max_position_embeddings=8, hidden_act="quick_gelu")
    model = CLIPTextModel(c, device=device)
    for p in model.parameters():
        p.data.copy_(flame.tensor(rng.uniform(-0.5, 0.5, tuple(p.shape)), dtype=p.dtype, device=device))
    ids = np.array([[0, 5, 9, 7, 2, 1], [3, 4, 2, 1, 1, 1]])
    w = model.text_model.encoder.layers[1].layer_norm2.weight

    def run(checkpointed):
        for layer in model.text_model.encoder.layers:
            layer.gradient_checkpointing = checkpointed
        w.grad = None
        out = model(ids, output_hidden_states=True)
        assert (out.last_hidden_state.grad_fn.name() == "AddLayerNormBackward") is not checkpointed
        (out.last_hidden_state.sum() + (out.hidden_states[-2] ** 2).sum()).backward()
        return [t.detach().numpy() for t in (out.last_hidden_state, out.pooler_output) + out.hidden_states], \
            w.grad.numpy().copy()
    fused, gw_fused = run(False)
    whole, gw_whole = run(True)
    for i, (a, b) in enumerate(zip(fused[2:], whole[2:])):
        if device == "cpu":   # the same NumPy formulas: bit-equal
            np.testing.assert_array_equal(a, b, err_msg=f"hidden state {i}")
        else:                 # the fused kernel's mean / variance sum in another order than layer_norm's: ulps,
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"hidden state {i}")   # carried on
    for a, b in zip(fused[:2], whole[:2]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw_fused, gw_whole, rtol=1e-5, atol=1e-5)


def test_a_hooked_norm_is_still_called():
    c = CLIPTextConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=8)
    model = CLIPTextModel(c)
    seen = []
    model.text_model.encoder.layers[1].layer_norm1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model(np.array([[0, 3, 2]]))
    assert seen == [(1, 3, 8)]
