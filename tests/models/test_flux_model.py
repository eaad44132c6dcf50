"""Flux model on the tiny config: names, shapes, an independent float64 NumPy reference, gradients, checkpointing."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.flux import Flux, flux_params
from flame_models.flux import keys as K
from flame_models.flux import sampling as S

TINY = flux_params("flux-tiny")


# ----------------------------------------------------------------------------- independent float64 reference
def reference_forward(sd, p, img, img_ids, txt, txt_ids, t, y, guidance):
    """Flux forward in NumPy float64 from a BFL state dict, written from the facts in docs/ARCHITECTURES.md."""
    H, heads = p.hidden_size, p.num_heads
    D = H // heads

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    def silu(x):
        return x / (1 + np.exp(-x))

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def ln(x):
        m = x.mean(-1, keepdims=True)
        return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6)

    def rms(x, s):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * s

    def temb(t):
        f = np.exp(-np.log(10000) * np.arange(128) / 128)
        a = (1000 * t)[:, None] * f[None]
        return np.concatenate([np.cos(a), np.sin(a)], -1)

    def emb(x, name):
        return lin(silu(lin(x, name + ".in_layer")), name + ".out_layer")

    ids = np.concatenate([txt_ids, img_ids], 1)                   # (B, L, 3)
    ang = np.concatenate([ids[..., a, None] * p.theta ** (-np.arange(0, d, 2) / d)
                          for a, d in enumerate(p.axes_dim)], -1)[:, None]  # (B, 1, L, D/2)

    def rope(x):                                                  # (B, heads, L, D), adjacent pairs
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = np.cos(ang) * x0 - np.sin(ang) * x1
        out[..., 1::2] = np.sin(ang) * x0 + np.cos(ang) * x1
        return out

    def heads_of(qkv, qs, ks):                                    # (B, L, 3H) -> 3 x (B, heads, L, D)
        B, L, _ = qkv.shape
        q, k, v = qkv.reshape(B, L, 3, heads, D).transpose(2, 0, 3, 1, 4)
        return rms(q, sd[qs]), rms(k, sd[ks]), v

    def attend(q, k, v):
        s = rope(q) @ rope(k).swapaxes(-1, -2) / np.sqrt(D)
        w = np.exp(s - s.max(-1, keepdims=True))
        o = (w / w.sum(-1, keepdims=True)) @ v                    # (B, heads, L, D)
        return o.transpose(0, 2, 1, 3).reshape(o.shape[0], o.shape[2], H)

    def chunks(v, name, n):
        return np.split(lin(silu(v), name)[:, None], n, axis=-1)

    vec = emb(temb(t), "time_in") + emb(y, "vector_in")
    if p.guidance_embed:
        vec = vec + emb(temb(guidance), "guidance_in")
    x, c = lin(img, "img_in"), lin(txt, "txt_in")
    Lt = c.shape[1]
    for i in range(p.depth):
        b = f"double_blocks.{i}."
        im = chunks(vec, b + "img_mod.lin", 6)
        tm = chunks(vec, b + "txt_mod.lin", 6)
        qi, ki, vi = heads_of(lin(ln(x) * (1 + im[1]) + im[0], b + "img_attn.qkv"),
                              b + "img_attn.norm.query_norm.scale", b + "img_attn.norm.key_norm.scale")
        qt, kt, vt = heads_of(lin(ln(c) * (1 + tm[1]) + tm[0], b + "txt_attn.qkv"),
                              b + "txt_attn.norm.query_norm.scale", b + "txt_attn.norm.key_norm.scale")
        a = attend(np.concatenate([qt, qi], 2), np.concatenate([kt, ki], 2), np.concatenate([vt, vi], 2))
        x = x + im[2] * lin(a[:, Lt:], b + "img_attn.proj")
        x = x + im[5] * lin(gelu(lin(ln(x) * (1 + im[4]) + im[3], b + "img_mlp.0")), b + "img_mlp.2")
        c = c + tm[2] * lin(a[:, :Lt], b + "txt_attn.proj")
        c = c + tm[5] * lin(gelu(lin(ln(c) * (1 + tm[4]) + tm[3], b + "txt_mlp.0")), b + "txt_mlp.2")
    x = np.concatenate([c, x], 1)
    for i in range(p.depth_single_blocks):
        b = f"single_blocks.{i}."
        shift, scale, gate = chunks(vec, b + "modulation.lin", 3)
        h = lin(ln(x) * (1 + scale) + shift, b + "linear1")
        q, k, v = heads_of(h[..., :3 * H], b + "norm.query_norm.scale", b + "norm.key_norm.scale")
        x = x + gate * lin(np.concatenate([attend(q, k, v), gelu(h[..., 3 * H:])], -1), b + "linear2")
    x = x[:, Lt:]
    shift, scale = chunks(vec, "final_layer.adaLN_modulation.1", 2)
    return lin(ln(x) * (1 + scale) + shift, "final_layer.linear")


# ----------------------------------------------------------------------------- helpers
def random_state(p, seed=0, std=0.2):
    """Random BFL-layout weights (float64): norm scales around 1, everything else N(0, std)."""
    rng = np.random.default_rng(seed)
    sd = {}
    for k, s in K.bfl_shapes(p).items():
        sd[k] = (1 + 0.3 * rng.standard_normal(s)) if k.endswith(".scale") else std * rng.standard_normal(s)
    return sd


def tiny_model(dtype=flame.float64, device=None, seed=0, params=TINY):
    sd = random_state(params, seed)
    with flame_nn.empty_init(device=device, dtype=dtype):
        model = Flux(params)
    model.load_state_dict(sd)
    return model, sd


def tiny_inputs(p=TINY, batch=2, height=48, width=32, n_txt=5, seed=1):
    rng = np.random.default_rng(seed)
    L = (height // 16) * (width // 16)
    return dict(
        img=rng.standard_normal((batch, L, p.in_channels)),
        img_ids=S.image_ids(height, width, batch).numpy().astype(np.float64),
        txt=rng.standard_normal((batch, n_txt, p.context_in_dim)),
        txt_ids=np.concatenate([np.zeros((batch, n_txt - 1, 3)), np.full((batch, 1, 3), 2.0)], 1),  # one rotated
        timesteps=rng.uniform(0.05, 0.95, batch), y=rng.standard_normal((batch, p.vec_in_dim)),
        guidance=rng.uniform(1, 5, batch))


def to_flame(inputs, dtype, device):
    return {k: flame.tensor(v, dtype=dtype, device=device) for k, v in inputs.items()}


def reference(sd, p, inp):
    return reference_forward(sd, p, inp["img"], inp["img_ids"], inp["txt"], inp["txt_ids"], inp["timesteps"],
                             inp["y"], inp["guidance"])


# ----------------------------------------------------------------------------- tests
def test_parameter_names_and_shapes_are_bfl_checkpoint_keys():
    model = Flux(TINY, dtype=flame.float32)
    assert [(k, tuple(v.shape)) for k, v in model.named_parameters()] == list(K.bfl_shapes(TINY).items())
    with flame_nn.empty_init(dtype=flame.bfloat16):
        dev = Flux("flux-dev")
    params = list(dev.named_parameters())
    assert len(params) == 780 and all(p.is_meta and p.dtype == flame.bfloat16 for _, p in params)
    assert sum(p.numel() for _, p in params) == 11_901_408_320
    assert [(k, tuple(v.shape)) for k, v in params] == list(K.bfl_shapes("flux-dev").items())


@pytest.mark.parametrize("batch", [1, 2])  # one sample runs the modulation inside the LayerNorm
def test_forward_matches_the_float64_numpy_reference(device, batch):
    model, sd = tiny_model(device=device)
    inp = tiny_inputs(batch=batch)
    out = model(**to_flame(inp, flame.float64, device))
    assert out.shape == (batch, 6, 64) and out.dtype == flame.float64
    ref = reference(sd, TINY, inp)
    assert np.abs(ref).mean() > 0.1
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-9, atol=1e-9)


def test_schnell_style_model_needs_no_guidance(device):
    p = TINY.replace(guidance_embed=False)
    model, sd = tiny_model(device=device, params=p)
    assert not any(k.startswith("guidance_in") for k, _ in model.named_parameters())
    inp = tiny_inputs(p)
    args = to_flame(inp, flame.float64, device)
    args.pop("guidance")
    np.testing.assert_allclose(model(**args).detach().numpy(), reference(sd, p, inp), rtol=1e-9, atol=1e-9)
    dev_model, _ = tiny_model(device=device)
    with pytest.raises(ValueError, match="guidance"):
        dev_model(**args)


@pytest.mark.parametrize("dtype", [flame.float32, flame.bfloat16])
def test_adaln_of_a_batch_is_each_sample_alone(device, dtype):
    """LayerNorm + modulation with per-sample vectors (B, H) gives each sample the numbers it gets alone, where one
    sample's (H,) vectors run inside the fused LayerNorm: bit for bit, in bf16 too (an image does not depend on the
    batch it is generated in)."""
    from flame_models.flux.ops import norm_modulate
    rng = np.random.default_rng(3)
    x, shift, scale = (flame.tensor(rng.standard_normal(shape) * s, dtype=dtype, device=device)
                       for shape, s in (((3, 5, 64), 2.0), ((3, 64), 0.5), ((3, 64), 0.5)))
    out = norm_modulate(x, shift, scale)
    for b in range(3):
        alone = norm_modulate(x[b:b + 1], shift[b], scale[b])
        np.testing.assert_array_equal(out[b:b + 1].float().numpy(), alone.float().numpy())
    xs = x.float().numpy()
    ln = (xs - xs.mean(-1, keepdims=True)) / np.sqrt(xs.var(-1, keepdims=True) + 1e-6)
    want = ln * (1 + scale.float().numpy()[:, None]) + shift.float().numpy()[:, None]
    np.testing.assert_allclose(out.float().numpy(), want, rtol=0, atol=1e-5 if dtype == flame.float32 else 0.1)


@pytest.mark.parametrize("dtype,tol", [(flame.float32, 2e-4), (flame.bfloat16, 4e-2)])
def test_low_precision_forward_stays_close_to_the_reference(device, dtype, tol):
    model, sd = tiny_model(dtype=dtype, device=device)
    inp = tiny_inputs()
    # times whose x1000 is exact in bfloat16 (the model multiplies in its own dtype, as BFL's does)
    inp.update(timesteps=np.array([0.25, 0.5]), guidance=np.array([1.0, 4.0]))
    out = model(**to_flame(inp, dtype, device))
    assert out.dtype == dtype
    ref = reference(rounded(sd, dtype), TINY, rounded(inp, dtype))
    err = np.linalg.norm(out.float().detach().numpy() - ref) / np.linalg.norm(ref)
    assert err < tol, f"relative error {err:.2e} in {dtype}"


def rounded(arrays, dtype):
    """The arrays as the low-precision model holds them, back in float64 (so only compute error remains)."""
    return {k: v.astype(dtype.np).astype(np.float64) for k, v in arrays.items()}


def test_forward_backward_shapes_and_gradients(device):
    model, _ = tiny_model(dtype=flame.float32, device=device)
    args = to_flame(tiny_inputs(), flame.float32, device)
    out = model(**args)
    assert out.shape == (2, 6, 64)
    (out * out).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        g = p.grad.numpy()
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name


def test_gradcheck_of_selected_parameters_in_float64(device):
    model, _ = tiny_model(device=device)
    args = to_flame(tiny_inputs(batch=1), flame.float64, device)
    w = flame.tensor(np.random.default_rng(5).standard_normal((1, 6, 64)), dtype=flame.float64, device=device)

    def loss():
        return (model(**args) * w).sum()

    loss().backward()
    named = dict(model.named_parameters())
    picks = ["img_in.weight", "time_in.in_layer.bias", "guidance_in.out_layer.weight",
             "double_blocks.0.img_attn.norm.key_norm.scale", "double_blocks.1.txt_attn.qkv.weight",
             "double_blocks.0.txt_mlp.0.bias", "single_blocks.0.linear1.weight",
             "single_blocks.1.modulation.lin.weight", "final_layer.adaLN_modulation.1.weight"]
    rng = np.random.default_rng(6)
    eps = 1e-6
    for name in picks:
        p = named[name]
        analytic = p.grad.numpy()
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in p.shape)
            orig = float(p._data[idx])
            with flame.no_grad():
                p._data[idx] = orig + eps
                plus = loss().item()
                p._data[idx] = orig - eps
                minus = loss().item()
                p._data[idx] = orig
            numeric = (plus - minus) / (2 * eps)
            assert abs(numeric - analytic[idx]) <= 1e-6 + 1e-5 * abs(numeric), (name, idx, numeric, analytic[idx])


def test_gradient_checkpointing_gives_the_same_gradients(device):
    args = to_flame(tiny_inputs(), flame.float64, device)
    grads, calls = [], []
    for ckpt in (False, True):
        model, _ = tiny_model(device=device)
        model.enable_gradient_checkpointing(ckpt)
        n = [0]
        model.single_blocks[1].register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        out = model(**args)
        (out * out).sum().backward()
        grads.append({k: p.grad.numpy() for k, p in model.named_parameters()})
        calls.append(n[0])
    assert calls == [1, 2]  # checkpointed blocks run again in backward
    for k in grads[0]:
        np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-12, atol=1e-12, err_msg=k)


def test_model_level_checkpointing_switch(device):
    with flame_nn.empty_init(device=device, dtype=flame.float32):
        model = Flux(flux_params("flux-tiny"))
    assert not model.gradient_checkpointing
    model.gradient_checkpointing = True
    assert model.gradient_checkpointing
    assert all(b.gradient_checkpointing for b in (*model.double_blocks, *model.single_blocks))
    model.gradient_checkpointing = False
    assert not any(b.gradient_checkpointing for b in (*model.double_blocks, *model.single_blocks))


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("dtype", [flame.float64, flame.bfloat16])
def test_rope_inside_the_qk_norm_gives_the_separate_passes_numbers(device, dtype, frozen, monkeypatch):
    """ops.QK_ROPE: q and k rotated inside the QK-norm's op (no RoPE pass of their own) against the rope pass in
    attention -- the same forward and gradients (float64 to rounding; bf16 within the one rounding it saves). Frozen
    (a LoRA's base): the fused JointRMSNorm node with the tables; trained QK-norm gains: the composed ops."""
    from flame_core.ops import norms
    from flame_models.bfl import ops
    args = to_flame(tiny_inputs(), dtype, device)
    if frozen:
        for k in ("img", "txt"):
            args[k].requires_grad_(True)
    outs, grads, passes, fused_nodes = [], [], [], []
    for fused in (False, True):
        monkeypatch.setattr(ops, "QK_ROPE", fused)
        calls, nodes = [0], [0]
        real, real_apply = ops.apply_rope, norms.JointRMSNorm.apply

        def counting(*a, real=real, calls=calls):
            calls[0] += 1
            return real(*a)

        def counting_apply(*a, real_apply=real_apply, nodes=nodes):
            nodes[0] += a[-1] is not None            # the rope tables (its last argument)
            return real_apply(*a)
        monkeypatch.setattr(ops, "apply_rope", counting)
        monkeypatch.setattr(norms.JointRMSNorm, "apply", counting_apply)
        model, _ = tiny_model(dtype=dtype, device=device)
        model.requires_grad_(not frozen)
        out = model(**args)
        (out.float() * out.float()).mean().backward()
        outs.append(out.detach().float().numpy())
        if frozen:
            grads.append({k: args[k].grad.float().numpy() for k in ("img", "txt")})
            for k in ("img", "txt"):
                args[k].grad = None
        else:
            grads.append({k: p.grad.float().numpy() for k, p in model.named_parameters()})
        passes.append(calls[0])
        fused_nodes.append(nodes[0])
    n_blocks = TINY.depth + TINY.depth_single_blocks
    assert passes == [2 * n_blocks, 0]
    assert fused_nodes == [0, 2 * n_blocks if frozen else 0]
    # bf16: differences of one rounding of q / k, carried through four blocks in bf16; relative to each array's scale
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == flame.float64 else dict(rtol=0.0, atol=0.02)
    scale = max(1.0, float(np.abs(outs[0]).max()))
    np.testing.assert_allclose(outs[1] / scale, outs[0] / scale, **tol)
    for k in grads[0]:
        scale = max(1.0, float(np.abs(grads[0][k]).max()))
        np.testing.assert_allclose(grads[1][k] / scale, grads[0][k] / scale, **tol, err_msg=k)
