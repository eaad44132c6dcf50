"""Chroma (flame_models/chroma): the released config's size and key layout, the approximator's input, masking of the
padded T5 tokens (the real tokens and the first padding token attended, as lodestone's reference), and loading of
Chroma's, ComfyUI's and diffusers' layouts."""
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.bfl import image_ids, text_ids
from flame_models.checkpoint_io import save_weights
from flame_models.chroma import (
    Chroma,
    ChromaCheckpointError,
    attended_text,
    chroma_params,
    load_chroma,
    read_chroma_params,
    save_chroma,
)
from flame_models.chroma import keys as K
from flame_models.chroma.layers import approximator_input


def test_the_released_config_has_chromas_size_and_keys():
    p = chroma_params("chroma")
    assert p.mod_index_length == 344
    shapes = K.bfl_shapes(p)
    assert len(shapes) == 643                                          # the Chroma1-HD file's tensor count
    assert sum(int(np.prod(s)) for s in shapes.values()) == 8_899_983_424
    with flame_nn.empty_init(device="cpu"):
        model = Chroma(p)
    assert {k: tuple(v.shape) for k, v in model.named_parameters()} == shapes
    plan = K.diffusers_plan(p)
    assert sum(len(d) for d, _, _ in plan.values()) == 1023            # diffusers' tensor count
    assert plan["distilled_guidance_layer.layers.3.in_layer.weight"][0] == (
        "distilled_guidance_layer.layers.3.linear_1.weight",)
    assert plan["distilled_guidance_layer.norms.4.scale"][0] == ("distilled_guidance_layer.norms.4.weight",)
    assert plan["single_blocks.0.linear1.bias"][0][-1] == "single_transformer_blocks.0.proj_mlp.bias"
    assert plan["final_layer.linear.weight"][0] == ("proj_out.weight",)


def test_the_approximator_input_rows():
    t = flame.tensor(np.array([0.0, 0.5], np.float32))
    x = approximator_input(t, 5, 64).numpy()
    assert x.shape == (2, 5, 64)
    assert np.allclose(x[0, :, :8], 1) and np.allclose(x[0, :, 8:16], 0)          # ts(0) = [cos 0, sin 0]
    assert np.allclose(x[:, :, 16:24], 1) and np.allclose(x[:, :, 24:32], 0)      # guidance 0
    assert np.allclose(x[0, :, 32:], x[1, :, 32:]) and not np.allclose(x[0, 1, 32:], x[0, 2, 32:])
    f = np.exp(-np.log(10000) * np.arange(8) / 8)
    assert np.allclose(x[1, 3, :16], np.concatenate([np.cos(500 * f), np.sin(500 * f)]), atol=1e-5)
    g = np.exp(-np.log(10000) * np.arange(16) / 16)
    assert np.allclose(x[1, 3, 32:], np.concatenate([np.cos(3000 * g), np.sin(3000 * g)]), atol=1e-4)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: flame.tensor(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return f(2, 16, 64), f(2, 8, 32), flame.tensor(np.array([0.3, 0.8], np.float32))


def test_padded_text_tokens_are_masked_but_the_first_padding_token():
    mask = flame.tensor(np.array([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.float32))
    assert attended_text(mask).numpy().tolist() == [[True] * 4 + [False] * 4, [True] * 8]
    flame.manual_seed(0)
    model = Chroma("chroma-tiny").eval()
    img, txt, t = _inputs()
    ids, tids = image_ids(64, 64, 2), text_ids(8, 2)
    with flame.no_grad():
        masked = model(img, ids, txt, tids, t, txt_mask=mask).numpy()
        # sample 0 sees its 3 tokens and one padding token: as if the text were those 4 tokens
        trimmed = model(img[:1], ids[:1], txt[:1, :4], tids[:1, :4], t[:1]).numpy()
        np.testing.assert_allclose(masked[:1], trimmed, rtol=1e-5, atol=1e-5)
        # what the masked tokens hold does not matter; sample 1 (no padding) is as unmasked
        other = txt.numpy().copy()
        other[0, 4:] = 100.0
        again = model(img, ids, flame.tensor(other), tids, t, txt_mask=mask).numpy()
        np.testing.assert_array_equal(again[0], masked[0])
        plain = model(img, ids, txt, tids, t).numpy()
        np.testing.assert_allclose(masked[1], plain[1], rtol=1e-5, atol=1e-6)
        assert np.abs(masked[0] - plain[0]).max() > 1e-3
        with pytest.raises(ValueError, match="txt_mask"):
            model(img, ids, txt, tids, t, txt_mask=mask[:, :5])


@pytest.mark.parametrize("layout,prefix", [("bfl", ""), ("bfl", "model.diffusion_model."), ("diffusers", ""),
                                           ("diffusers", "transformer.")])
def test_chroma_files_load_in_every_layout(tmp_path, layout, prefix):
    flame.manual_seed(1)
    model = Chroma("chroma-tiny").eval()
    img, txt, t = _inputs(1)
    ids, tids = image_ids(64, 64, 2), text_ids(8, 2)
    with flame.no_grad():
        want = model(img, ids, txt, tids, t).numpy()
    state = {k: v.detach() for k, v in model.named_parameters()}
    if layout == "diffusers":
        state = K.to_diffusers(state, model.params)
    path = str(tmp_path / "chroma.safetensors")
    extra = {"vae.decoder.conv_in.weight": flame.zeros(4, 16, 3, 3)} if prefix else {}   # a full checkpoint's
    save_weights([(prefix + k, v) for k, v in {**state}.items()] + list(extra.items()), path, stem="chroma")
    assert read_chroma_params(path) == model.params                   # from the shapes (no FLAME metadata)
    loaded = load_chroma(path, dtype=flame.float32, device=img.device)  # the test device (cuda under FLAME_DEVICE)
    with flame.no_grad():
        np.testing.assert_array_equal(loaded(img, ids, txt, tids, t).numpy(), want)


def test_save_chroma_writes_a_diffusers_folder_and_a_chroma_file(tmp_path):
    flame.manual_seed(2)
    model = Chroma("chroma-tiny")
    save_chroma(model, tmp_path / "folder", layout="diffusers")
    save_chroma(model, str(tmp_path / "c.safetensors"))
    assert sorted(os.listdir(tmp_path / "folder")) == ["config.json", "diffusion_pytorch_model.safetensors"]
    for path in (tmp_path / "folder", tmp_path / "c.safetensors"):
        again = load_chroma(path)
        for (k, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
            assert np.array_equal(a.detach().numpy(), b.detach().numpy()), k


def test_a_flux_file_is_not_a_chroma_file(tmp_path):
    from flame_models.bfl import Flux, save_flux
    save_flux(Flux("flux-tiny"), str(tmp_path / "flux.safetensors"))
    with pytest.raises(ChromaCheckpointError, match="not a Chroma transformer checkpoint"):
        load_chroma(str(tmp_path / "flux.safetensors"))
