"""inject_from_state: adapters shaped by canonical parts (a file's kinds, ranks, row ranges and factors) and holding
their values -- the model's function is the parts' (float64 reference), each scale kept (rsLoRA too), dropout given
to the LoRA / DoRA adapters it makes, the base frozen, and bad input refused before anything changes."""
import numpy as np
import pytest
from adapter_helpers import TINY_MAP, Tiny, randomize

import flame_core as flame
import flame_nn.adapters as A


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _parts(kind, rng, device):
    """Canonical adapters of `kind` with random values: to_q / to_v rows of qkv at ranks 2 and 3 (LoRA / DoRA),
    whole proj and out otherwise."""
    flame.manual_seed(3)
    src = Tiny(device=device)
    targets = ["attn.to_q", "attn.to_v", "proj"] if kind in ("lora", "dora") else ["qkv", "proj"]
    A.inject_adapters(src, targets[:1], kind, rank=2, alpha=1.0, name_map=TINY_MAP, dtype=flame.float64)
    A.inject_adapters(src, targets[1:], kind, rank=3, alpha=4.5, name_map=TINY_MAP, dtype=flame.float64,
                      skip_adapted=True)
    randomize(A.adapter_parameters(src), rng)
    return A.adapter_state(src)


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr", "loha"])
def test_the_model_computes_the_parts(kind, tiny, rng, device):
    state = _parts(kind, rng, device)
    x = flame.tensor(rng.standard_normal((2, 5, 12)), dtype=flame.float64, device=device)
    with flame.no_grad():
        base = _np(tiny(x))
    made = A.inject_from_state(tiny, state, dtype=flame.float64)
    assert made == [(m, p.rows) for m, parts in state.items() for p in parts]
    got = A.adapter_state(tiny)
    for m, parts in state.items():
        for g, w in zip(got[m], parts):
            assert (g.kind, g.rows, g.rank) == (w.kind, w.rows, w.rank) and g.scale == pytest.approx(w.scale)
            for k in w.tensors:
                np.testing.assert_allclose(g.tensors[k], w.tensors[k], rtol=1e-12)
    # the function: the merged weights of the parts
    merged = {}
    for m, parts in state.items():
        w = _np(tiny.get_submodule(m).weight).copy()
        for p in parts:
            lo, hi = p.rows or (0, w.shape[0])
            w[lo:hi] = p.merged_weight(w[lo:hi])
        merged[m] = w
    with flame.no_grad():
        y = _np(tiny(x))
    h = _np(x)
    for name in ("qkv", "proj", "out"):
        mod = tiny.get_submodule(name)
        h = h @ merged.get(name, _np(mod.weight)).T + (0 if mod.bias is None else _np(mod.bias))
        h = np.tanh(h) if name == "proj" else h
    np.testing.assert_allclose(y, h, rtol=1e-9, atol=1e-11)
    assert np.abs(y - base).max() > 1e-3
    assert not any(p.requires_grad for p in tiny.parameters())                  # the base frozen
    assert all(p.requires_grad for p in A.adapter_parameters(tiny))


def test_rslora_keeps_each_scale_and_dropout_reaches_the_adapters(tiny, rng, device):
    state = _parts("lora", rng, device)
    A.inject_from_state(tiny, state, dropout=0.25, rslora=True, dtype=flame.float64)
    for (m, rows, ad), want in zip(A.adapter_modules(tiny), [p for parts in state.values() for p in parts]):
        assert ad.rslora and ad.dropout == 0.25
        assert ad.scale == pytest.approx(want.scale) and ad.alpha == pytest.approx(want.scale * ad.rank ** 0.5)


def test_bad_input_changes_nothing(tiny, rng, device):
    state = _parts("lokr", rng, device)
    with pytest.raises(A.AdapterError, match="no input dropout"):
        A.inject_from_state(tiny, state, dropout=0.1)
    with pytest.raises(A.AdapterFormatError, match="not Linears or Conv2ds of the model"):
        A.inject_from_state(tiny, {"nope": state["qkv"]})
    bad = {"proj": [A.AdapterPart("lokr", {k: v[..., :1] for k, v in state["proj"][0].tensors.items()},
                                  state["proj"][0].alpha)], **{"qkv": state["qkv"]}}
    with pytest.raises((A.AdapterError, A.AdapterFormatError), match="^proj: "):
        A.inject_from_state(tiny, bad)
    assert A.adapted_modules(tiny) == [] and all(p.requires_grad for p in tiny.parameters())
    A.inject_from_state(tiny, state)
    with pytest.raises(A.AdapterError, match="already exists"):
        A.inject_from_state(tiny, state)
