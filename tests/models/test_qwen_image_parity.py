"""FLAME's Qwen-Image transformer and VAE against diffusers 0.42.1's QwenImageTransformer2DModel and
AutoencoderKLQwenImage on tiny random float32 configs: the fixtures tests/fixtures/qwen_image/ written by
tests/fixtures/make_qwen_image_fixtures.py (weights in diffusers' names, read by FLAME's loaders; inputs; diffusers'
float32 and float64 outputs and float64 gradients). Relative error (max |ours - theirs| / max |theirs|) <= 1e-4 for
the transformer's outputs without and with the text mask, its input gradients and every parameter's gradient, the
VAE's one-frame posterior and decoding (untiled and tiled), the pipeline's 2x2 packing and the scheduler's sigmas."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_core.device import default_device
from flame_models.bfl.sampling import pack
from flame_models.qwen_image import load_qwen_image, params_from_config
from flame_models.qwen_image import sampling as S

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "qwen_image")
RTOL = 1e-4


def _read(name):
    with io.safe_open(os.path.join(HERE, name)) as f:
        return {k: f.get_array(k) for k in f.keys()}, f.metadata() or {}


def _t(a, grad=False):
    return flame.tensor(np.ascontiguousarray(a, dtype=np.float32), requires_grad=grad)


def _rel(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def fixture():
    _, meta = _read("qwen_image_weights.safetensors")
    params = params_from_config(json.loads(meta["config"]))
    model = load_qwen_image(os.path.join(HERE, "qwen_image_weights.safetensors"), dtype=flame.float32,
                            device=default_device(), params=params)              # the test device
    arrays, io_meta = _read("qwen_image_io.safetensors")
    return model, arrays, io_meta


def _forward(model, a, meta, mask, grad=False):
    h, e = _t(a["hidden_states"], grad), _t(a["encoder_hidden_states"], grad)
    out = model(hidden_states=h, encoder_hidden_states=e,
                encoder_hidden_states_mask=None if mask is None else _t(mask), timestep=_t(a["timestep"]),
                img_shapes=[[tuple(s) for s in sample] for sample in json.loads(meta["img_shapes"])])
    return out, h, e


def test_the_fixture_is_diffusers_0_42_1(fixture):
    assert fixture[2]["diffusers"] == "0.42.1"


def test_the_output_without_a_mask_matches_diffusers(fixture):
    model, a, meta = fixture
    with flame.no_grad():
        out = _forward(model, a, meta, None)[0].numpy()
    assert _rel(out, a["out_nomask_f64"]) <= RTOL, _rel(out, a["out_nomask_f64"])
    assert _rel(out, a["out_nomask"]) <= RTOL


def test_the_masked_output_matches_diffusers_and_the_trimmed_text(fixture):
    model, a, meta = fixture
    with flame.no_grad():
        out = _forward(model, a, meta, a["encoder_hidden_states_mask"])[0].numpy()
    assert _rel(out[1:], a["out_trim1_f64"]) <= RTOL, _rel(out[1:], a["out_trim1_f64"])
    assert _rel(out[:1], a["out_nomask_f64"][:1]) <= RTOL          # sample 0's tokens are all valid
    if "out_f64" in a:                                             # diffusers' own masked call ran
        assert _rel(out, a["out_f64"]) <= RTOL, _rel(out, a["out_f64"])
    else:
        pytest.skip(f"diffusers' masked call failed when the fixture was made: {meta.get('masked_error')}")


def test_input_and_parameter_gradients_match_diffusers(fixture):
    model, a, meta = fixture
    model.zero_grad()
    out, h, e = _forward(model, a, meta, None, grad=True)
    (out * _t(a["cot"])).sum().backward()
    assert _rel(h.grad.numpy(), a["grad_hidden_states"]) <= RTOL
    assert _rel(e.grad.numpy(), a["grad_encoder_hidden_states"]) <= RTOL
    grads, _ = _read("qwen_image_grads.safetensors")
    params = dict(model.named_parameters())
    # the last block's text-only Linears reach no output: no gradient in either
    assert set(grads) == {k for k, p in params.items() if p.grad is not None}
    worst = max((_rel(params[k].grad.numpy(), g), k) for k, g in grads.items() if np.abs(g).max() > 0)
    assert worst[0] <= RTOL, worst
    model.zero_grad()


def test_masked_input_gradients_match_diffusers(fixture):
    model, a, meta = fixture
    if "grad_masked_hidden_states" not in a:
        pytest.skip(f"diffusers' masked call failed when the fixture was made: {meta.get('masked_error')}")
    model.zero_grad()
    out, h, e = _forward(model, a, meta, a["encoder_hidden_states_mask"], grad=True)
    (out * _t(a["cot"])).sum().backward()
    assert _rel(h.grad.numpy(), a["grad_masked_hidden_states"]) <= RTOL
    assert _rel(e.grad.numpy(), a["grad_masked_encoder_hidden_states"]) <= RTOL
    model.zero_grad()


def test_packing_and_the_schedulers_sigmas_match_the_pipeline():
    a, meta = _read("qwen_image_pipeline.safetensors")
    lat = a["latents"]                                              # (B, 1, 16, h, w)
    np.testing.assert_array_equal(pack(_t(lat[:, 0])).numpy(), a["packed"])
    for n in (4096, 20):
        assert S.shift_mu(n) == pytest.approx(float(meta[f"mu_{n}"]), rel=1e-12)
        np.testing.assert_allclose(S.sigmas(8, n), a[f"sigmas_{n}"], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the VAE
@pytest.fixture(scope="module")
def vae_fixture():
    from flame_models.qwen_image.vae import QwenImageVAEConfig, load_vae
    _, meta = _read("qwen_image_vae_weights.safetensors")
    config = QwenImageVAEConfig.from_diffusers(json.loads(meta["config"]))
    vae = load_vae(os.path.join(HERE, "qwen_image_vae_weights.safetensors"), dtype=flame.float32, device="cpu",
                   config=config)
    arrays, io_meta = _read("qwen_image_vae_io.safetensors")
    return vae, arrays, io_meta


def test_the_vae_encodes_and_decodes_one_frame_as_diffusers(vae_fixture):
    vae, a, _ = vae_fixture
    with flame.no_grad():
        dist = vae.encode_dist(_t(a["x"][:, :, 0]))
        decoded = vae.decode(_t(a["z"][:, :, 0])).numpy()
    assert _rel(dist.mean.numpy(), a["mean_f64"][:, :, 0]) <= RTOL, _rel(dist.mean.numpy(), a["mean_f64"][:, :, 0])
    assert _rel(dist.logvar.numpy(), a["logvar_f64"][:, :, 0]) <= RTOL
    assert _rel(dist.mean.numpy(), a["mean"][:, :, 0]) <= RTOL
    assert _rel(decoded, a["decoded_f64"][:, :, 0]) <= RTOL, _rel(decoded, a["decoded_f64"][:, :, 0])


def test_the_vaes_tiles_match_diffusers(vae_fixture):
    vae, a, meta = vae_fixture
    tiles = json.loads(meta["tiles"])
    vae.enable_tiling(tiles["tile_sample_min_height"], tiles["tile_sample_stride_height"])
    try:
        with flame.no_grad():
            mean = vae.encode(_t(a["x_large"][:, :, 0])).numpy()
            decoded = vae.decode(_t(a["z_large"][:, :, 0])).numpy()
    finally:
        vae.use_tiling = None
    assert _rel(mean, a["tiled_mean_f64"][:, :, 0]) <= RTOL, _rel(mean, a["tiled_mean_f64"][:, :, 0])
    assert _rel(decoded, a["tiled_decoded_f64"][:, :, 0]) <= RTOL, _rel(decoded, a["tiled_decoded_f64"][:, :, 0])


# ----------------------------------------------------------------------------- the text encoder
def test_the_qwen2_5_vl_language_model_matches_transformers():
    from flame_models.text_encoders.qwen2_5_vl import Qwen2_5_VLTextConfig, load_qwen2_5_vl
    a, meta = _read("qwen_image_te_io.safetensors")
    config = Qwen2_5_VLTextConfig.from_transformers(json.loads(meta["text_config"]))
    te = load_qwen2_5_vl(os.path.join(HERE, "qwen_image_te_weights.safetensors"), dtype=flame.float32, device="cpu",
                         config=config)
    mask = a["attention_mask"]
    with flame.no_grad():
        out = te(flame.tensor(a["input_ids"].astype(np.int64)), attention_mask=flame.tensor(mask),
                 output_hidden_states=True)
    assert len(out.hidden_states) == int(meta["n_hidden_states"])
    valid = mask != 0                                   # the pads' own rows depend on transformers' pad positions
    for ours, theirs in ((out.hidden_states[-1], a["last_f64"]), (out.hidden_states[0], a["first_f64"]),
                         (out.hidden_states[1], a["layer1_f64"])):
        got = ours.numpy()[valid]
        assert _rel(got, theirs[valid]) <= RTOL, _rel(got, theirs[valid])
    assert _rel(out.last_hidden_state.numpy()[valid], a["last"][valid]) <= RTOL
