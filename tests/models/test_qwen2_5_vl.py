"""The Qwen2.5-VL language model (flame_models/text_encoders/qwen2_5_vl.py), Qwen-Image's text encoder, on the CPU:
the 7B's size and names, the forward against an independent float64 NumPy reference (GQA, rotate-half RoPE, SwiGLU,
RMS norms; causal with right padding), transformers' hidden_states convention, and loading of the layouts
(transformers 5 `model.language_model.`, transformers 4 / ComfyUI `model.`, bare) with their configs. The parity
against transformers itself is in tests/models/test_qwen_image_parity.py."""
import json
import math

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_models.text_encoders.qwen2_5_vl import (
    Qwen2_5_VLCheckpointError,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    load_qwen2_5_vl,
)

TINY = Qwen2_5_VLTextConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 1, 1))


def test_the_7b_language_model_has_its_size_and_names():
    with flame_nn.empty_init(device="cpu"):
        model = Qwen2_5_VLTextModel("qwen2.5-vl-7b")
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert sum(int(np.prod(s)) for s in shapes.values()) == 7_070_619_136
    assert shapes["layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["layers.0.self_attn.k_proj.bias"] == (512,) and "layers.0.self_attn.o_proj.bias" not in shapes
    assert shapes["layers.0.mlp.gate_proj.weight"] == (18944, 3584) and shapes["norm.weight"] == (3584,)


def _model(seed=0):
    flame.manual_seed(seed)
    m = Qwen2_5_VLTextModel(TINY, dtype=flame.float32, device="cpu")
    rng = np.random.default_rng(seed)
    with flame.no_grad():
        for _, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(flame.tensor((p.detach().numpy() + 0.1 * rng.normal(size=p.shape)).astype(np.float32)))
    return m


def reference(sd, c, ids, mask):
    """float64 NumPy: the language model of the spec (../shared/specs/qwen_image.md section 10)."""
    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    def lin(name, x):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y
    B, L = ids.shape
    hd, H, KV = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv = 1.0 / c.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(L)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                          # (B, heads, L, hd)
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin
    keep = np.tril(np.ones((L, L), bool))[None, None] & (mask != 0)[:, None, None, :]
    x = sd["embed_tokens.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}"
        h = rms(x, sd[f"{p}.input_layernorm.weight"])
        q = rope(lin(f"{p}.self_attn.q_proj", h).reshape(B, L, H, hd).transpose(0, 2, 1, 3))
        k = rope(lin(f"{p}.self_attn.k_proj", h).reshape(B, L, KV, hd).transpose(0, 2, 1, 3))
        v = lin(f"{p}.self_attn.v_proj", h).reshape(B, L, KV, hd).transpose(0, 2, 1, 3)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        s = np.where(keep, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = (a / a.sum(-1, keepdims=True)) @ v
        x = x + lin(f"{p}.self_attn.o_proj", o.transpose(0, 2, 1, 3).reshape(B, L, H * hd))
        h = rms(x, sd[f"{p}.post_attention_layernorm.weight"])
        g = lin(f"{p}.mlp.gate_proj", h)
        x = x + lin(f"{p}.mlp.down_proj", g / (1 + np.exp(-g)) * lin(f"{p}.mlp.up_proj", h))
    return rms(x, sd["norm.weight"])


def _ids(seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, TINY.vocab_size, (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    return ids, mask


def test_the_forward_matches_the_numpy_reference_and_transformers_hidden_states():
    model = _model()
    ids, mask = _ids()
    sd = {k: v.detach().numpy().astype(np.float64) for k, v in model.named_parameters()}
    want = reference(sd, TINY, ids, mask)
    with flame.no_grad():
        out = model(flame.tensor(ids), flame.tensor(mask), output_hidden_states=True)
    got = out.last_hidden_state.numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert len(out.hidden_states) == TINY.num_hidden_layers + 1
    assert out.hidden_states[-1] is out.last_hidden_state
    np.testing.assert_array_equal(out.hidden_states[0].numpy(), sd["embed_tokens.weight"][ids].astype(np.float32))
    with flame.no_grad():                                  # the valid tokens of a padded row = the row alone
        alone = model(flame.tensor(ids[1:, :6])).last_hidden_state.numpy()
    assert np.abs(got[1, :6] - alone[0]).max() <= 1e-5 * np.abs(alone).max()


def test_bad_token_ids_are_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"input_ids outside the vocabulary \[0, 256\)"):
        model(flame.tensor(np.array([[1, 256]])))
    with pytest.raises(ValueError, match="does not fit input_ids"):
        model(flame.tensor(np.array([[1, 2]])), attention_mask=flame.tensor(np.ones((1, 3))))


@pytest.mark.parametrize("prefix", ["model.language_model.", "model.", ""])
def test_the_layouts_load_with_their_configs(tmp_path, prefix):
    model = _model()
    state = {prefix + k: v.detach() for k, v in model.named_parameters()}
    state["lm_head.weight"] = flame.zeros(256, 32)                      # read by nobody here
    state["visual.blocks.0.attn.qkv.weight"] = flame.zeros(48, 16)
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    io.save_file(state, str(folder / "model.safetensors"))
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000000.0}
    text = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    config = ({"model_type": "qwen2_5_vl", "text_config": {**text, "rope_parameters": rope}} if prefix else
              {**text, "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}})
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_qwen2_5_vl(str(tmp_path), device="cpu")
    assert loaded.config == TINY
    ids, mask = _ids()
    with flame.no_grad():
        a = model(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.numpy()
        b = loaded(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.numpy()
    np.testing.assert_array_equal(a, b)


def test_bad_text_encoder_files_are_named(tmp_path):
    model = _model()
    state = {"model." + k: v.detach() for k, v in model.named_parameters() if "layers.1.mlp.up_proj" not in k}
    path = str(tmp_path / "te.safetensors")
    io.save_file(state, path)
    with pytest.raises(Qwen2_5_VLCheckpointError, match=r"missing keys \(1\): layers\.1\.mlp\.up_proj\.weight"):
        load_qwen2_5_vl(path, device="cpu", config=TINY)
    with pytest.raises(Qwen2_5_VLCheckpointError, match="no config.json and not the 7B's width"):
        load_qwen2_5_vl(path, device="cpu")
    other = str(tmp_path / "t5.safetensors")
    io.save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": flame.zeros(2, 2)}, other)
    with pytest.raises(Qwen2_5_VLCheckpointError, match="not a Qwen2.5-VL language model"):
        load_qwen2_5_vl(other, device="cpu")


def test_fp8_storage_and_streamed_layers_encode_as_the_resident_model(tmp_path, device):
    """quantize="fp8" / stream=True as T5's: the layers' Linear weights in fp8 (the embeddings and norms not), the
    layers streamed through a BlockStreamer (every one: 0 resident) -- on the test device, the states as the plain
    model's (fp8: up to its rounding)."""
    from flame_nn.offload.fp8 import is_fp8_linear
    model = _model()
    path = str(tmp_path / "te.safetensors")
    io.save_file({"model." + k: v.detach() for k, v in model.named_parameters()}, path)
    ids, mask = _ids()

    def states(m):
        with flame.no_grad():
            out = m(flame.tensor(ids), flame.tensor(mask), output_hidden_states=True)
        return out.last_hidden_state.float().cpu().numpy(), out.hidden_states[1].float().cpu().numpy()
    plain = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY)
    want = states(plain)
    streamed = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY, stream=True)
    assert "0 resident" in str(streamed.streamer) and "2 streamed" in str(streamed.streamer)
    assert streamed.embed_tokens.weight.device == flame.device(device)
    for a, b in zip(states(streamed), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    fp8 = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY, quantize="fp8")
    assert all(is_fp8_linear(m) for n, m in fp8.named_modules() if n.endswith(("_proj", "o_proj")))
    assert not is_fp8_linear(fp8.embed_tokens) and fp8.embed_tokens.weight.dtype == flame.float32
    assert fp8.layers[0].self_attn.q_proj.weight.device == flame.device(device)
    got = states(fp8)
    for a, b in zip(got, want):
        assert 0 < np.abs(a - b).max() < 0.05 * np.abs(b).max()
    both = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY, quantize="fp8", stream=True)
    for a, b in zip(states(both), got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="quantize must be one of"):
        load_qwen2_5_vl(path, device="cpu", config=TINY, quantize="int8")
    with pytest.raises(ValueError, match="stream must be True or False"):
        load_qwen2_5_vl(path, device="cpu", config=TINY, stream="yes")


def test_comfyuis_fp8_scaled_file_is_read_with_its_scales(tmp_path, device):
    """ComfyUI's qwen_2.5_vl_7b_fp8_scaled layout: the layers' Linear weights in float8_e4m3fn with a per-tensor
    `scale_weight` (amax / 448), `scale_input`, the `scaled_fp8` marker: each weight is fp8 * scale (it was refused
    for its unexpected scale keys, and strict=False read it without the scales); a bad scale or format is named."""
    import ml_dtypes
    model = _model()
    ids, mask = _ids()
    state, want = {}, {}
    for k, v in model.named_parameters():
        a = v.detach().numpy()
        if ".layers." in "." + k and k.endswith("_proj.weight"):
            s = np.float32(np.abs(a).max() / 448.0)
            q = (a / s).astype(ml_dtypes.float8_e4m3fn)
            state["model." + k], want[k] = q, q.astype(np.float32) * s
            state["model." + k[:-len("weight")] + "scale_weight"] = np.array(s, np.float32)
            state["model." + k[:-len("weight")] + "scale_input"] = np.array(1.0, np.float32)
        else:
            state["model." + k], want[k] = a.astype(ml_dtypes.bfloat16), a.astype(ml_dtypes.bfloat16).astype(np.float32)
    state["scaled_fp8"] = np.zeros(0, ml_dtypes.float8_e4m3fn)
    path = str(tmp_path / "qwen_2.5_vl_fp8_scaled.safetensors")
    io.save_file(state, path)
    loaded = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY)
    got = {k: v.detach().float().cpu().numpy() for k, v in loaded.named_parameters()}
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    ref = Qwen2_5_VLTextModel(TINY, dtype=flame.float32, device="cpu")
    ref.load_state_dict({k: flame.tensor(v) for k, v in want.items()})
    with flame.no_grad():
        a = loaded(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.float().cpu().numpy()
        b = ref(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.numpy()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    fp8 = load_qwen2_5_vl(path, dtype=flame.float32, device=device, config=TINY, quantize="fp8")
    with flame.no_grad():
        c = fp8(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.float().cpu().numpy()
    assert np.abs(c - b).max() < 0.05 * np.abs(b).max()
    # fp8 storage keeps the file's own bytes and scales (read as stored: checkpoint_io.fp8_on_read), the layer's
    # output is the dequantised model's up to the fp8 GEMM's / dequantisation's roundings
    key = "layers.1.mlp.down_proj"
    layer = fp8.get_submodule(key)
    np.testing.assert_array_equal(layer.weight.view(flame.uint8).cpu().numpy(),
                                  state["model." + key + ".weight"].view(np.uint8))
    np.testing.assert_array_equal(layer.weight_scale.cpu().numpy(),
                                  np.full(layer.weight.shape[0], state["model." + key + ".scale_weight"]))
    np.testing.assert_allclose(c, a, rtol=0, atol=2e-3 * np.abs(a).max())
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.scale_weight"] = np.ones(5, np.float32)
    io.save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(Qwen2_5_VLCheckpointError, match="has 5 values for a weight of 48 rows"):
        load_qwen2_5_vl(str(tmp_path / "bad.safetensors"), device="cpu", config=TINY)
    quant = dict(state)
    quant["model.layers.0.mlp.up_proj.comfy_quant"] = np.frombuffer(json.dumps({"format": "nvfp4"}).encode(),
                                                                    np.uint8).copy()
    io.save_file(quant, str(tmp_path / "quant.safetensors"))
    with pytest.raises(Qwen2_5_VLCheckpointError, match="quantised as 'nvfp4'"):
        load_qwen2_5_vl(str(tmp_path / "quant.safetensors"), device="cpu", config=TINY)


def test_prompt_embeds_keep_each_samples_valid_tokens_after_the_template_prefix():
    from flame_models.qwen_image.conditioning import PROMPT_TEMPLATE, encode_prompts, prompt_embeds_from_states
    rng = np.random.default_rng(3)
    h = rng.normal(size=(2, 40, 4)).astype(np.float32)
    m = np.ones((2, 40), np.int64)
    m[1, 37:] = 0                                              # sample 1: 37 valid tokens -> 3 kept
    e, pm = prompt_embeds_from_states(h, m)
    assert e.shape == (2, 6, 4) and pm.tolist() == [[1] * 6, [1] * 3 + [0] * 3]
    np.testing.assert_array_equal(e[0], h[0, 34:])
    np.testing.assert_array_equal(e[1, :3], h[1, 34:37])
    assert not e[1, 3:].any()
    e2, pm2 = prompt_embeds_from_states(h, m, max_sequence_length=4)
    assert e2.shape == (2, 4, 4) and pm2[1].tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"max_sequence_length must be in \[1, 1024\]"):
        prompt_embeds_from_states(h, m, max_sequence_length=1025)
    seen = []

    def tokenize(texts, max_length):                          # a stand-in tokenizer: 36 + len(prompt) ids
        assert max_length == 1024 + 34                        # the pipeline's truncation
        seen.extend(texts)
        n = [36 + len(t) - len(PROMPT_TEMPLATE) + 2 for t in texts]
        ids = np.zeros((len(texts), max(n)), np.int64)
        mask = np.zeros_like(ids)
        for b, k in enumerate(n):
            ids[b, :k] = np.arange(k) % TINY.vocab_size
            mask[b, :k] = 1
        return flame.tensor(ids), flame.tensor(mask)
    out = encode_prompts(_model(), tokenize, ["a cat", "a dog on a mat"])
    assert seen[0].startswith("<|im_start|>system\nDescribe the image") and "user\na cat<|im_end|>" in seen[0]
    assert out["prompt_embeds"].shape == (2, 16, 32) and out["prompt_mask"].sum(axis=1).tolist() == [7, 16]
