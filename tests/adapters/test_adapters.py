"""Adapters in a model: forward equals the merged weight's forward (float64 NumPy reference), gradients (gradcheck,
and DoRA's detached-norm rule), row splits, several adapters with weights, merge/unmerge, enable/disable, dtypes."""
import math

import numpy as np
import pytest
from adapter_helpers import TINY_MAP, Tiny, randomize

import flame_core as flame
import flame_nn.adapters as A
from flame_nn.adapters import (
    AdapterError,
    adapted_modules,
    adapter_modules,
    adapter_parameters,
    adapter_state,
    disable_adapters,
    enable_adapters,
    merge_adapters,
    remove_adapters,
    set_adapters,
    unmerge_adapters,
)
from flame_nn.adapters.lokr import factorization

KINDS = ["lora", "dora", "lokr", "loha"]


def inject_adapters(*args, **kwargs):
    """float64 adapters for the float64 references (the default, float32, is for bf16 bases)."""
    kwargs.setdefault("dtype", flame.float64)
    return A.inject_adapters(*args, **kwargs)


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _ref_forward(model, x, merged):
    """The Tiny model in NumPy float64 with the given {module: W'} weights."""
    def lin(name, h):
        m = getattr(model, name)
        w = merged.get(name, _np(m.weight))
        return h @ w.T + (0 if m.bias is None else _np(m.bias))
    return lin("out", np.tanh(lin("proj", lin("qkv", x))))


def _merged_weights(model, name="default"):
    """W' per module from the canonical parts (formats.AdapterPart math), independent of the modules' forward."""
    out = {}
    for mod_name, parts in adapter_state(model, name).items():
        w = _np(model.get_submodule(mod_name).weight).copy()
        for p in parts:
            lo, hi = p.rows or (0, w.shape[0])
            w[lo:hi] = p.merged_weight(w[lo:hi])
        out[mod_name] = w
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_forward_equals_merged_weight_forward(kind, tiny, rng, device):
    inject_adapters(tiny, ["qkv", "proj", "out"], kind, rank=2, alpha=3.0)
    randomize(adapter_parameters(tiny), rng)
    x = rng.standard_normal((2, 5, 12))
    y = tiny(flame.tensor(x, dtype=flame.float64, device=device))
    ref = _ref_forward(tiny, x, _merged_weights(tiny))
    np.testing.assert_allclose(_np(y), ref, rtol=1e-10, atol=1e-12)
    assert np.abs(ref - _ref_forward(tiny, x, {})).max() > 1e-2  # the adapters do change the output
    merge_adapters(tiny)  # the module's own merge gives the same function
    np.testing.assert_allclose(_np(tiny(flame.tensor(x, dtype=flame.float64, device=device))), ref, rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_gradcheck(kind, rng, device):
    flame.manual_seed(1)
    model = Tiny(device=device)
    inject_adapters(model, ["qkv", "proj"], kind, rank=2, alpha=2.0)
    params = adapter_parameters(model)
    randomize(params, rng)
    x = flame.tensor(rng.standard_normal((3, 12)), dtype=flame.float64, device=device, requires_grad=True)

    def f(x, *ps):
        return model(x)
    assert flame.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_dora_gradients_treat_the_norm_as_constant(rng, device):
    """DoRA's rule (PEFT, paper §4.3): ‖W + sBA‖ is detached. Reference gradients in NumPy with the norm fixed."""
    flame.manual_seed(2)
    from flame_nn.layers.linear import Linear
    from flame_nn.module import Module

    class One(Module):
        def __init__(self):
            super().__init__()
            self.lin = Linear(6, 5, dtype=flame.float64, device=device)

        def forward(self, x):
            return self.lin(x)

    m = One()
    inject_adapters(m, ["lin"], "dora", rank=2, alpha=1.0)
    (_, _, ad), = adapter_modules(m)
    randomize(adapter_parameters(m), rng)
    x = rng.standard_normal((4, 6))
    g = rng.standard_normal((4, 5))
    xt = flame.tensor(x, dtype=flame.float64, device=device, requires_grad=True)
    (m(xt) * flame.tensor(g, dtype=flame.float64, device=device)).sum().backward()
    W = _np(m.lin.weight)
    A, B, mag, s = _np(ad.lora_A), _np(ad.lora_B), _np(ad.magnitude), ad.scale
    V = W + s * B @ A
    n = np.linalg.norm(V, axis=1)
    c = mag / n                                   # fixed in the backward
    # y = c ⊙ (x Wᵀ + s x Aᵀ Bᵀ) + b
    gc = g * c                                    # (4, 5)
    np.testing.assert_allclose(_np(ad.lora_B.grad), s * gc.T @ (x @ A.T), rtol=1e-10)
    np.testing.assert_allclose(_np(ad.lora_A.grad), s * B.T @ gc.T @ x, rtol=1e-10)
    np.testing.assert_allclose(_np(ad.magnitude.grad), (g * ((x @ V.T) / n)).sum(0), rtol=1e-10)
    np.testing.assert_allclose(_np(xt.grad), gc @ V, rtol=1e-10)
    assert m.lin.weight.grad is None and m.lin.bias.grad is None  # the base is frozen


def test_dora_starts_as_the_base(tiny, rng, device):
    x = flame.tensor(rng.standard_normal((3, 12)), dtype=flame.float64, device=device)
    before = _np(tiny(x))
    inject_adapters(tiny, ["qkv"], "dora", rank=2)
    (_, _, ad), = adapter_modules(tiny)
    np.testing.assert_allclose(_np(ad.magnitude), np.linalg.norm(_np(tiny.qkv.weight), axis=1), rtol=1e-14)
    np.testing.assert_allclose(_np(tiny(x)), before, rtol=1e-12, atol=1e-14)


def test_row_targets_through_name_map(tiny, rng, device):
    made = inject_adapters(tiny, ["to_q", "to_v", "to_out.0"], "lora", rank=2, name_map=TINY_MAP)
    assert made == [("qkv", (0, 8)), ("qkv", (16, 24)), ("proj", None)]
    randomize(adapter_parameters(tiny), rng)
    x = rng.standard_normal((4, 12))
    merged = _merged_weights(tiny)
    np.testing.assert_array_equal(merged["qkv"][8:16], _np(tiny.qkv.weight)[8:16])  # to_k untouched
    y = tiny(flame.tensor(x, dtype=flame.float64, device=device))
    np.testing.assert_allclose(_np(y), _ref_forward(tiny, x, merged), rtol=1e-10, atol=1e-12)
    with pytest.raises(AdapterError, match="cannot adapt rows"):
        inject_adapters(tiny, ["to_k"], "lokr", name="k", name_map=TINY_MAP)


def test_several_adapters_with_weights(tiny, rng, device):
    x = rng.standard_normal((3, 12))
    xt = flame.tensor(x, dtype=flame.float64, device=device)
    base = _np(tiny(xt))
    inject_adapters(tiny, ["qkv", "proj"], "lora", name="a", rank=2)
    inject_adapters(tiny, ["qkv"], "lokr", name="b", rank=2)
    randomize(adapter_parameters(tiny, "a") + adapter_parameters(tiny, "b"), rng)
    wa, wb = _merged_weights(tiny, "a"), _merged_weights(tiny, "b")
    w0 = {"qkv": _np(tiny.qkv.weight), "proj": _np(tiny.proj.weight)}
    set_adapters(tiny, ["a", "b"], [0.5, 2.0])
    combo = {"qkv": w0["qkv"] + 0.5 * (wa["qkv"] - w0["qkv"]) + 2.0 * (wb["qkv"] - w0["qkv"]),
             "proj": w0["proj"] + 0.5 * (wa["proj"] - w0["proj"])}
    np.testing.assert_allclose(_np(tiny(xt)), _ref_forward(tiny, x, combo), rtol=1e-10, atol=1e-12)
    set_adapters(tiny, "b")
    np.testing.assert_allclose(_np(tiny(xt)), _ref_forward(tiny, x, {"qkv": wb["qkv"]}), rtol=1e-10, atol=1e-12)
    disable_adapters(tiny)
    np.testing.assert_array_equal(_np(tiny(xt)), base)
    enable_adapters(tiny)
    set_adapters(tiny, ["a", "b"], [0.5, 2.0])
    w_before = _np(tiny.qkv.weight).copy()
    merge_adapters(tiny)
    np.testing.assert_allclose(_np(tiny.qkv.weight), combo["qkv"], rtol=1e-10)
    np.testing.assert_allclose(_np(tiny(xt)), _ref_forward(tiny, x, combo), rtol=1e-10, atol=1e-12)
    with pytest.raises(AdapterError, match="unmerge them first"):
        disable_adapters(tiny)
    unmerge_adapters(tiny)
    np.testing.assert_array_equal(_np(tiny.qkv.weight), w_before)  # exact: the original rows were kept
    remove_adapters(tiny)
    assert adapted_modules(tiny) == [] and type(tiny.qkv).__name__ == "Linear"
    np.testing.assert_array_equal(_np(tiny(xt)), base)


def test_base_frozen_bf16_adapters_fp32_and_state_dict_unchanged(rng, device):
    flame.manual_seed(3)
    model = Tiny(dtype=flame.bfloat16, device=device)
    keys = list(model.state_dict())
    inject_adapters(model, ["qkv", "proj", "out"], "lora", rank=4, alpha=4, dtype=flame.float32)
    assert list(model.state_dict()) == keys  # base checkpoints still save and load by the same names
    ps = adapter_parameters(model)
    assert len(ps) == 6 and all(p.dtype == flame.float32 and p.requires_grad for p in ps)
    assert all(not p.requires_grad for p in model.parameters())
    randomize(ps, rng, 0.05)
    x = flame.tensor(rng.standard_normal((2, 12)), dtype=flame.bfloat16, device=device)
    y = model(x)
    assert y.dtype == flame.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == flame.float32 for p in ps)
    assert all(p.grad is None for p in model.parameters())
    # the adapter path runs in float32 (as PEFT): compare with a float64 reference within bf16 output rounding
    ref = _ref_forward(model, _np(x), _merged_weights(model))
    np.testing.assert_allclose(_np(y), ref, rtol=2e-2, atol=2e-2)


def test_rslora_and_dropout(tiny, rng, device):
    inject_adapters(tiny, ["qkv"], "lora", rank=4, alpha=8.0, rslora=True, dropout=0.5)
    (_, _, ad), = adapter_modules(tiny)
    assert ad.scale == pytest.approx(8.0 / math.sqrt(4))
    assert adapter_state(tiny)["qkv"][0].alpha == pytest.approx(ad.scale * 4)  # files carry s as alpha/r
    randomize(adapter_parameters(tiny), rng)
    x = flame.tensor(rng.standard_normal((64, 12)), dtype=flame.float64, device=device)
    tiny.eval()
    y_eval = _np(tiny(x))
    np.testing.assert_allclose(y_eval, _ref_forward(tiny, _np(x), _merged_weights(tiny)), rtol=1e-10, atol=1e-12)
    tiny.train()
    assert np.abs(_np(tiny(x)) - y_eval).max() > 1e-3  # dropout acts in training only


def test_lokr_factorization_and_shapes():
    assert [factorization(d) for d in (3072, 9216, 12288, 21504)] == [(48, 64), (96, 96), (96, 128), (128, 168)]
    assert factorization(3072, 8) == (8, 384) and factorization(3072, 4096) == (48, 64)
    from flame_nn.adapters import LoKr
    ad = LoKr(3072, 9216, rank=16)
    assert ad.factors == (96, 96, 48, 64) and not ad.full_w2 and tuple(ad.lokr_w2_a.shape) == (96, 16)
    full = LoKr(3072, 9216, rank=16, full_rank=True)
    assert full.full_w2 and tuple(full.lokr_w2.shape) == (96, 64) and full.scale == 1.0
    assert LoKr(64, 64, rank=4).full_w2  # r >= max(8, 8) / 2


def test_errors(tiny):
    with pytest.raises(AdapterError, match="no Linear or Conv2d matches the targets \\['nothing'\\]"):
        inject_adapters(tiny, ["nothing"], "lora")
    with pytest.raises(AdapterError, match="unknown adapter kind 'lorra'"):
        inject_adapters(tiny, ["qkv"], "lorra")
    inject_adapters(tiny, ["qkv"], "lora")
    with pytest.raises(AdapterError, match="already exists"):
        inject_adapters(tiny, ["qkv"], "lora")
    with pytest.raises(AdapterError, match="no adapter named 'other'"):
        adapter_parameters(tiny, "other")
    with pytest.raises(AdapterError, match="unknown adapter"):
        set_adapters(tiny, ["default", "x"])
