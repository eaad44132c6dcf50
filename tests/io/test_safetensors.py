"""flame_core.io: safetensors round trips in every dtype, interop with the safetensors package, lazy selected-key reads
with conversion on load, metadata, atomic writes, and clear errors for corrupt or mismatched files."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open as st_safe_open
from safetensors.numpy import save_file as st_save_file

import flame_core as flame
from flame_core import io


def _tensors(device):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": flame.tensor(base, device=device),
        "f64": flame.tensor(base.astype(np.float64), device=device),
        "f16": flame.tensor(base, dtype=flame.float16, device=device),
        "bf16": flame.tensor(base, dtype=flame.bfloat16, device=device),
        "fp8": flame.tensor(np.clip(base, -4, 4).astype(ml_dtypes.float8_e4m3fn)),
        "i64": flame.tensor(rng.integers(-9, 9, (4,)), device=device),
        "i32": flame.tensor(rng.integers(-9, 9, (2, 2)), dtype=flame.int32, device=device),
        "bool": flame.tensor([True, False, True], device=device),
        "scalar": flame.tensor(3.5, device=device),
        "empty": flame.zeros(0, 7, device=device),
    }


def _bits(t):
    """The raw bytes of a tensor, to compare bit for bit (NaN-safe, any dtype)."""
    return np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)


def test_roundtrip_every_dtype_bit_exact(tmp_path, device):
    ts = _tensors(device)
    path = tmp_path / "all.safetensors"
    io.save_file(ts, path, metadata={"format": "pt", "step": "12"})
    back = io.load_file(path)
    assert list(back) == list(ts)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and tuple(back[k].shape) == tuple(t.shape), k
        np.testing.assert_array_equal(_bits(back[k]), _bits(t), err_msg=k)
    assert io.load_metadata(path) == {"format": "pt", "step": "12"}


def test_header_layout_is_standard(tmp_path):
    path = tmp_path / "h.safetensors"
    io.save_file({"a": flame.zeros(2, 3), "b": flame.ones(4, dtype=flame.bfloat16)}, path, metadata={"k": "v"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"k": "v"}
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}
    assert len(raw) == 8 + n + 32


def test_safetensors_package_reads_our_files(tmp_path, device):
    ts = _tensors(device)
    del ts["fp8"]  # the package's numpy backend has no float8
    path = tmp_path / "ours.safetensors"
    io.save_file(ts, path, metadata={"m": "1"})
    with st_safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"m": "1"}
        assert sorted(f.keys()) == sorted(ts)
        for k in ts:
            a = np.ascontiguousarray(f.get_tensor(k)).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(a, _bits(ts[k]), err_msg=k)


def test_we_read_the_packages_files(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {"w": rng.standard_normal((6, 2)).astype(np.float32), "h": rng.standard_normal(5).astype(np.float16),
              "b": rng.standard_normal(3).astype(ml_dtypes.bfloat16), "i": np.arange(4, dtype=np.int64)}
    path = tmp_path / "theirs.safetensors"
    st_save_file(arrays, str(path), metadata={"who": "safetensors"})
    back = io.load_file(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k].numpy().view(np.uint8), a.view(np.uint8), err_msg=k)
    assert io.load_metadata(path) == {"who": "safetensors"}


def test_lazy_selected_keys_with_conversion(tmp_path, device):
    path = tmp_path / "big.safetensors"
    w = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    io.save_file({"w": flame.tensor(w), "skip": flame.zeros(1000, 1000), "n": flame.arange(5)}, path)
    with io.safe_open(path) as f:
        assert f.keys() == ["w", "skip", "n"]
        assert f.shape("skip") == (1000, 1000) and f.dtype("w") == np.float32
        t = f.get_tensor("w", dtype=flame.bfloat16, device=device)
        assert t.dtype == flame.bfloat16 and t.device == flame.device(device)
        np.testing.assert_array_equal(t.float().numpy(), w.astype(ml_dtypes.bfloat16).astype(np.float32))
        a = f.get_array("w")
        a[0, 0] = 99.0  # a private copy: the file is untouched
    with io.safe_open(path) as f:
        assert f.get_array("w")[0, 0] == w[0, 0]
    sel = io.load_file(path, keys=["n", "w"], dtype=flame.float16, device=device)
    assert list(sel) == ["n", "w"]
    assert sel["n"].dtype == flame.int64  # only floating tensors change dtype
    assert sel["w"].dtype == flame.float16


def test_fp8_converts_on_load(tmp_path):
    vals = np.array([0.5, -1.0, 2.0, 448.0], dtype=np.float32)
    path = tmp_path / "f8.safetensors"
    io.save_file({"q": flame.tensor(vals.astype(ml_dtypes.float8_e4m3fn))}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8:8 + n])["q"]["dtype"] == "F8_E4M3"
    t = io.load_file(path, dtype=flame.float32)["q"]
    np.testing.assert_array_equal(t.numpy(), vals)


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    io.save_file({"a": flame.ones(3)}, path)
    before = path.read_bytes()

    class Exploding(dict):
        def items(self):
            yield "a", flame.zeros(3)
            yield "b", object()  # rejected while the temp file is being prepared

    with pytest.raises(TypeError, match="'b'"):
        io.save_file(Exploding(), path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]  # no temp file left behind


def test_deferred_tensors_are_made_one_at_a_time(tmp_path):
    """io.Deferred: the header from the declared dtype and shape, the values made when their turn comes (after the
    tensors before them are written); a made array that breaks its declaration aborts the save, leaving no file."""
    made = []

    def maker(name, value):
        def make():
            made.append(name)
            return value
        return make
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones(4, dtype=ml_dtypes.bfloat16)
    path = tmp_path / "d.safetensors"
    io.save_file({"a": io.Deferred(np.float32, (2, 3), maker("a", a)), "plain": np.zeros(2, np.int64),
                  "b": io.Deferred(ml_dtypes.bfloat16, (4,), maker("b", b))}, path)
    assert made == ["a", "b"]
    with st_safe_open(str(path), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("a"), a)
        assert f.get_tensor("plain").tolist() == [0, 0]
    with io.safe_open(path) as f:
        np.testing.assert_array_equal(f.get_array("b").astype(np.float32), np.ones(4, np.float32))
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match=r"'a' was declared float32 \(3, 2\) but made float32 \(2, 3\)"):
        io.save_file({"a": io.Deferred(np.float32, (3, 2), lambda: a)}, bad)
    assert not bad.exists() and sorted(os.listdir(tmp_path)) == ["d.safetensors"]


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="str -> str"):
        io.save_file({"a": flame.ones(1)}, tmp_path / "x.safetensors", metadata={"k": 1})
    with pytest.raises(ValueError, match="reserved"):
        io.save_file({"__metadata__": flame.ones(1)}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="names must be str"):
        io.save_file({1: flame.ones(1)}, tmp_path / "x.safetensors")


def _write_raw(path, header, data=b""):
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


@pytest.mark.parametrize("case, pattern", [
    ("short", "not a safetensors file"),
    ("huge_header", "corrupt header"),
    ("bad_json", "not valid JSON"),
    ("bad_dtype", "unknown dtype 'Q7'"),
    ("size_mismatch", "needs 24 bytes"),
    ("truncated", "truncated file"),
    ("overlap", "overlap"),
    ("bad_entry", "corrupt header entry"),
])
def test_corrupt_files_raise_clear_errors(tmp_path, case, pattern):
    path = tmp_path / f"{case}.safetensors"
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_header":
        path.write_bytes((10 ** 6).to_bytes(8, "little") + b"{}")
    elif case == "bad_json":
        path.write_bytes((5).to_bytes(8, "little") + b"{nope")
    elif case == "bad_dtype":
        _write_raw(path, {"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    elif case == "size_mismatch":
        _write_raw(path, {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, b"\0" * 20)
    elif case == "truncated":
        _write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 10)
    elif case == "overlap":
        _write_raw(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    elif case == "bad_entry":
        _write_raw(path, {"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
    with pytest.raises(io.SafetensorsError, match=pattern) as e:
        io.load_file(path)
    assert str(path) in str(e.value)


def test_missing_key_error_names_file_and_neighbours(tmp_path):
    path = tmp_path / "k.safetensors"
    io.save_file({"blocks.0.attn.weight": flame.ones(1), "blocks.0.mlp.weight": flame.ones(1)}, path)
    with io.safe_open(path) as f:
        with pytest.raises(KeyError, match="no tensor named 'blocks.1.attn.weight'.*similar"):
            f.get_tensor("blocks.1.attn.weight")
    with pytest.raises(FileNotFoundError):
        io.load_file(tmp_path / "absent.safetensors")


@pytest.mark.gpu
def test_fp8_on_cuda_roundtrip_and_conversion(tmp_path):
    """cuda float8 is raw bytes in a uint8 array flagged _f8 (the core's convention): saved as F8_E4M3, loaded back as
    such, or converted on the GPU."""
    vals = np.array([0.5, -1.0, 2.0, 448.0, -0.015625], dtype=np.float32)
    q = flame.tensor(vals, device="cuda").to(flame.float8_e4m3fn)
    assert q.dtype == flame.float8_e4m3fn
    path = tmp_path / "f8cuda.safetensors"
    io.save_file({"q": q}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8:8 + n])["q"] == {"dtype": "F8_E4M3", "shape": [5], "data_offsets": [0, 5]}
    back = io.load_file(path, device="cuda")["q"]
    assert back.dtype == flame.float8_e4m3fn and back.device.type == "cuda"
    np.testing.assert_array_equal(back.float().numpy(), vals)
    as_bf16 = io.load_file(path, device="cuda", dtype=flame.bfloat16)["q"]
    assert as_bf16.dtype == flame.bfloat16
    np.testing.assert_array_equal(as_bf16.float().numpy(), vals)


def test_atomic_write_fsyncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    # the rename is durable only once the folder's entry is on disk: the folder is fsynced after os.replace
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")) else "file"))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.basename(b)))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with io.atomic_write(tmp_path / "out.bin") as f:
        f.write(b"whole")
    assert events == [("fsync", "file"), ("replace", "out.bin"), ("fsync", "dir")]
    assert (tmp_path / "out.bin").read_bytes() == b"whole"
    events.clear()
    assert io.write_json(tmp_path / "a.json", {"v": 1}) == str(tmp_path / "a.json")
    assert events == [("fsync", "file"), ("replace", "a.json"), ("fsync", "dir")]


def test_atomic_write_leaves_nothing_when_the_writer_raises(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="half-way"):
        with io.atomic_write(path) as f:
            f.write(b"partial")
            raise RuntimeError("half-way")
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["state.json"]
    with pytest.raises(RuntimeError):
        with io.atomic_write(tmp_path / "new.bin") as f:
            f.write(b"partial")
            raise RuntimeError("half-way")
    assert sorted(os.listdir(tmp_path)) == ["state.json"]  # no temp file, no half-written new file
    with pytest.raises(TypeError):
        io.write_json(path, {"v": object()})
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["state.json"]
