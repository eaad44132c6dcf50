"""Text encoders on a GPU: the fused attention kernels (bf16) with CLIP's causal / padding masks and T5's additive
position bias (padded keys at -inf, left padding too), CUDA graph replay (GraphedEncoder: no host sync inside a
forward), fp8 storage's memory, and streamed T5 blocks on the copy stream."""
import numpy as np
import pytest
from text_encoder_helpers import folder, io

import flame_core as flame
import flame_core.memory as fmem
from flame_models.text_encoders import GraphedEncoder, load_clip, load_t5

pytestmark = pytest.mark.gpu


def rel_rms(got, want):
    return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


@pytest.mark.parametrize("name", ["clip_l_legacy", "clip_g_proj"])
def test_clip_bf16_kernels_with_masks(name):
    ref = io(name)
    model = load_clip(folder(name), dtype="bfloat16", device="cuda")
    for tag, mask in (("out", None), ("masked", ref["attention_mask"])):
        out = model(ref["input_ids"], attention_mask=mask, output_hidden_states=True)
        got = out.last_hidden_state.float().numpy()
        assert np.isfinite(got).all()
        assert rel_rms(got, ref[f"{tag}.last_hidden_state"]) < 0.02
        penultimate = ref[f"{tag}.hidden_states.{len(out.hidden_states) - 2}"]
        assert rel_rms(out.hidden_states[-2].float().numpy(), penultimate) < 0.02


@pytest.mark.parametrize("length, pad", [(24, 9), (300, 200)])
def test_t5_bf16_kernel_with_bias_and_left_padding(length, pad):
    """The fused attention reads the float32 position bias as its additive mask, MASKED at padded keys; 200 left
    padded tokens make whole key blocks masked for every row. Against the same weights in float32 on the cpu."""
    ref_model = load_t5(folder("t5"), device="cpu")
    model = load_t5(folder("t5"), dtype="bfloat16", device="cuda")
    ids = np.random.default_rng(length).integers(2, 80, (2, length))
    mask = np.ones_like(ids)
    mask[1, :pad] = 0  # left padding
    want = ref_model(ids, attention_mask=mask).last_hidden_state.numpy()
    got = model(ids, attention_mask=mask).last_hidden_state.float().numpy()
    assert np.isfinite(got).all()
    assert rel_rms(got[0], want[0]) < 0.02 and rel_rms(got[1, pad:], want[1, pad:]) < 0.02


@pytest.mark.parametrize("name", ["clip_g_proj", "t5"])
def test_graphed_encoder_replays_eager_numbers(name):
    ref = io(name)
    load = load_t5 if name == "t5" else load_clip
    model = load(folder(name), dtype="bfloat16", device="cuda")
    enc = GraphedEncoder(model)
    ids = flame.tensor(ref["input_ids"], device="cuda")
    eager = model(ids, attention_mask=ref["attention_mask"], output_hidden_states=True)
    outs = [enc(ids, attention_mask=ref["attention_mask"], output_hidden_states=True) for _ in range(3)]
    assert len(enc._graphs) == 1 and enc._graphs[next(iter(enc._graphs))].graph is not None  # captured
    for out in outs:
        assert out.keys() == eager.keys()
        for k in eager.keys():
            a = eager[k] if k != "hidden_states" else eager[k][-2]
            b = out[k] if k != "hidden_states" else out[k][-2]
            np.testing.assert_allclose(b.float().numpy(), a.float().numpy(), rtol=1e-2, atol=1e-2)
    other = ids.flip(1)  # a different input of the same shape: replayed, and the earlier outputs keep their values
    first = outs[0].last_hidden_state.float().numpy().copy()
    new = enc(other, attention_mask=ref["attention_mask"], output_hidden_states=True)
    np.testing.assert_array_equal(outs[0].last_hidden_state.float().numpy(), first)
    np.testing.assert_allclose(new.last_hidden_state.float().numpy(),
                               model(other, attention_mask=ref["attention_mask"]).last_hidden_state.float().numpy(),
                               rtol=1e-2, atol=1e-2)
    assert np.abs(new.last_hidden_state.float().numpy() - first).max() > 1e-2  # it did compute the new input
    enc.reset()


def test_fp8_storage_halves_t5_weights():
    fmem.empty_cache()
    base = fmem.memory_allocated()
    dense = load_t5(folder("t5"), dtype="bfloat16", device="cuda")
    dense_bytes = fmem.memory_allocated() - base
    dense_params, dense_buffers = [p.detach() for p in dense.parameters()], [b for b in dense.buffers()]
    dense_params = [flame.empty(*p.shape, dtype=p.dtype, device="cpu") for p in dense_params]
    dense_buffers = [flame.empty(*b.shape, dtype=b.dtype, device="cpu") for b in dense_buffers]
    del dense
    fmem.empty_cache()
    base = fmem.memory_allocated()
    fp8 = load_t5(folder("t5"), dtype="bfloat16", device="cuda", quantize="fp8")
    fp8_bytes = fmem.memory_allocated() - base
    linear = sum(p.numel() for n, p in fp8.named_parameters() if p.dtype == flame.float8_e4m3fn)
    assert linear > 0
    stored = sum(t.numel() * t.element_size() for t in (*fp8.parameters(), *fp8.buffers()))
    dense_stored = sum(t.numel() * t.element_size() for t in (*dense_params, *dense_buffers))
    rows = sum(p.shape[0] for n, p in fp8.named_parameters() if p.dtype == flame.float8_e4m3fn)
    assert stored <= dense_stored - linear + 4 * rows  # one byte per Linear weight instead of two, + fp32 scales
    assert fp8_bytes < dense_bytes  # the pool: a tiny model's tensors round up to its block size, so only less


def test_streamed_t5_on_the_copy_stream():
    ref = io("t5_fp8")
    path = folder("t5_fp8") + "/t5xxl_fp8_e4m3fn_scaled.safetensors"
    plain = load_t5(path, config=folder("t5"), device="cuda")
    for m in plain.modules():  # the streamed blocks run their layers one by one: so does the resident model here
        if m.__dict__.get("fused_projections") is not None:  # (stacked fp8 projections: GEGLU's single rounding)
            m.__dict__["fused_projections"] = None
    streamed = load_t5(path, config=folder("t5"), device="cuda", stream=True)
    with flame.no_grad():
        for _ in range(3):  # the inference window wraps around from call to call
            a = streamed(ref["input_ids"], attention_mask=ref["attention_mask"]).last_hidden_state.float().numpy()
            b = plain(ref["input_ids"], attention_mask=ref["attention_mask"]).last_hidden_state.float().numpy()
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
    assert streamed.streamer.stats["bytes_h2d"] > 0
    streamed.streamer.close()
