"""FLAME's Flux Kontext inputs and Chroma against diffusers 0.42.1 on tiny random float32 configs: the fixtures
tests/fixtures/kontext_chroma/ written by tests/fixtures/make_kontext_chroma_fixtures.py (weights in diffusers'
names, read by FLAME's loaders; inputs; diffusers' float32 and float64 outputs). Relative error (max |ours -
theirs| / max |theirs|) <= 1e-4 against the float64 output. Chroma is compared without a text mask (diffusers
0.42.1 passes its mask as an additive float bias; FLAME's masking is checked against trimmed text in
test_chroma_model.py)."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models.bfl import flux_params_from_config, image_ids, load_flux
from flame_models.chroma import chroma_params_from_config, load_chroma
from flame_models.flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS, reference_ids, target_velocity, with_reference

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "kontext_chroma")
RTOL = 1e-4


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """Float32 golden checks on the CPU, also in a FLAME_DEVICE=cuda run (its default device is cuda)."""
    prev = flame.default_device()
    flame.set_default_device("cpu")
    try:
        yield
    finally:
        flame.set_default_device(prev)


def _read(name):
    path = os.path.join(HERE, name)
    with io.safe_open(path) as f:
        meta = f.metadata() or {}
        arrays = {k: f.get_array(k) for k in f.keys()}
    return arrays, meta


def _t(a):
    return flame.tensor(np.ascontiguousarray(a, dtype=np.float32))


def _rel(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def test_kontext_inputs_through_flames_flux_match_diffusers():
    _, meta = _read("kontext_weights.safetensors")
    io_, io_meta = _read("kontext_io.safetensors")
    c = json.loads(meta["config"])
    p = flux_params_from_config(c)
    model = load_flux(os.path.join(HERE, "kontext_weights.safetensors"), dtype=flame.float32, device="cpu", params=p)
    # the joint sequence as FLAME's Kontext builds it equals the fixture's (diffusers' pipeline layout)
    n_tgt = int(io_meta["L_tgt"])
    (th, tw), (rh, rw) = json.loads(io_meta["target_grid"]), json.loads(io_meta["ref_grid"])
    hidden = io_["hidden_states"]
    B = hidden.shape[0]
    joint, ids = with_reference(_t(hidden[:, :n_tgt]), image_ids(16 * th, 16 * tw, B),
                                _t(hidden[:, n_tgt:]), reference_ids(16 * rh, 16 * rw, B))
    np.testing.assert_array_equal(ids.numpy()[0], io_["img_ids"])
    np.testing.assert_array_equal(joint.numpy(), hidden)
    with flame.no_grad():
        out = model(img=joint, img_ids=ids, txt=_t(io_["txt"]), txt_ids=_t(io_["txt_ids"]),
                    timesteps=_t(io_["timestep"]), y=_t(io_["pooled"]), guidance=_t(io_["guidance"])).numpy()
    assert _rel(out, io_["out_f64"]) <= RTOL, _rel(out, io_["out_f64"])
    assert _rel(out, io_["out"]) <= RTOL
    tgt = target_velocity(_t(out), n_tgt).numpy()
    assert _rel(tgt, io_["out_f64"][:, :n_tgt]) <= RTOL
    if io_meta.get("resolutions", "null") != "null":
        assert [tuple(r) for r in json.loads(io_meta["resolutions"])] == list(PREFERRED_KONTEXT_RESOLUTIONS)


def test_chroma_matches_diffusers_without_a_mask():
    _, meta = _read("chroma_weights.safetensors")
    io_, _ = _read("chroma_io.safetensors")
    c = json.loads(meta["config"])
    p = chroma_params_from_config(c)
    model = load_chroma(os.path.join(HERE, "chroma_weights.safetensors"), dtype=flame.float32, device="cpu",
                        params=p)
    with flame.no_grad():
        out = model(_t(io_["hidden_states"]), _t(io_["img_ids"]), _t(io_["encoder_hidden_states"]),
                    _t(io_["txt_ids"]), _t(io_["timestep"])).numpy()
    assert _rel(out, io_["out_f64"]) <= RTOL, _rel(out, io_["out_f64"])
    assert _rel(out, io_["out"]) <= RTOL


def test_params_read_from_a_diffusers_config_are_the_ones_it_was_written_from():
    """flux_params_from_config / chroma_params_from_config invert the config.json save_flux / save_chroma write (the
    released presets, schnell without guidance, the tiny ones with their RoPE axes)."""
    from flame_models.bfl import configs as flux_configs
    from flame_models.bfl.loading import _diffusers_config as flux_config
    from flame_models.chroma import configs as chroma_configs
    from flame_models.chroma.loading import _diffusers_config as chroma_config
    for p in flux_configs.values():
        assert flux_params_from_config(json.loads(json.dumps(flux_config(p)))) == p
    for p in chroma_configs.values():
        assert chroma_params_from_config(json.loads(json.dumps(chroma_config(p)))) == p
