"""Saving and loading adapters through a model: exact in both layouts, row splits included; errors name the keys."""
import numpy as np
import pytest
from adapter_helpers import TINY_MAP, Tiny, randomize

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io
from flame_nn.adapters.formats import AdapterFormatError


def _model(seed, device, kind, targets, **kw):
    flame.manual_seed(0)          # the same base weights every time
    m = Tiny(device=device)
    g = flame.Generator("cpu").manual_seed(seed)
    A.inject_adapters(m, targets, kind, rank=2, alpha=kw.pop("alpha", 1.0), dtype=flame.float64, generator=g,
                      name_map=TINY_MAP, **kw)
    return m


def _assert_same_state(a, b):
    sa, sb = A.adapter_state(a), A.adapter_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        for p, q in zip(sa[k], sb[k]):
            assert (p.kind, p.rows, p.alpha) == (q.kind, q.rows, q.alpha)
            for t in p.tensors:
                np.testing.assert_array_equal(p.tensors[t], q.tensors[t])


CASES = [("kohya", "lora", ["qkv", "proj"]), ("kohya", "dora", ["qkv", "out"]), ("kohya", "lokr", ["qkv", "out"]),
         ("kohya", "loha", ["proj"]), ("kohya", "lora", ["to_q", "to_k", "to_out.0"]),
         ("kohya", "dora", ["to_q", "to_v"]), ("peft", "lora", ["qkv", "proj", "out"]),
         ("peft", "dora", ["qkv", "proj"]), ("peft", "lora", ["to_q", "to_k", "to_v"])]


@pytest.mark.parametrize("fmt,kind,targets", CASES)
def test_save_load_exact(fmt, kind, targets, tmp_path, rng, device):
    src = _model(1, device, kind, targets, alpha=0.5)
    randomize(A.adapter_parameters(src), rng)
    path = tmp_path / "a.safetensors"
    A.save_adapters(src, path, fmt, name_map=TINY_MAP, metadata={"flame.base_model": "tiny"})
    dst = _model(2, device, kind, targets)       # other init, alpha 1: everything must come from the file
    A.load_adapters(dst, path, name_map=TINY_MAP)
    _assert_same_state(src, dst)
    x = flame.tensor(rng.standard_normal((3, 12)), dtype=flame.float64, device=device)
    np.testing.assert_array_equal(dst(x).detach().cpu().numpy(), src(x).detach().cpu().numpy())
    meta = io.load_metadata(path)
    assert meta["flame.network_type"] == kind and meta["flame.rank"] == "2" and meta["flame.base_model"] == "tiny"
    assert meta["ss_network_dim"] == "2" and meta["flame.format"] == fmt


@pytest.mark.parametrize("fmt,kind,targets", [("kohya", "lora", ["to_q", "to_v"]), ("kohya", "lokr", ["qkv"]),
                                              ("peft", "dora", ["to_k", "proj"]), ("kohya", "loha", ["out"])])
def test_load_into_a_model_without_adapters(fmt, kind, targets, tmp_path, rng, device):
    """Inference: a fresh model gets adapters shaped by the file, with a weight; forward matches the source."""
    src = _model(1, device, kind, targets)
    randomize(A.adapter_parameters(src), rng)
    path = tmp_path / "a.safetensors"
    A.save_adapters(src, path, fmt, name_map=TINY_MAP)
    flame.manual_seed(0)
    dst = Tiny(device=device)
    x = flame.tensor(rng.standard_normal((3, 12)), dtype=flame.float64, device=device)
    base = dst(x).detach().cpu().numpy()
    A.load_adapters(dst, path, name="style", weight=1.0, name_map=TINY_MAP, dtype=flame.float64)
    np.testing.assert_allclose(dst(x).detach().cpu().numpy(), src(x).detach().cpu().numpy(), rtol=1e-12, atol=1e-13)
    A.set_adapters(dst, "style", 0.0)
    np.testing.assert_allclose(dst(x).detach().cpu().numpy(), base, rtol=1e-12, atol=1e-13)


def test_load_errors(tmp_path, rng, device):
    src = _model(1, device, "lora", ["qkv", "proj"])
    path = tmp_path / "a.safetensors"
    A.save_adapters(src, path, "kohya")
    other = _model(1, device, "lora", ["qkv", "out"])
    with pytest.raises(AdapterFormatError, match=r"missing from the file: \['out'\].*unexpected.*\['proj'\]"):
        A.load_adapters(other, path)
    flame.manual_seed(0)
    wide = Tiny(device=device)
    A.inject_adapters(wide, ["qkv", "proj"], "lora", rank=3)
    with pytest.raises(AdapterFormatError, match=r"lora_down.weight' has shape \(2, 12\).*\(3, 12\)"):
        A.load_adapters(wide, path)
    with pytest.raises(AdapterFormatError, match="cannot load a lora adapter into a dora"):
        A.load_adapters(_model(1, device, "dora", ["qkv", "proj"]), path)
    with pytest.raises(AdapterFormatError, match="no PEFT/diffusers layout"):
        A.save_adapters(_model(1, device, "lokr", ["qkv"]), tmp_path / "b.safetensors", "peft")
