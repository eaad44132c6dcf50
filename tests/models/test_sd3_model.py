"""The SD3 MMDiT / MMDiT-X against diffusers' SD3Transformer2DModel (golden fixtures, both variants, both checkpoint
layouts), checkpoint names and sizes, gradients and gradient checkpointing."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sd3_helpers import VARIANTS, diffusers_dir, inputs, io, npy, params, rel_err, sai_file

import flame_core as flame
import flame_nn
from flame_models.sd3 import MMDiT, load_sd3, sd3_params
from flame_models.sd3 import keys as K
from flame_models.sd3 import ops as O


def load(variant, layout, dtype, device):
    if layout == "diffusers":
        return load_sd3(diffusers_dir(variant), dtype=dtype, device=device)
    # the plain SAI file has no QK-norm weights, and its head dim (8) is not SAI's 64: it must be given
    return load_sd3(sai_file(variant), dtype=dtype, device=device,
                    params=params(variant) if variant == "plain" else None)


# ----------------------------------------------------------------------------- names and sizes
def test_parameter_names_and_shapes_are_sai_checkpoint_keys():
    model = MMDiT("sd3.5-tiny", dtype=flame.float32)
    state = model.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == K.sai_shapes("sd3.5-tiny")
    names = list(state)
    for k in ("joint_blocks.0.x_block.attn2.qkv.weight", "joint_blocks.0.x_block.attn2.ln_k.weight",
              "joint_blocks.2.context_block.attn.qkv.bias", "final_layer.adaLN_modulation.1.weight"):
        assert k in names
    assert not any(k.startswith(("joint_blocks.2.context_block.mlp", "joint_blocks.2.context_block.attn.proj",
                                 "joint_blocks.1.x_block.attn2")) for k in names)
    assert state["joint_blocks.2.context_block.adaLN_modulation.1.weight"].shape == (2 * 64, 64)
    assert state["joint_blocks.0.x_block.adaLN_modulation.1.weight"].shape == (9 * 64, 64)


@pytest.mark.parametrize("preset,count", [("sd3.5-large", 8_146_280_768), ("sd3.5-medium", 2_469_663_936)])
def test_released_sizes_build_without_allocating(preset, count):
    with flame_nn.empty_init(dtype=flame.bfloat16):
        model = MMDiT(preset)
    params_ = list(model.named_parameters())
    assert all(p.is_meta and p.dtype == flame.bfloat16 for _, p in params_)
    assert model.pos_embed.dtype == flame.bfloat16 and model.pos_embed.is_meta  # a placeholder
    assert sum(p.numel() for _, p in params_) + model.pos_embed.numel() == count
    p = sd3_params(preset)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == K.sai_shapes(p)
    assert p.head_dim == 64 and p.hidden_size == 64 * p.depth


# ----------------------------------------------------------------------------- against diffusers
@pytest.mark.parametrize("layout", ["diffusers", "sai"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_forward_matches_diffusers(variant, layout, device):
    arrays = io(variant)
    model = load(variant, layout, flame.float64, device)
    with flame.no_grad():
        out = model(*inputs(arrays, flame.float64, device))
    ref = arrays["out_f64"]
    assert out.shape == ref.shape == (2, 16, 6, 10) and out.dtype == flame.float64
    assert np.abs(ref).mean() > 0.1
    np.testing.assert_allclose(npy(out), ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_forward_matches_diffusers(variant, device):
    arrays = io(variant)
    model = load(variant, "diffusers", flame.float32, device)
    with flame.no_grad():
        out = npy(model(*inputs(arrays, flame.float32, device)))
        one = npy(model(*inputs({k: v[:1] for k, v in arrays.items()}, flame.float32, device)))
        skipped = npy(model(*inputs(arrays, flame.float32, device), skip_layers=[0]))
    tol = 2e-5 * np.abs(arrays["out_f32"]).max()
    np.testing.assert_allclose(out, arrays["out_f32"], rtol=0, atol=tol)
    # one sample: the modulation runs inside the fused LayerNorm
    np.testing.assert_allclose(one, arrays["out_one_f32"], rtol=0, atol=tol)
    # skip-layer guidance's pass: joint block 0 left out
    np.testing.assert_allclose(skipped, arrays["out_skip0_f32"], rtol=0, atol=tol)
    assert rel_err(skipped, arrays["out_f32"]) > 0.05


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_forward_stays_close_to_diffusers(variant, device):
    arrays = io(variant)
    model = load(variant, "sai", flame.bfloat16, device)
    assert all(p.dtype == flame.bfloat16 for p in model.parameters()) and model.pos_embed.dtype == flame.bfloat16
    x, _, y, ctx = inputs(arrays, flame.bfloat16, device)
    t = flame.tensor(arrays["t"], device=device)                     # timesteps stay float32, as in the references
    with flame.no_grad():
        out = model(x, t, y, ctx)
    assert out.dtype == flame.bfloat16
    err = rel_err(npy(out), arrays["out_f64"])
    assert err < 2e-2, f"relative error {err:.2e} in bfloat16"


def test_fresh_position_table_is_diffusers_and_crop_is_centred(device):
    loaded = load("dual", "diffusers", flame.float32, device)
    fresh = MMDiT(params("dual"), dtype=flame.float32, device=device)
    np.testing.assert_allclose(npy(fresh.pos_embed), npy(loaded.pos_embed), rtol=0, atol=2e-6)
    # the crop of a 3 x 5 patch grid out of 8 x 8: rows 2..4, cols 1..5
    side, H = 8, 4
    table = flame.tensor(np.arange(side * side * H, dtype=np.float32).reshape(1, side * side, H), device=device)
    crop = npy(O.crop_pos_embed(table, side, 3, 5)).reshape(3, 5, H)
    rows, cols = np.meshgrid(np.arange(2, 5), np.arange(1, 6), indexing="ij")
    np.testing.assert_array_equal(crop[..., 0], (rows * side + cols) * H)
    with pytest.raises(ValueError, match="exceeds the position table"):
        O.crop_pos_embed(table, side, 9, 2)


def test_patchify_is_the_convolution_and_unpatchify_is_ph_pw_c(device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 6))
    w = rng.standard_normal((5, 3, 2, 2))
    patches = npy(O.patchify(flame.tensor(x, device=device), 2))                 # (2, 6, 12)
    conv = np.einsum("bchpwq,ocpq->bhwo", x.reshape(2, 3, 2, 2, 3, 2), w).reshape(2, 6, 5)
    np.testing.assert_allclose(patches @ w.reshape(5, -1).T, conv, rtol=1e-12)
    tokens = rng.standard_normal((2, 6, 2 * 2 * 3))                             # features (ph, pw, c)
    img = npy(O.unpatchify(flame.tensor(tokens, device=device), 4, 6, 2, 3))
    t = tokens.reshape(2, 2, 3, 2, 2, 3)                                        # (b, h, w, ph, pw, c)
    assert img[1, 2, 2 * 1 + 1, 2 * 2 + 0] == t[1, 1, 2, 1, 0, 2]


@given(b=st.integers(1, 2), c=st.integers(1, 3), h=st.integers(1, 3), w=st.integers(1, 3), p=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16))
def test_ops_of_the_patch_path_are_the_reference_and_differentiate(b, c, h, w, p, seed):
    """patchify = Conv2d(kernel p, stride p) as a GEMM, unpatchify = SAI's einsum, the crop = a window of the table;
    their float64 gradients against central differences."""
    from flame_core.autograd import gradcheck
    rng = np.random.default_rng(seed)
    x = flame.tensor(rng.standard_normal((b, c, h * p, w * p)), dtype=flame.float64, requires_grad=True)
    wt = rng.standard_normal((3, c, p, p))
    conv = flame_nn.functional.conv2d(x.detach(), flame.tensor(wt, dtype=flame.float64), stride=p)
    np.testing.assert_allclose(npy(O.patchify(x, p)) @ wt.reshape(3, -1).T,
                               npy(conv).reshape(b, 3, h * w).transpose(0, 2, 1), rtol=1e-10, atol=1e-12)
    tokens = flame.tensor(rng.standard_normal((b, h * w, p * p * c)), dtype=flame.float64, requires_grad=True)
    ref = np.einsum("nhwpqc->nchpwq", npy(tokens).reshape(b, h, w, p, p, c)).reshape(b, c, h * p, w * p)
    np.testing.assert_array_equal(npy(O.unpatchify(tokens, h * p, w * p, p, c)), ref)
    side = max(h, w) + 1
    table = flame.tensor(rng.standard_normal((1, side * side, 4)), dtype=flame.float64, requires_grad=True)
    assert gradcheck(lambda a: O.patchify(a, p), (x,))
    assert gradcheck(lambda a: O.unpatchify(a, h * p, w * p, p, c), (tokens,))
    assert gradcheck(lambda a: O.crop_pos_embed(a, side, h, w), (table,))


@given(lq=st.integers(1, 5), heads=st.integers(1, 3), d=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16))
def test_attention_of_the_head_layout_differentiates(lq, heads, d, seed):
    """attention(q, k, v) on (B, L, heads, D): softmax(q k^T / sqrt(D)) v per head, float64 gradients."""
    from flame_core.autograd import gradcheck
    rng = np.random.default_rng(seed)
    q, k, v = (flame.tensor(rng.standard_normal((2, lq, heads, d)), dtype=flame.float64, requires_grad=True)
               for _ in range(3))
    qn, kn, vn = (npy(t).transpose(0, 2, 1, 3) for t in (q, k, v))
    s = qn @ kn.swapaxes(-1, -2) / np.sqrt(d)
    a = np.exp(s - s.max(-1, keepdims=True))
    ref = ((a / a.sum(-1, keepdims=True)) @ vn).transpose(0, 2, 1, 3).reshape(2, lq, heads * d)
    np.testing.assert_allclose(npy(O.attention(q, k, v)), ref, rtol=1e-10, atol=1e-12)
    assert gradcheck(O.attention, (q, k, v))


# ----------------------------------------------------------------------------- gradients
def tiny(dtype, device, seed=0):
    """The sd3.5-tiny preset (dual block 0, plain block 1, pre-only block 2) with random weights, and inputs."""
    rng = np.random.default_rng(seed)
    p = sd3_params("sd3.5-tiny")
    with flame_nn.empty_init(dtype=dtype, device=device):
        model = MMDiT(p)
    model.load_state_dict({k: (1 + 0.3 * rng.standard_normal(s)) if ".ln_" in k else 0.15 * rng.standard_normal(s)
                           for k, s in K.sai_shapes(p).items()})
    arrays = dict(x=rng.standard_normal((2, 16, 4, 6)), t=np.array([800.0, 120.0]),
                  y=rng.standard_normal((2, p.pooled_in_dim)), context=rng.standard_normal((2, 5, p.context_in_dim)))
    return model, inputs(arrays, dtype, device)


def test_every_parameter_gets_a_gradient(device):
    model, args = tiny(flame.float32, device)
    out = model(*args)
    (out * out).mean().backward()
    dead = "joint_blocks.2.context_block.attn.ln_q.weight"  # the pre-only block's context queries are discarded
    for name, p in model.named_parameters():
        g = p.grad
        assert g is not None and g.shape == p.shape, name
        assert np.isfinite(npy(g)).all() and (np.abs(npy(g)).max() > 0) == (name != dead), name
    q_rows = npy(model.joint_blocks[2].context_block.attn.qkv.weight.grad)[:64]
    assert not q_rows.any()


def test_finite_differences_of_selected_parameters_in_float64(device):
    model, args = tiny(flame.float64, device)
    w = flame.tensor(np.random.default_rng(5).standard_normal((2, 16, 4, 6)), dtype=flame.float64, device=device)

    def loss():
        return (model(*args) * w).sum()

    loss().backward()
    named = dict(model.named_parameters())
    picks = ["x_embedder.proj.weight", "t_embedder.mlp.0.bias", "y_embedder.mlp.2.weight", "context_embedder.weight",
             "joint_blocks.0.x_block.attn2.ln_q.weight", "joint_blocks.0.x_block.attn2.qkv.weight",
             "joint_blocks.0.x_block.adaLN_modulation.1.weight", "joint_blocks.1.context_block.mlp.fc1.bias",
             "joint_blocks.2.context_block.attn.ln_k.weight", "joint_blocks.2.context_block.adaLN_modulation.1.bias",
             "final_layer.adaLN_modulation.1.weight"]
    rng = np.random.default_rng(6)
    eps = 1e-6
    for name in picks:
        p = named[name]
        analytic = npy(p.grad)
        for _ in range(2):
            idx = tuple(int(rng.integers(0, s)) for s in p.shape)
            orig = float(npy(p)[idx])
            with flame.no_grad():
                p[idx] = orig + eps
                plus = loss().item()
                p[idx] = orig - eps
                minus = loss().item()
                p[idx] = orig
            numeric = (plus - minus) / (2 * eps)
            assert abs(numeric - analytic[idx]) <= 1e-6 + 1e-5 * abs(numeric), (name, idx, numeric, analytic[idx])


def test_gradient_checkpointing_gives_the_same_gradients(device):
    grads, calls = [], []
    for ckpt in (False, True):
        model, args = tiny(flame.float64, device)
        model.enable_gradient_checkpointing(ckpt)
        n = [0]
        model.joint_blocks[0].register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        out = model(*args)
        (out * out).sum().backward()
        grads.append({k: npy(p.grad) for k, p in model.named_parameters()})
        calls.append(n[0])
    assert calls == [1, 2]  # a checkpointed block runs again in backward
    for k in grads[0]:
        np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-12, atol=1e-12, err_msg=k)


def test_a_model_keeps_its_blocks_attention_with_the_same_gradients(monkeypatch):
    """SD3.5's tiny preset (dual-attention, plain and pre-only joint blocks): enable_gradient_checkpointing(save=
    ("attention",)) sets every block's switch; gradients equal full checkpointing; the backward runs no attention
    forward."""
    from flame_core.kernels import attention as K
    calls = [0]
    real = K.flash_attention_forward
    monkeypatch.setattr(K, "flash_attention_forward",
                        lambda *a, **kw: calls.__setitem__(0, calls[0] + 1) or real(*a, **kw))
    grads, counts = [], []
    for save in ((), ("attention",)):
        model, args = tiny(flame.float64, "cpu")
        model.enable_gradient_checkpointing(True, save=save)
        assert all(b.checkpoint_save == save for b in model.joint_blocks)
        out = model(*args)
        first = calls[0]
        (out * out).sum().backward()
        counts.append(calls[0] - first)
        grads.append({k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None})
    assert counts[0] > 0 and counts[1] == 0
    for k in grads[0]:
        np.testing.assert_array_equal(grads[1][k], grads[0][k], err_msg=k)
    model.disable_gradient_checkpointing()
    assert all(b.checkpoint_save == () for b in model.joint_blocks)


def test_model_level_checkpointing_switch():
    with flame_nn.empty_init(dtype=flame.float32):
        model = MMDiT("sd3.5-tiny")
    assert not model.gradient_checkpointing
    model.gradient_checkpointing = True
    assert model.gradient_checkpointing and all(b.gradient_checkpointing for b in model.joint_blocks)
    model.disable_gradient_checkpointing()
    assert not any(b.gradient_checkpointing for b in model.joint_blocks)


def test_bad_inputs_are_named(device):
    model, (x, t, y, ctx) = tiny(flame.float32, device)
    with pytest.raises(ValueError, match=r"latents \(B, 16, H, W\)"):
        model(x[:, :8], t, y, ctx)
    with pytest.raises(ValueError, match="multiples of 2"):
        model(x[..., :5], t, y, ctx)
    with pytest.raises(ValueError, match="context"):
        model(x, t, y, ctx[..., :7])
    with pytest.raises(ValueError, match="pooled|y "):
        model(x, t, y[:1], ctx)
    big = flame.zeros(1, 16, 34, 2, device=device)
    with pytest.raises(ValueError, match="position table"):
        model(big, t[:1], y[:1], ctx[:1])
