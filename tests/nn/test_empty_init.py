"""empty_init: models built without allocating or initialising weights, materialised from state dicts and files."""
import time

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core import io


def npa(t):
    return t.detach().numpy().astype(np.float64)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv2d(2, 3, 3)
        self.register_buffer("freqs", flame.arange(3).float())

    def forward(self, idx):
        return self.norm(self.fc(self.emb(idx)))


def _real_state(seed=0):
    flame.manual_seed(seed)
    return Tiny().state_dict()


def test_parameters_are_meta_placeholders_without_storage():
    with nn.empty_init():
        m = Tiny()
    ps = list(m.parameters())
    assert all(p.is_meta for p in ps)
    for p in ps:
        assert p._data.strides == (0,) * p.ndim  # one element broadcast: no per-element memory
        assert p._data.base is not None and p._data.base.size == 1
    assert m.fc.weight.shape == (6, 4) and m.fc.weight.dtype == flame.float32
    assert not isinstance(m.freqs, nn.Parameter) and m.freqs._data.strides == (4,)  # buffers are real
    assert "meta" in repr(m.fc.weight)
    with pytest.raises(nn.MetaTensorError, match="empty_init"):
        m(flame.tensor([1, 2]))


def test_twelve_billion_parameters_built_instantly():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(12288, 12288 * 4, bias=False) for _ in range(20)])

    t0 = time.perf_counter()
    with nn.empty_init(dtype=flame.bfloat16):
        big = Big()
    elapsed = time.perf_counter() - t0
    n = sum(p.numel() for p in big.parameters())
    assert n == 20 * 12288 * 12288 * 4 and n > 12e9
    assert all(p.dtype == flame.bfloat16 and p.is_meta for p in big.parameters())
    assert elapsed < 2.0


def test_load_state_dict_materialises_with_target_dtype(device):
    with nn.empty_init(device=device, dtype=flame.float64):
        m = Tiny()
    assert m.fc.weight.device == flame.device(device)
    sd = _real_state()
    m.load_state_dict(sd)
    assert not any(p.is_meta for p in m.parameters())
    assert m.fc.weight.dtype == flame.float64 and m.fc.weight.device == flame.device(device)
    np.testing.assert_allclose(npa(m.fc.weight), npa(sd["fc.weight"]))
    out = m(flame.tensor([1, 2], device=device))
    assert tuple(out.shape) == (2, 6)
    # the materialised parameters are private copies and train
    out.sum().backward()
    assert m.fc.weight.grad is not None


def test_partial_load_keeps_module_unusable_until_complete():
    with nn.empty_init():
        m = Tiny()
    sd = _real_state()
    part = {k: v for k, v in sd.items() if not k.startswith("fc.")}
    res = m.load_state_dict(part, strict=False)
    assert res.missing_keys == ["fc.weight", "fc.bias"]
    assert m.fc.weight.is_meta and not m.emb.weight.is_meta
    with pytest.raises(nn.MetaTensorError, match="weight, bias"):
        m(flame.tensor([0]))


def test_module_to_retargets_placeholders_and_to_empty_allocates():
    with nn.empty_init():
        m = Tiny()
    m.to(flame.float16)
    assert m.fc.weight.is_meta and m.fc.weight.dtype == flame.float16
    m.to_empty()
    assert not m.fc.weight.is_meta and m.fc.weight._data.strides != (0, 0)
    assert m.fc.weight.dtype == flame.float16


def test_init_functions_skip_placeholders_and_copy_materialises():
    with nn.empty_init():
        lin = nn.Linear(3, 2)
    nn.init.normal_(lin.weight)  # no-op, no error
    assert lin.weight.is_meta
    with flame.no_grad():
        lin.weight.copy_(flame.ones(2, 3))
    assert not lin.weight.is_meta
    np.testing.assert_array_equal(npa(lin.weight), 1.0)


def test_user_parameters_registered_under_empty_init_become_placeholders():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(flame.randn(5, 5))

    with nn.empty_init():
        c = Custom()
    assert c.w.is_meta and tuple(c.w.shape) == (5, 5)


def test_load_weights_from_sharded_files(tmp_path, device):
    sd = _real_state(3)
    keys = list(sd)
    io.save_file({k: sd[k].to(flame.bfloat16) if sd[k].dtype.is_floating_point else sd[k]
                  for k in keys[:3]}, tmp_path / "a.safetensors")
    io.save_file({"model." + k: sd[k] for k in keys[3:]}, tmp_path / "b.safetensors")
    with nn.empty_init(device=device):
        m = Tiny()
    missing, unexpected = nn.load_weights_(m, [tmp_path / "a.safetensors", tmp_path / "b.safetensors"],
                                           key_map=lambda k: k[len("model."):] if k.startswith("model.") else k)
    assert missing == [] and unexpected == []
    assert all(p.dtype == flame.float32 and p.device == flame.device(device) for p in m.parameters())
    for k in keys[:3]:  # went through bfloat16 in the file
        np.testing.assert_allclose(npa(m.state_dict()[k]), npa(sd[k].to(flame.bfloat16).float()))
    for k in keys[3:]:
        np.testing.assert_array_equal(npa(m.state_dict()[k]), npa(sd[k]))


def test_load_weights_reports_missing_unexpected_misshaped(tmp_path):
    sd = _real_state()
    bad = {k: v for k, v in sd.items() if k != "norm.bias"}
    bad["fc.weight"] = flame.zeros(4, 6)
    bad["stray"] = flame.zeros(1)
    io.save_file(bad, tmp_path / "bad.safetensors")
    with nn.empty_init():
        m = Tiny()
    with pytest.raises(nn.StateDictError) as e:
        nn.load_weights_(m, tmp_path / "bad.safetensors")
    msg = str(e.value)
    assert '"norm.bias"' in msg and '"stray"' in msg and "size mismatch for fc.weight" in msg
    assert "bad.safetensors" in msg
    del bad["fc.weight"]
    io.save_file(bad, tmp_path / "ok.safetensors")
    missing, unexpected = nn.load_weights_(m, tmp_path / "ok.safetensors", strict=False, dtype=flame.float16)
    assert set(missing) == {"norm.bias", "fc.weight"} and unexpected == ["stray"]
    assert m.emb.weight.dtype == flame.float16 and m.fc.weight.is_meta


def test_deepcopy_of_a_placeholder_model_allocates_nothing():
    import copy
    with nn.empty_init(dtype=flame.bfloat16):
        big = nn.Linear(50000, 40000)
    twin = copy.deepcopy(big)
    assert twin.weight.is_meta and twin.weight.dtype == flame.bfloat16 and tuple(twin.weight.shape) == (40000, 50000)
    assert twin.weight is not big.weight
