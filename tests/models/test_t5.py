"""T5EncoderModel against transformers' outputs (tests/fixtures/text_encoders), in every checkpoint layout load_t5
reads (ComfyUI fp8 files included), with fp8 storage and block streaming, and the errors it gives."""
import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from text_encoder_helpers import TIGHT, config, copy_folder, folder, io, outputs_close, save, shard, weights

import flame_core as flame
import flame_nn
from flame_core.autograd import gradcheck
from flame_models.text_encoders import (
    T5_PRESETS,
    T5Config,
    T5EncoderModel,
    TextEncoderCheckpointError,
    TextEncoderConfigError,
    infer_t5_config,
    load_t5,
    relative_position_bucket,
)
from flame_models.text_encoders.t5 import T5Block, _clamp_fp16
from flame_nn.offload import is_fp8_linear

FP8 = folder("t5_fp8")


def cfg():
    return T5Config.from_dict(config("t5"))


def rel_rms(got, want):
    return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("tag", ["out", "masked"])
def test_matches_transformers(tag, device):
    ref = io("t5")
    model = load_t5(folder("t5"), device=device)
    mask = ref["attention_mask"] if tag == "masked" else None
    out = model(ref["input_ids"], attention_mask=mask, output_hidden_states=True)
    assert outputs_close(out, ref, tag) == ["last_hidden_state", "hidden_states"]
    assert len(out.hidden_states) == 4
    # transformers' convention: the last hidden state in the tuple is the final-normed one
    np.testing.assert_array_equal(out.hidden_states[-1].numpy(), out.last_hidden_state.numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chained_blocks_fuse_the_adds_with_the_norms(device, monkeypatch, dtype):
    """Blocks run as plain calls chain each residual add with the norm after it (F.add_rms_norm, 2 per block); a
    hook on a sub-layer turns the chain off (the sub-layers run as modules); both give the same outputs and hidden
    states (float32: to rounding; bfloat16: the same ops, one kernel for two)."""
    from flame_models.text_encoders import t5 as T
    ref = io("t5")
    model = load_t5(folder("t5"), dtype=dtype, device=device)
    calls = []
    real = T.F.add_rms_norm
    monkeypatch.setattr(T.F, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    chained = model(ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True)
    assert len(calls) == 2 * len(model.encoder.block)
    seen = []
    model.encoder.block[1].layer[1].register_forward_hook(lambda m, a, out: seen.append(1))
    plain = model(ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True)
    assert len(calls) == 2 * len(model.encoder.block) and seen == [1]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip((chained.last_hidden_state,) + chained.hidden_states,
                    (plain.last_hidden_state,) + plain.hidden_states):
        np.testing.assert_allclose(a.float().numpy(), b.float().numpy(), **tol)


def test_fused_feed_forward_matches_the_separate_projections(device):
    """Loaded packed, each feed-forward runs wi_0 | wi_1 as one matmul into one GEGLU (gate first): the same outputs
    as the two projections, the GELU and the product (float32: to rounding); a gradient wanted for the weights runs
    them one by one."""
    ref = io("t5")
    model = load_t5(folder("t5"), device=device)
    ffs = [b.layer[1].DenseReluDense for b in model.encoder.block]
    assert all(f.fused_projections is not None for f in ffs)
    fused = model(ref["input_ids"], attention_mask=ref["attention_mask"]).last_hidden_state.numpy()
    saved = [f.__dict__.pop("fused_projections") for f in ffs]
    separate = model(ref["input_ids"], attention_mask=ref["attention_mask"]).last_hidden_state.numpy()
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)
    for f, fp in zip(ffs, saved):
        f.__dict__["fused_projections"] = fp
    ffs[0].wi_1.weight.requires_grad_(True)
    x = flame.randn(1, 3, ffs[0].wi_0.in_features, device=device)
    assert ffs[0].fused_projections(x) is None


def test_mask_changes_only_the_padded_sample():
    ref = io("t5")
    a, b = ref["out.last_hidden_state"], ref["masked.last_hidden_state"]
    np.testing.assert_allclose(a[0], b[0], atol=1e-6)
    assert np.abs(a[1] - b[1]).max() > 1e-3


def test_relative_position_buckets_match_transformers():
    ref = io("t5")
    rel = np.arange(-400, 401)
    for nb, md in ((32, 128), (8, 16)):
        np.testing.assert_array_equal(relative_position_bucket(rel, nb, md), ref[f"buckets.{nb}_{md}"])


def test_position_bias_computed_once_per_forward(device, monkeypatch):
    from flame_models.text_encoders import t5 as T
    model = load_t5(folder("t5"), device=device)
    calls = []
    orig = T.T5Attention.compute_bias
    monkeypatch.setattr(T.T5Attention, "compute_bias", lambda self, *a: calls.append(1) or orig(self, *a))
    model(io("t5")["input_ids"])
    assert len(calls) == 1


def test_bfloat16_close(device):
    ref = io("t5")
    model = load_t5(folder("t5"), dtype="bfloat16", device=device)
    out = model(ref["input_ids"], attention_mask=ref["attention_mask"])
    assert out.last_hidden_state.dtype == flame.bfloat16
    assert rel_rms(out.last_hidden_state.float().numpy(), ref["masked.last_hidden_state"]) < 0.02


def test_float16_keeps_wo_in_float32(device):
    """transformers' T5 in float16: `wo` stays float32, so the residual stream becomes float32."""
    ref = io("t5")
    model = load_t5(folder("t5"), dtype="float16", device=device)
    ff = model.encoder.block[0].layer[1].DenseReluDense
    assert ff.wo.weight.dtype == flame.float32 and ff.wi_0.weight.dtype == flame.float16
    out = model(ref["input_ids"], output_hidden_states=True)
    assert out.hidden_states[1].dtype == flame.float32
    assert out.last_hidden_state.dtype == flame.float16  # the final norm returns its weight's dtype
    assert rel_rms(out.last_hidden_state.float().numpy(), ref["out.last_hidden_state"]) < 0.003


def test_fp16_clamp():
    x = flame.tensor(np.array([1.0, np.inf, -3.0], np.float16))  # an overflow to inf
    np.testing.assert_array_equal(_clamp_fp16(x).float().numpy(), [1.0, 64512.0, -3.0])  # 65504 - 1000, rounded
    y = flame.tensor([65504.0, -65504.0], dtype=flame.float16)
    np.testing.assert_array_equal(_clamp_fp16(y).numpy(), y.numpy())  # no inf: the float16 range is kept
    z = flame.tensor([1e30], dtype=flame.float32)
    assert _clamp_fp16(z) is z


# ----------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("kind", ["plain", "scaled"])
def test_comfyui_fp8_files(kind, device):
    """t5xxl_fp8_e4m3fn[_scaled].safetensors: the fp8 weights go to fp8 storage as stored (scale_weight becomes
    the rows' scales, nothing re-rounded), in float32 compute the outputs are transformers' on the dequantised
    weights."""
    name = "t5xxl_fp8_e4m3fn" + ("_scaled" if kind == "scaled" else "")
    path = f"{FP8}/{name}.safetensors"
    ref = io("t5_fp8")
    model = load_t5(path, config=folder("t5"), dtype="float32", device=device)
    wo = model.encoder.block[2].layer[1].DenseReluDense.wo
    assert is_fp8_linear(wo) and wo.weight.dtype == flame.float8_e4m3fn
    stored = {k: v for k, v in flame.io.load_file(path).items()}
    key = "encoder.block.2.layer.1.DenseReluDense.wo"
    want = stored[key + ".weight"].float().numpy()
    if kind == "scaled":
        want = want * stored[key + ".scale_weight"].numpy()
    np.testing.assert_array_equal(wo.dequantized_weight(flame.float32).numpy(), want)
    out = model(ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True)
    outputs_close(out, ref, kind)
    dense = load_t5(path, config=folder("t5"), dtype="float32", device=device, quantize=None)
    assert not is_fp8_linear(dense.encoder.block[2].layer[1].DenseReluDense.wo)
    outputs_close(dense(ref["input_ids"], attention_mask=ref["attention_mask"]), ref, kind)


def test_e5m2_weights_are_widened(tmp_path, device):
    """float8_e5m2 has no fp8 storage here: such weights are dequantised (or, quantize="fp8", re-quantised)."""
    w = weights("t5")
    key = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    w[key] = w[key].astype(ml_dtypes.float8_e5m2)
    path = save(w, tmp_path / "e5m2.safetensors")
    model = load_t5(path, config=cfg(), dtype="float32", device=device)
    np.testing.assert_array_equal(model.get_parameter(key).numpy(), w[key].astype(np.float32))
    assert is_fp8_linear(load_t5(path, config=cfg(), device=device, quantize="fp8").encoder.block[1].layer[1]
                         .DenseReluDense.wo)


def test_fp8_file_defaults_to_bfloat16(device):
    model = load_t5(f"{FP8}/t5xxl_fp8_e4m3fn_scaled.safetensors", config=folder("t5"), device=device)
    assert model.dtype == flame.bfloat16
    assert model.encoder.block[0].layer[0].SelfAttention.q.compute_dtype == flame.bfloat16
    ref = io("t5_fp8")
    out = model(ref["input_ids"], attention_mask=ref["attention_mask"])
    assert rel_rms(out.last_hidden_state.float().numpy(), ref["scaled.last_hidden_state"]) < 0.03


def test_quantize_fp8_from_float32(device):
    ref = io("t5")
    model = load_t5(folder("t5"), device=device, quantize="fp8")
    layers = [m for n, m in model.named_modules() if is_fp8_linear(m)]
    assert len(layers) == 3 * 7
    assert not is_fp8_linear(model.shared) and model.shared.weight.dtype == flame.float32
    got = model(ref["input_ids"]).last_hidden_state.numpy()
    assert 1e-3 < rel_rms(got, ref["out.last_hidden_state"]) < 0.1


def test_fp8_storage_runs_stacked_projections_as_one_matmul(device):
    """quantize="fp8": q | k | v and wi_0 | wi_1 stacked (FusedFp8Projections: one dequantisation and one GEMM per
    group, the layers' weights and scales row views of the stacked tensors, nothing kept twice); the same numbers as
    the layers one by one, the input's gradient too; a weight rebound or autocast run them one by one."""
    from flame_models.text_encoders.storage import FusedFp8Projections
    ref = io("t5")
    model = load_t5(folder("t5"), device=device, quantize="fp8")
    host = lambda a: a if isinstance(a, np.ndarray) else a.get()  # noqa: E731 (a CuPy array's copy on the host)
    groups = [(b.layer[0].SelfAttention, ("q", "k", "v")) for b in model.encoder.block]
    groups += [(b.layer[1].DenseReluDense, ("wi_0", "wi_1")) for b in model.encoder.block]
    for m, names in groups:
        fp = m.fused_projections
        assert isinstance(fp, FusedFp8Projections) and fp.matches()
        lo = 0
        for n in names:
            lin = getattr(m, n)
            rows = lin.weight.shape[0]
            assert is_fp8_linear(lin) and lin.weight.array.base is not None  # a view of the stacked rows
            np.testing.assert_array_equal(host(lin.weight.array.view(np.uint8)),
                                          host(fp.q.array[lo:lo + rows].view(np.uint8)))
            np.testing.assert_array_equal(lin.weight_scale.numpy(), fp.scales.numpy()[lo:lo + rows])
            lo += rows
        assert lo == fp.q.shape[0] == fp.scales.shape[0]
    fused = model(ref["input_ids"]).last_hidden_state.numpy()
    saved = [m.__dict__.pop("fused_projections") for m, _ in groups]
    separate = model(ref["input_ids"]).last_hidden_state.numpy()
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)
    assert 1e-3 < rel_rms(fused, ref["out.last_hidden_state"]) < 0.1  # fp8's error, not another model's
    for (m, _), fp in zip(groups, saved):
        m.__dict__["fused_projections"] = fp
    attn = groups[0][0]
    x = flame.randn(1, 3, attn.q.in_features, device=device)
    got = attn.fused_projections(x)
    want = flame.cat([attn.q(x), attn.k(x), attn.v(x)], -1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    with flame.amp.autocast(device.type, dtype=flame.bfloat16):
        assert attn.fused_projections(x) is None
    xg = x.detach().requires_grad_(True)  # the input's gradient goes through the stacked op's backward
    (attn.fused_projections(xg) ** 2).sum().backward()
    xs = x.detach().requires_grad_(True)
    (flame.cat([attn.q(xs), attn.k(xs), attn.v(xs)], -1) ** 2).sum().backward()
    np.testing.assert_allclose(xg.grad.numpy(), xs.grad.numpy(), rtol=1e-5, atol=1e-5)
    old = attn.k.weight
    attn.k.weight = flame_nn.Parameter(old.detach().clone(), requires_grad=False)  # same values, not the view
    assert not attn.fused_projections.matches() and attn.fused_projections(x) is None
    attn.k.weight = old
    assert attn.fused_projections.matches()


# ----------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("path", [folder("t5"), f"{FP8}/t5xxl_fp8_e4m3fn_scaled.safetensors"])
def test_streamed_blocks(path, device):
    """stream=True: the blocks live in host memory and stream through the BlockStreamer's slots; same numbers."""
    fp8 = path.startswith(FP8)
    ref = io("t5_fp8" if fp8 else "t5")
    model = load_t5(path, config=folder("t5"), dtype="float32", device=device, stream=True)
    assert model.streamer is not None and model.streamer.streamed == [0, 1, 2]
    assert np.isnan(model.encoder.block[1].layer[1].layer_norm.weight.numpy()).all()  # placeholders between uses
    for _ in range(2):
        with flame.no_grad():
            out = model(ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True)
        outputs_close(out, ref, "scaled" if fp8 else "masked")
    assert model.streamer.stats["loads"] >= 6
    # with gradients on, a streamed block runs checkpointed (for a backward that would load it again): same numbers
    out = model(ref["input_ids"], attention_mask=ref["attention_mask"])
    np.testing.assert_allclose(out.last_hidden_state.detach().numpy(),
                               ref[("scaled" if fp8 else "masked") + ".last_hidden_state"], **TIGHT)


# ----------------------------------------------------------------------------- layouts
def test_sharded_diffusers_and_single_files(tmp_path, device):
    ref = io("t5")
    w = weights("t5")
    shard(w, tmp_path / "flux" / "text_encoder_2", n=2)
    (tmp_path / "flux" / "text_encoder_2" / "config.json").write_text(json.dumps(config("t5")))
    copy_folder("clip_l_legacy", tmp_path / "flux" / "text_encoder")
    (tmp_path / "flux" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    copy_folder("t5", tmp_path / "sd3" / "text_encoder_3")
    copy_folder("clip_g_proj", tmp_path / "sd3" / "text_encoder_2")
    (tmp_path / "sd3" / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    both = dict(w, **{"encoder.embed_tokens.weight": w["shared.weight"]})  # the tied copy beside shared
    only_embed = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in w.items()}
    sd3 = {"text_encoders.t5xxl.transformer." + k: v for k, v in both.items()}
    sd3.update({"text_encoders.clip_l.transformer." + k: v for k, v in weights("clip_l_legacy").items()})
    loads = [(tmp_path / "flux", {}), (tmp_path / "sd3", {}),
             (save(both, tmp_path / "t5xxl_fp16.safetensors"), {"config": cfg()}),
             (save(only_embed, tmp_path / "t5_embed.safetensors"), {"config": cfg()}),
             (save(sd3, tmp_path / "sd3.safetensors"), {"config": cfg()})]
    for path, kw in loads:
        model = load_t5(path, device=device, **kw)
        outputs_close(model(ref["input_ids"], attention_mask=ref["attention_mask"]), ref, "masked")


def test_config_inferred_from_shapes():
    c = T5_PRESETS["t5-xxl"]
    shapes = {"shared.weight": (c.vocab_size, c.d_model),
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, c.num_heads),
              "encoder.block.0.layer.1.DenseReluDense.wi_0.weight": (c.d_ff, c.d_model)}
    for i in range(c.num_layers):
        shapes[f"encoder.block.{i}.layer.0.SelfAttention.q.weight"] = (c.inner_dim, c.d_model)
    assert infer_t5_config(shapes) == c
    tiny = {k: tuple(v.shape) for k, v in weights("t5").items()}
    inferred = infer_t5_config(tiny)
    assert inferred == T5Config(**dict(cfg().to_dict(), relative_attention_max_distance=128))
    del shapes["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"]
    with pytest.raises(TextEncoderConfigError, match="not a T5 v1.1"):
        infer_t5_config(shapes)


def test_config_checks():
    with pytest.raises(TextEncoderConfigError, match="feed_forward_proj 'relu' is not supported"):
        T5Config(feed_forward_proj="relu")
    with pytest.raises(TextEncoderConfigError, match="num_heads must be a positive int"):
        T5Config(num_heads=0)
    assert T5Config.from_pretrained(folder("t5")).relative_attention_max_distance == 16


# ----------------------------------------------------------------------------- errors
def test_errors_named(tmp_path):
    with pytest.raises(TextEncoderCheckpointError, match=r"holds no T5 encoder: it looks like CLIP text model "
                                                         r".*use load_clip"):
        load_t5(folder("clip_l_legacy") + "/model.safetensors")
    w = weights("t5")
    full = dict(w, **{"decoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((32, 32), np.float32),
                      "lm_head.weight": np.zeros((80, 32), np.float32)})
    path = save(full, tmp_path / "t5_full.safetensors")  # a whole T5: its decoder is left out, as transformers does
    outputs_close(load_t5(path, config=cfg())(io("t5")["input_ids"]), io("t5"), "out")
    odd = dict(w, **{"encoder.extra.weight": np.zeros(2, np.float32), "lm_head_2.weight": np.zeros(2, np.float32)})
    path = save(odd, tmp_path / "t5_odd.safetensors")
    with pytest.raises(TextEncoderCheckpointError, match=r"(?s)unexpected \(2\): .*strict=False") as e:
        load_t5(path, config=cfg())
    assert "encoder.extra.weight" in str(e.value) and "lm_head_2.weight" in str(e.value)
    outputs_close(load_t5(path, config=cfg(), strict=False)(io("t5")["input_ids"]), io("t5"), "out")
    quant = dict(w)
    quant["encoder.block.0.layer.0.SelfAttention.q.comfy_quant"] = np.frombuffer(
        json.dumps({"format": "nvfp4"}).encode(), np.uint8).copy()
    with pytest.raises(TextEncoderCheckpointError, match="quantised as 'nvfp4'"):
        load_t5(save(quant, tmp_path / "q.safetensors"), config=cfg())
    scaled = dict(w)
    scaled["encoder.block.0.layer.0.SelfAttention.q.scale_weight"] = np.ones(5, np.float32)
    scaled["encoder.block.0.layer.0.SelfAttention.q.weight"] = w["encoder.block.0.layer.0.SelfAttention.q.weight"] \
        .astype(flame.float8_e4m3fn.np)
    with pytest.raises(TextEncoderCheckpointError, match="has 5 values for a weight of 32 rows"):
        load_t5(save(scaled, tmp_path / "s.safetensors"), config=cfg())
    with pytest.raises(ValueError, match="stream"):
        load_t5(folder("t5"), stream="yes")
    model = load_t5(folder("t5"))
    with pytest.raises(IndexError, match="vocabulary has 80"):
        model(np.array([[1, 80]]))


# ----------------------------------------------------------------------------- gradients
@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), L=st.integers(1, 6), masked=st.booleans(), train_table=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_block_gradcheck(B, L, masked, train_table, seed):
    """Block 0 (position bias from its table, padding folded in) then block 1 (the bias given), in float64:
    gradients of the input, of a feed-forward weight and (when it trains: the plain attention form) of the
    relative attention bias table; else the fused attention with the bias as its additive mask."""
    rng = np.random.default_rng(seed)
    c = T5Config(vocab_size=10, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2,
                 relative_attention_num_buckets=6, relative_attention_max_distance=4)
    blocks = [T5Block(c, i == 0, dtype=flame.float64) for i in range(2)]
    for b in blocks:
        for p in b.parameters():
            p.data.copy_(flame.tensor(rng.uniform(-0.5, 0.5, tuple(p.shape)), dtype=flame.float64))
    x = flame.tensor(rng.standard_normal((B, L, 8)), dtype=flame.float64, requires_grad=True)
    keep = None
    if masked:
        k = np.ones((B, L), bool)
        k[-1, L // 2 + 1:] = False
        keep = flame.tensor(k)
    table = blocks[0].layer[0].SelfAttention.relative_attention_bias.weight
    wi = blocks[1].layer[1].DenseReluDense.wi_1.weight

    table.requires_grad_(train_table)

    def run(x, wi, *table):
        h, bias = blocks[0](x, None, keep)
        assert bias.requires_grad == train_table
        return blocks[1](h, bias)[0]
    assert gradcheck(run, (x, wi) + ((table,) if train_table else ()))


def test_tiny_model_built_at_run_time(tmp_path):
    c = T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                 relative_attention_max_distance=20)
    model = T5EncoderModel(c)
    ids, mask = np.array([[3, 7, 1, 0]]), np.array([[1, 1, 1, 0]])
    h = model(ids, attention_mask=mask).last_hidden_state.detach().numpy()
    assert h.shape == (1, 4, 16) and np.isfinite(h).all()
    nothing = model(ids, attention_mask=np.zeros((1, 4))).last_hidden_state.detach().numpy()
    assert np.isfinite(nothing).all()  # all padding: uniform attention (transformers' finfo.min does the same)
    _, file = model.save_pretrained(tmp_path / "tiny")
    for again in (T5EncoderModel.from_pretrained(tmp_path / "tiny"), load_t5(file)):  # file alone: metadata config
        assert again.config == c
        np.testing.assert_allclose(again(ids, attention_mask=mask).last_hidden_state.numpy(), h, rtol=1e-6,
                                   atol=1e-6)
    streamed = load_t5(file, stream=True)
    with pytest.raises(ValueError, match="streamer"):
        streamed.save_pretrained(tmp_path / "again")
