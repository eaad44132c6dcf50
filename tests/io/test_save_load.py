"""flame_core.save / flame_core.load (torch.save / torch.load on safetensors, never pickle): state dicts and nested
containers round trip bit for bit in every dtype, the file is an ordinary safetensors state dict, map_location,
plain safetensors files load as dicts, pickle files are refused with a way out, and bad input is named."""
import collections
import json
import os
import pickle
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file as st_save_file

import flame_core as flame
from flame_core import io
from flame_core.errors import DeviceError
from flame_core.serialization import PickleFileError


def _bits(t):
    return np.ascontiguousarray(t.detach().numpy()).reshape(-1).view(np.uint8)


def _state_dict(device):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((3, 5)).astype(np.float32)
    return collections.OrderedDict([
        ("blocks.0.weight", flame.tensor(base, device=device)),
        ("blocks.0.bf16", flame.tensor(base, dtype=flame.bfloat16, device=device)),
        ("blocks.0.fp8", flame.tensor(np.clip(base, -4, 4), device=device).to(flame.float8_e4m3fn)),
        ("f16", flame.tensor(base, dtype=flame.float16, device=device)),
        ("f64.T", flame.tensor(base.astype(np.float64), device=device).T),  # non-contiguous
        ("steps", flame.tensor(rng.integers(-9, 9, (4,)), device=device)),
        ("i32", flame.tensor([[1, -2]], dtype=flame.int32, device=device)),
        ("mask", flame.tensor([True, False], device=device)),
        ("scalar", flame.tensor(3.5, device=device)),
        ("empty", flame.zeros(0, 7, device=device)),
    ])


def test_state_dict_roundtrip_bit_exact_and_plain_safetensors(tmp_path, device):
    sd = _state_dict(device)
    path = tmp_path / "model.safetensors"
    flame.save(sd, path)
    back = flame.load(path)
    assert type(back) is collections.OrderedDict and list(back) == list(sd)
    for k, t in sd.items():
        b = back[k]
        assert b.dtype == t.dtype and tuple(b.shape) == tuple(t.shape) and b.device == t.device, k
        np.testing.assert_array_equal(_bits(b), _bits(t), err_msg=k)
    plain = io.load_file(path)  # any safetensors reader sees the state dict under its own names
    assert list(plain) == list(sd)
    np.testing.assert_array_equal(_bits(plain["blocks.0.bf16"]), _bits(sd["blocks.0.bf16"]))
    assert io.load_metadata(path)["format"] == "pt"


def test_nested_containers_roundtrip(tmp_path, device):
    w = flame.randn(2, 3, device=device, requires_grad=True)
    obj = {
        "model": {"w": w, "b": flame.zeros(3, dtype=flame.bfloat16, device=device)},
        "optim": {"state": {0: {"step": 7, "exp_avg": flame.ones(2, 3, device=device)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "amsgrad": False,
                                    "foreach": None, "name": "körper"}]},
        "tied": [w, w],               # one object twice: stored once, loaded as one object
        "floats": [float("inf"), -float("inf"), float("nan"), 0.1, 1.0],
        "ints": (0, -1, 2 ** 70), "keys": {1.5: "a", None: "b", True: "c", (1, "x"): "d", "": "e"},
        "np": [np.float32(2.5), np.int64(-3), np.bool_(True), np.arange(4, dtype=np.int16)],
        "dtype": flame.bfloat16, "device": flame.device("cpu"), "empty": [{}, [], ()],
    }
    path = tmp_path / "ckpt.safetensors"
    flame.save(obj, path)
    r = flame.load(path, map_location=device)
    assert r["tied"][0] is r["tied"][1] is r["model"]["w"]
    assert r["model"]["w"].requires_grad and not r["model"]["b"].requires_grad
    np.testing.assert_array_equal(r["model"]["w"].detach().numpy(), w.detach().numpy())
    assert r["model"]["b"].dtype == flame.bfloat16
    assert r["optim"]["param_groups"] == obj["optim"]["param_groups"]
    assert list(r["optim"]["state"]) == [0] and r["optim"]["state"][0]["step"] == 7
    f = r["floats"]
    assert f[0] == np.inf and f[1] == -np.inf and np.isnan(f[2]) and f[3:] == [0.1, 1.0]
    assert r["ints"] == (0, -1, 2 ** 70) and type(r["ints"]) is tuple
    assert r["keys"] == obj["keys"]
    a, b, c, arr = r["np"]
    assert type(a) is np.float32 and a == 2.5 and type(b) is np.int64 and b == -3 and type(c) is np.bool_
    assert type(arr) is np.ndarray and arr.dtype == np.int16 and arr.tolist() == [0, 1, 2, 3]
    assert r["dtype"] is flame.bfloat16 and r["device"] == flame.device("cpu")
    assert r["empty"] == [{}, [], ()]
    names = io.load_file(path).keys()
    assert set(names) == {"model/w", "model/b", "optim/state/0/exp_avg", "np/3"}


def test_bare_tensor_and_list_roundtrip(tmp_path, device):
    t = flame.arange(6, device=device).reshape(2, 3)
    flame.save(t, tmp_path / "t.safetensors")
    back = flame.load(tmp_path / "t.safetensors")
    assert isinstance(back, flame.Tensor)
    np.testing.assert_array_equal(back.numpy(), t.numpy())
    flame.save([t, {"t": t * 2}], str(tmp_path / "l.safetensors"))
    lst = flame.load(str(tmp_path / "l.safetensors"))
    np.testing.assert_array_equal(lst[1]["t"].numpy(), t.numpy() * 2)


def test_optimizer_state_dict_roundtrip(tmp_path, device):
    import flame_nn as nn
    model = nn.Linear(4, 3).to(device)
    opt = nn.optim.AdamW(model.parameters(), lr=1e-2)
    model(flame.randn(5, 4, device=device)).sum().backward()
    opt.step()
    flame.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.safetensors")
    ck = flame.load(tmp_path / "c.safetensors")
    model2 = nn.Linear(4, 3).to(device)
    opt2 = nn.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    for (k, s), (_, s2) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items()):
        for name, v in s.items():
            v2 = s2[name]
            if isinstance(v, flame.Tensor):
                np.testing.assert_array_equal(v2.numpy(), v.numpy())
            else:
                assert v2 == v
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_map_location(tmp_path, device):
    flame.save({"a": flame.ones(2, device=device)}, tmp_path / "a.safetensors")
    assert flame.load(tmp_path / "a.safetensors", map_location="cpu")["a"].device == flame.device("cpu")
    saved_on = str(flame.ones(1, device=device).device)  # as the file records it ("cpu", "cuda:0")
    d = flame.load(tmp_path / "a.safetensors", map_location={saved_on: "cpu"})["a"]
    assert d.device == flame.device("cpu")
    # a file that says its tensor was saved on a GPU
    io.save_file({"w": flame.ones(2)}, tmp_path / "g.safetensors", metadata={
        "flame.serialization": "1", "flame.structure": json.dumps({"D": [["w", {"t": "w", "d": "cuda:0"}]]})})
    if flame.cuda_is_available():
        assert flame.load(tmp_path / "g.safetensors")["w"].is_cuda
    else:
        with pytest.raises(DeviceError, match="saved on cuda:0 but no GPU is available here; pass map_location"):
            flame.load(tmp_path / "g.safetensors")
    assert flame.load(tmp_path / "g.safetensors", map_location={"cuda:0": "cpu"})["w"].device == flame.device("cpu")
    with pytest.raises(TypeError, match="map_location must be None, a device"):
        flame.load(tmp_path / "a.safetensors", map_location=lambda s, loc: s)


def test_foreign_and_unknown_files_load_as_plain_dicts(tmp_path):
    st_save_file({"x": np.arange(3, dtype=np.float32), "y": np.ones((2, 2), ml_dtypes.bfloat16)},
                 str(tmp_path / "hf.safetensors"), metadata={"format": "pt"})
    d = flame.load(tmp_path / "hf.safetensors")
    assert type(d) is dict and sorted(d) == ["x", "y"] and d["y"].dtype == flame.bfloat16
    io.save_file({"z": flame.ones(1)}, tmp_path / "future.safetensors",
                 metadata={"flame.serialization": "99", "flame.structure": "{\"new\": 1}"})
    with pytest.warns(UserWarning, match="serialization version '99'"):
        d = flame.load(tmp_path / "future.safetensors")
    assert list(d) == ["z"]
    io.save_file({"z": flame.ones(1)}, tmp_path / "bad.safetensors",
                 metadata={"flame.serialization": "1", "flame.structure": json.dumps({"t": "missing"})})
    with pytest.raises(io.SafetensorsError, match="refers to a tensor 'missing' the file does not have"):
        flame.load(tmp_path / "bad.safetensors")
    io.save_file({"z": flame.ones(1)}, tmp_path / "junk.safetensors",
                 metadata={"flame.serialization": "1", "flame.structure": "{not json"})
    with pytest.raises(io.SafetensorsError, match="corrupt flame.structure metadata"):
        flame.load(tmp_path / "junk.safetensors")


def test_pickle_files_are_refused_with_a_conversion_recipe(tmp_path):
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=2))
    with zipfile.ZipFile(tmp_path / "model.pth", "w") as z:  # torch.save's zip layout
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    for p in (legacy, tmp_path / "model.pth"):
        with pytest.raises(PickleFileError, match=r"(?s)FLAME does not unpickle.*safetensors.torch import save_file"):
            flame.load(p)
    (tmp_path / "odd.ckpt").write_bytes(b"\x00" * 64)
    with pytest.raises(PickleFileError, match="convert it to safetensors first"):
        flame.load(tmp_path / "odd.ckpt")
    assert issubclass(PickleFileError, ValueError)


def test_bad_input_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"cannot store a builtins.set at obj\['a'\]\[1\]"):
        flame.save({"a": [1, {2}]}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"the dict at obj\['m'\] has a key of type Tensor"):
        flame.save({"m": {flame.ones(1): 1}}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="f must be a file path"):
        flame.save({}, open(os.devnull, "wb"))
    with pytest.raises(ValueError, match="weights_only=False would allow unpickling"):
        flame.load(tmp_path / "x.safetensors", weights_only=False)
    with pytest.raises(FileNotFoundError):
        flame.load(tmp_path / "missing.safetensors")
    assert not os.listdir(tmp_path)  # nothing was written by the failed saves


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    flame.save({"a": flame.ones(3)}, path)
    before = path.read_bytes()
    real, calls = io._host_array, []

    def interrupted(v, key):  # the second tensor's write fails: the temp file is half written at that point
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(v, key)

    monkeypatch.setattr(io, "_host_array", interrupted)
    with pytest.raises(KeyboardInterrupt):
        flame.save({"a": flame.zeros(3), "b": flame.zeros(4)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.safetensors"]
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(flame.load(path)["a"].numpy(), [1.0, 1.0, 1.0])


def _crafted(path, structure, tensors=None):
    """A file whose structure metadata was written by hand (not by save): what an untrusted file may hold."""
    io.save_file(tensors or {"x": np.zeros(1 << 16, np.float32)}, path,  # 256 KiB
                 metadata={"flame.serialization": "1",
                           "flame.structure": structure if isinstance(structure, str) else json.dumps(structure)})


def test_load_of_one_tensor_referenced_many_times_shares_it(tmp_path):
    """1000 references to one 256 KiB tensor load as one Tensor (one array), not 1000 copies (256 MB)."""
    import tracemalloc
    path = tmp_path / "many.safetensors"
    _crafted(path, {"L": [{"t": "x"}] * 1000})
    tracemalloc.start()
    try:
        back = flame.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(back) == 1000 and len({id(t) for t in back}) == 1
    assert peak < 8 * (1 << 18), peak  # a few copies of the tensor at most, not one per reference


def test_load_refuses_aliasing_that_save_never_writes(tmp_path):
    cases = {
        "array_twice": ({"L": [{"a": "x"}] * 1000}, "refers to the array 'x' more than once"),
        "array_and_tensor": ({"L": [{"t": "x"}, {"a": "x"}]}, "both as an array and as a tensor"),
        "tensor_two_ways": ({"L": [{"t": "x"}, {"t": "x", "g": 1}]}, "twice with different devices"),
        "void_scalar": ({"n": "|V8", "v": 10 ** 9}, "NumPy scalar of dtype '|V8'"),  # np.void(10**9): 1 GB
        "bad_pairs": ({"D": [[1, 2, 3]]}, "corrupt flame.structure metadata"),
        "unhashable_key": ({"D": [[{"L": []}, 1]]}, "corrupt flame.structure metadata"),
        "deep": ('{"L": [' * 5000 + "]}" * 5000, "corrupt flame.structure metadata"),  # past the stack
    }
    for name, (structure, pattern) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        _crafted(path, structure)
        with pytest.raises(io.SafetensorsError, match=pattern) as e:
            flame.load(path)
        assert str(path) in str(e.value), name
    ok = tmp_path / "ok.safetensors"  # one reference to an array, as save writes it, still loads
    _crafted(ok, {"L": [{"a": "x"}, {"n": "<f4", "v": 1.5}]})
    arr, scalar = flame.load(ok)
    assert arr.shape == (1 << 16,) and scalar == np.float32(1.5) and type(scalar) is np.float32
