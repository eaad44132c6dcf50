"""Qwen-Image's transformer (flame_models/qwen_image) on the CPU: the released config's size and key names, the RoPE
positions as diffusers places them, the whole forward against an independent float64 NumPy reference written from
the architecture facts (../shared/specs/qwen_image.md), the text-padding mask (equal to trimming the text), input
checks, and loading / saving of diffusers folders (sharded) and ComfyUI files. The parity against diffusers 0.42.1
itself is tests/models/test_qwen_image_parity.py."""
import json
import math
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_core.device import default_device
from flame_models.qwen_image import (
    QwenImageCheckpointError,
    QwenImageParams,
    QwenImageTransformer2DModel,
    load_qwen_image,
    position_ids,
    qwen_image_params,
    read_qwen_image_params,
    save_qwen_image,
)
from flame_models.qwen_image import keys as K

TINY = QwenImageParams(num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=24,
                       axes_dims_rope=(4, 6, 6))
GRID = (5, 4)


def test_the_released_config_has_qwen_images_size_and_keys():
    p = qwen_image_params("qwen-image")
    shapes = K.qwen_image_shapes(p)
    assert len(shapes) == 1933
    assert sum(int(np.prod(s)) for s in shapes.values()) == 20_430_401_088
    block = {k: s for k, s in shapes.items() if k.startswith("transformer_blocks.0.")}
    assert sum(int(np.prod(s)) for s in block.values()) == 339_831_296
    assert shapes["transformer_blocks.7.img_mod.1.weight"] == (18432, 3072)
    assert shapes["transformer_blocks.0.img_mlp.net.0.proj.weight"] == (12288, 3072)
    assert shapes["norm_out.linear.weight"] == (6144, 3072) and shapes["proj_out.weight"] == (64, 3072)
    with flame_nn.empty_init(device="cpu"):
        model = QwenImageTransformer2DModel(p)
    assert {k: tuple(v.shape) for k, v in model.named_parameters()} == shapes


def test_positions_centre_the_image_and_start_the_text_after_it():
    ids = position_ids([(1, 5, 4)], 3).numpy()
    s = max(5 // 2, 4 // 2)
    assert ids[:3].tolist() == [[s + j] * 3 for j in range(3)]
    img = ids[3:].reshape(5, 4, 3)
    assert (img[..., 0] == 0).all()
    assert img[:, 0, 1].tolist() == [-3, -2, -1, 0, 1]            # r - ceil(5/2): odd heights reach one lower
    assert img[0, :, 2].tolist() == [-2, -1, 0, 1]               # c - ceil(4/2)
    big = position_ids([(1, 64, 83)], 1).numpy()
    assert big[0].tolist() == [41, 41, 41]                       # s = max(32, 41)
    assert big[1:, 1].min() == -32 and big[1:, 1].max() == 31
    assert big[1:, 2].min() == -42 and big[1:, 2].max() == 40
    two = position_ids([(1, 2, 2), (1, 2, 2)], 0).numpy()        # a second image (Edit) gets frame index 1
    assert two[:4, 0].tolist() == [0] * 4 and two[4:, 0].tolist() == [1] * 4


# ----------------------------------------------------------------------------- an independent NumPy reference
def _ln0(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6)


def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _rope_table(p, grid, n_txt):
    """Complex rotations (L, head_dim/2) of [text, image] as diffusers builds them: per axis angle pos * theta^(-2j/d)
    for centred image rows / cols and text positions s + j."""
    h, w = grid
    def omega(d):
        return 1.0 / p.theta ** (np.arange(0, d, 2) / d)
    s = max(h // 2, w // 2)
    pos = [(s + j, s + j, s + j) for j in range(n_txt)]
    pos += [(0, r - (h - h // 2), c - (w - w // 2)) for r in range(h) for c in range(w)]
    pos = np.array(pos, np.float64)
    ang = np.concatenate([pos[:, a:a + 1] * omega(d)[None] for a, d in enumerate(p.axes_dims_rope)], axis=1)
    return np.exp(1j * ang)


def _rope(x, table):                                             # x (B, L, heads, D): pairs (2j, 2j+1) as complex
    c = x[..., 0::2] + 1j * x[..., 1::2]
    c = c * table[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = c.real, c.imag
    return out


def reference_forward(sd, p, hidden, txt, mask, sigma, grid):
    """The Qwen-Image transformer in float64 NumPy from the spec; sd: {diffusers key: array}."""
    def lin(name, x):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]
    B, n_img, _ = hidden.shape
    n_txt = txt.shape[1]
    H, hd = p.num_attention_heads, p.attention_head_dim
    f = np.exp(-math.log(10000) * np.arange(128) / 128)
    arg = 1000 * sigma[:, None] * f[None]
    emb = np.concatenate([np.cos(arg), np.sin(arg)], axis=1)
    temb = lin("time_text_embed.timestep_embedder.linear_2", _silu(lin("time_text_embed.timestep_embedder.linear_1",
                                                                        emb)))
    img = lin("img_in", hidden)
    tx = lin("txt_in", _rms(txt, sd["txt_norm.weight"]))
    table = _rope_table(p, grid, n_txt)
    keep = np.concatenate([mask.astype(bool), np.ones((B, n_img), bool)], axis=1)        # (B, S)
    for i in range(p.num_layers):
        b = f"transformer_blocks.{i}"
        im = lin(f"{b}.img_mod.1", _silu(temb))[:, None]
        tm = lin(f"{b}.txt_mod.1", _silu(temb))[:, None]
        D = p.hidden_size
        ish1, isc1, ig1, ish2, isc2, ig2 = (im[..., k * D:(k + 1) * D] for k in range(6))
        tsh1, tsc1, tg1, tsh2, tsc2, tg2 = (tm[..., k * D:(k + 1) * D] for k in range(6))
        a_i = _ln0(img) * (1 + isc1) + ish1
        a_t = _ln0(tx) * (1 + tsc1) + tsh1

        def heads(x):
            return x.reshape(B, x.shape[1], H, hd)
        q = np.concatenate([_rms(heads(lin(f"{b}.attn.add_q_proj", a_t)), sd[f"{b}.attn.norm_added_q.weight"]),
                            _rms(heads(lin(f"{b}.attn.to_q", a_i)), sd[f"{b}.attn.norm_q.weight"])], axis=1)
        k = np.concatenate([_rms(heads(lin(f"{b}.attn.add_k_proj", a_t)), sd[f"{b}.attn.norm_added_k.weight"]),
                            _rms(heads(lin(f"{b}.attn.to_k", a_i)), sd[f"{b}.attn.norm_k.weight"])], axis=1)
        v = np.concatenate([heads(lin(f"{b}.attn.add_v_proj", a_t)), heads(lin(f"{b}.attn.to_v", a_i))], axis=1)
        q, k = _rope(q, table), _rope(k, table)
        logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        logits = np.where(keep[:, None, None, :], logits, -np.inf)
        att = np.exp(logits - logits.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, -1, H * hd)
        img = img + ig1 * lin(f"{b}.attn.to_out.0", o[:, n_txt:])
        tx = tx + tg1 * lin(f"{b}.attn.to_add_out", o[:, :n_txt])
        img = img + ig2 * lin(f"{b}.img_mlp.net.2", _gelu(lin(f"{b}.img_mlp.net.0.proj",
                                                              _ln0(img) * (1 + isc2) + ish2)))
        tx = tx + tg2 * lin(f"{b}.txt_mlp.net.2", _gelu(lin(f"{b}.txt_mlp.net.0.proj", _ln0(tx) * (1 + tsc2) + tsh2)))
    mod = lin("norm_out.linear", _silu(temb))[:, None]
    scale, shift = mod[..., :p.hidden_size], mod[..., p.hidden_size:]
    return lin("proj_out", _ln0(img) * (1 + scale) + shift)


def _model(seed=0, p=TINY):
    flame.manual_seed(seed)
    model = QwenImageTransformer2DModel(p, dtype=flame.float32, device=default_device())   # the test device
    rng = np.random.default_rng(seed + 100)
    with flame.no_grad():
        for _, t in model.named_parameters():          # non-trivial gains and biases: a swapped tensor shows
            if t.ndim == 1:
                t.copy_(flame.tensor((t.detach().numpy() + 0.1 * rng.normal(size=t.shape)).astype(np.float32)))
    return model


def _inputs(p=TINY, seed=1, valid=(7, 4)):
    rng = np.random.default_rng(seed)
    n_img = GRID[0] * GRID[1]
    hidden = rng.normal(size=(2, n_img, p.in_channels)).astype(np.float32)
    txt = rng.normal(size=(2, max(valid), p.joint_attention_dim)).astype(np.float32)
    mask = np.zeros((2, max(valid)), np.float32)
    for b, n in enumerate(valid):
        mask[b, :n] = 1
    return hidden, txt, mask, np.array([0.6, 0.25], np.float32)


def _run(model, hidden, txt, mask, sigma, grid=GRID):
    t = flame.tensor
    with flame.no_grad():
        return model(t(hidden), t(txt), None if mask is None else t(mask), t(sigma),
                     [[(1, *grid)]] * hidden.shape[0]).numpy()


def _state64(model):
    return {k: v.detach().numpy().astype(np.float64) for k, v in model.named_parameters()}


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_forward_matches_the_numpy_reference_with_and_without_the_mask():
    model = _model()
    hidden, txt, mask, sigma = _inputs()
    sd = _state64(model)
    ref = reference_forward(sd, TINY, hidden.astype(np.float64), txt.astype(np.float64), mask, sigma.astype(np.float64),
                            GRID)
    assert _rel(_run(model, hidden, txt, mask, sigma), ref) <= 1e-4
    ones = np.ones_like(mask)
    ref = reference_forward(sd, TINY, hidden.astype(np.float64), txt.astype(np.float64), ones,
                            sigma.astype(np.float64), GRID)
    out = _run(model, hidden, txt, None, sigma)
    assert _rel(out, ref) <= 1e-4
    # an all-valid mask is no mask (to float32 rounding: on cuda float32 attention without a mask runs the dense
    # path, with one the chunked reference)
    np.testing.assert_allclose(out, _run(model, hidden, txt, ones, sigma), rtol=1e-5, atol=1e-6)


def test_the_mask_equals_trimming_the_padded_text():
    model = _model()
    hidden, txt, mask, sigma = _inputs()
    out = _run(model, hidden, txt, mask, sigma)
    alone = _run(model, hidden[1:], txt[1:, :4], None, sigma[1:])
    assert np.abs(out[1:] - alone).max() <= 1e-5 * np.abs(alone).max()
    padded = _run(model, hidden, txt, np.ones_like(mask), sigma)
    assert not np.allclose(padded[1], out[1], atol=1e-3)                 # the padded tokens do matter unmasked


def test_a_batch_of_one_modulates_as_a_batch_of_two():
    model = _model()
    hidden, txt, mask, sigma = _inputs()
    both = _run(model, hidden, txt, mask, sigma)
    first = _run(model, hidden[:1], txt[:1], mask[:1], sigma[:1])
    assert np.abs(both[:1] - first).max() <= 1e-5 * np.abs(first).max()


def test_gradients_flow_and_checkpointing_gives_the_same_ones():
    hidden, txt, mask, sigma = _inputs()
    grads = []
    for ckpt in (False, True):
        model = _model()
        model.enable_gradient_checkpointing(ckpt)
        h = flame.tensor(hidden, requires_grad=True)
        out = model(h, flame.tensor(txt), flame.tensor(mask), flame.tensor(sigma), [[(1, *GRID)]] * 2)
        (out * out).mean().backward()
        w = model.transformer_blocks[0].attn.add_k_proj.weight.grad
        grads.append((h.grad.numpy(), w.numpy()))
    assert np.abs(grads[0][0]).max() > 0 and np.abs(grads[0][1]).max() > 0
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("change, message", [
    (dict(img_shapes=[[(1, 4, 4)]] * 2), "make 16 image tokens"),
    (dict(img_shapes=[[(1, 5, 4)], [(1, 4, 5)]]), "differ between samples"),
    (dict(img_shapes=None), "img_shapes is required"),
    (dict(encoder_hidden_states_mask="short"), "does not fit"),
    (dict(timestep=None), "timestep is required"),
    (dict(hidden_states="wide"), "hidden_states must be"),
])
def test_bad_inputs_are_named(change, message):
    model = _model()
    hidden, txt, mask, sigma = _inputs()
    kw = dict(hidden_states=flame.tensor(hidden), encoder_hidden_states=flame.tensor(txt),
              encoder_hidden_states_mask=flame.tensor(mask), timestep=flame.tensor(sigma),
              img_shapes=[[(1, *GRID)]] * 2)
    for k, v in change.items():
        kw[k] = {"short": flame.tensor(mask[:, :3]), "wide": flame.tensor(np.zeros((2, 20, 8), np.float32))}.get(v, v) \
            if isinstance(v, str) else v
    with pytest.raises(ValueError, match=message):
        model(**kw)


# ----------------------------------------------------------------------------- files
def test_a_diffusers_folder_sharded_round_trips(tmp_path):
    model = _model()
    folder = tmp_path / "pipe" / "transformer"
    files = save_qwen_image(model, str(folder), max_shard_size=64 << 10)
    assert len(files) > 2 and files[-1].endswith(".safetensors.index.json")
    config = json.loads((folder / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel" and config["axes_dims_rope"] == [4, 6, 6]
    hidden, txt, mask, sigma = _inputs()
    want = _run(model, hidden, txt, mask, sigma)
    for where in (folder, tmp_path / "pipe", folder / "diffusion_pytorch_model.safetensors.index.json"):
        loaded = load_qwen_image(str(where), dtype=flame.float32, device=default_device())
        assert loaded.params == TINY
        assert np.array_equal(_run(loaded, hidden, txt, mask, sigma), want)
    assert read_qwen_image_params(str(folder)) == TINY


def _plain_state(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def test_a_comfyui_file_and_a_config_free_file_load(tmp_path):
    model = _model(p=qwen_image_params("qwen-image-tiny"))
    hidden, txt, mask, _ = _inputs(p=model.params)
    sigma = np.array([0.9, 0.1], np.float32)
    want = _run(model, hidden, txt, mask, sigma)
    state = _plain_state(model)
    for prefix in ("model.diffusion_model.", "diffusion_model.", ""):
        path = str(tmp_path / f"comfy{len(prefix)}.safetensors")
        extra = {"vae.decoder.conv_in.weight": flame.zeros(2, 2)} if prefix else {}
        io.save_file({**{prefix + k: v for k, v in state.items()}, **extra}, path)   # no metadata, no config.json
        loaded = load_qwen_image(path, device=default_device())
        assert loaded.params == model.params and loaded.img_in.weight.dtype == flame.float32
        assert np.array_equal(_run(loaded, hidden, txt, mask, sigma), want)


def test_bad_files_are_refused_with_their_keys(tmp_path):
    model = _model()
    state = _plain_state(model)
    path = str(tmp_path / "missing.safetensors")
    io.save_file({k: v for k, v in state.items() if "transformer_blocks.1.attn.to_k" not in k}, path)
    with pytest.raises(QwenImageCheckpointError, match=r"missing keys \(2\): transformer_blocks\.1\.attn\.to_k"):
        load_qwen_image(path, device="cpu", params=TINY)
    other = str(tmp_path / "other.safetensors")
    io.save_file({"encoder.conv_in.weight": flame.zeros(2, 2)}, other)
    with pytest.raises(QwenImageCheckpointError, match="not a Qwen-Image transformer.*VAE"):
        load_qwen_image(other, device="cpu")
    folder = tmp_path / "edit"
    save_qwen_image(model, str(folder))
    config = json.loads((folder / "config.json").read_text())
    with open(folder / "config.json", "w") as f:
        json.dump({**config, "zero_cond_t": True}, f)
    os.remove(folder / "diffusion_pytorch_model.safetensors")
    io.save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))           # without FLAME's metadata
    with pytest.raises(QwenImageCheckpointError, match="zero_cond_t=true"):
        load_qwen_image(str(folder), device="cpu")


# ----------------------------------------------------------------------------- recognised by the registry
def test_files_are_recognised_and_generate_names_the_missing_parts(tmp_path, capsys):
    from flame_models import registry
    from flame_models.checkpoint_io import describe_keys
    from flame_models.generate import main
    model = _model(p=qwen_image_params("qwen-image-tiny"))       # a preset's head dim: its RoPE axes are known
    root = tmp_path / "Qwen-Image"
    save_qwen_image(model, str(root / "transformer"))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    comfy = str(tmp_path / "qwen_image_bf16.safetensors")
    io.save_file({"model.diffusion_model." + k: v.detach() for k, v in model.named_parameters()}, comfy)
    assert registry.detect_family(str(root))[0] == "qwen_image"
    assert registry.detect_family(comfy) == ("qwen_image", "a Qwen-Image transformer (keys such as "
                                                           "model.diffusion_model.txt_norm.weight)")
    assert describe_keys(["diffusion_model.transformer_blocks.3.img_mod.1.weight"])[0] == "qwen_image"
    assert main(["--model", str(root), "--prompt", "a cat", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "vae: missing" in err and "text_encoder: missing" in err \
        and "tokenizer: missing" in err
    assert main(["--model", comfy, "--prompt", "a cat", "--guidance", "4", "--device", "cpu"]) == 2
    assert "--guidance: " in capsys.readouterr().err
    odd = str(tmp_path / "odd.safetensors")                           # head dim 16: no preset, no config
    io.save_file({k: v.detach() for k, v in _model().named_parameters()}, odd)
    assert main(["--model", odd, "--prompt", "a cat", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"transformer (--model): {odd}: head dim 16 is not Qwen-Image's 128" in err
    assert f"{odd}: {odd}" not in err                                   # the file named once per line
