"""The safetensors parser against the reference `safetensors` package on crafted headers: whatever its safe_open
refuses, ours refuses at open time as SafetensorsError naming the file; whatever it accepts, ours reads with the same
keys, shapes and values. Two deliberate differences, both refusals: a key repeated in a JSON object (the reference
silently keeps the last entry) and dtypes FLAME has no array type for (C64, F8_E8M0, F4, ...; not generated here)."""
import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open as ref_open

from flame_core import io
from flame_core.errors import SafetensorsError

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
         "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
NUMPY_READABLE = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
ODD_NUMBERS = [-1, 1.0, True, None, "2", 2 ** 32, 2 ** 63, 2 ** 64, 1 << 70]


def _dump(v):
    return json.dumps(v, separators=(",", ":"))


@st.composite
def crafted_files(draw):
    """(file bytes, has a duplicated key): a valid header and data, or (half the time) one with defects drawn in."""
    clean = draw(st.booleans())

    def chance(n):  # a defect with probability about 1/n, never in a clean file
        return not clean and draw(st.integers(0, n - 1)) == 0

    n = draw(st.integers(0, 4))
    names = draw(st.lists(st.sampled_from(["a", "b", "c.weight", "d", "é", "__x__"]), min_size=n, max_size=n,
                          unique=True))
    if names and chance(6):
        names.append(names[0])
    dtypes = [draw(st.sampled_from(sorted(SIZES) + (["Q8", "f32", ""] if chance(8) else []))) for _ in names]
    shapes = [draw(st.lists(st.integers(0, 3), max_size=3)) for _ in names]
    for s in shapes:  # some shape dimension made odd: negative, float, bool, huge (overflow), ...
        if s and chance(6):
            s[draw(st.integers(0, len(s) - 1))] = draw(st.sampled_from(ODD_NUMBERS))
    offsets, end = [], 0
    for dt, s in zip(dtypes, shapes):
        count = 1
        for d in s:
            count *= d if type(d) is int and d >= 0 else 1
        size = count * SIZES.get(dt, 1) if count < 64 else 0
        offsets.append([end, end + size])
        end += size
    for o in offsets:  # offsets moved, of the wrong length or type, reversed
        if chance(6):
            k = draw(st.integers(0, 3))
            if k == 0:
                o[draw(st.integers(0, 1))] += draw(st.sampled_from([-1, 1, 4]))
            elif k == 1:
                o.append(o[1])
            elif k == 2:
                o[1] = float(o[1])
            else:
                o.reverse()
    if len(offsets) >= 2 and chance(6):
        offsets[0], offsets[1] = offsets[1], offsets[0]
    pairs = []
    meta = draw(st.sampled_from([None, "absent", {"format": "pt"}, {"k": "v", "n": "2"}]
                                + ([{"x": 1}, ["a"]] if chance(6) else [])))
    if meta != "absent":
        pairs.append(("__metadata__", _dump(meta)))
    for name, dt, s, o in zip(names, dtypes, shapes, offsets):
        entry = {"dtype": dt, "shape": s, "data_offsets": o}
        if draw(st.integers(0, 5)) == 0:
            entry["extra"] = [1, {"z": None}]  # unknown fields are ignored by the reference
        if chance(12):
            del entry[draw(st.sampled_from(sorted(entry)))]
        if chance(12):
            entry = draw(st.sampled_from([1, "x", [], None]))
        pairs.append((name, _dump(entry)))
    text = "{" + ",".join(f"{_dump(k)}:{v}" for k, v in pairs) + "}"
    if draw(st.integers(0, 4)) == 0:
        text = draw(st.sampled_from([" ", "\n", "\t"])) + text + "  "  # whitespace is allowed around the object
    if chance(10):
        text = text[:draw(st.integers(0, len(text)))]  # cut JSON
    if chance(10):
        text += draw(st.sampled_from(["x", "\0", "{}", "NaN"]))
    if chance(10):
        text = text.replace('"format":"pt"', '"format":NaN')
    raw = text.encode("utf-8")
    data_len = max([o[-1] for o in offsets if o and type(o[-1]) is int] + [0])
    if chance(6):
        data_len = max(0, data_len + draw(st.sampled_from([1, -1, 8])))
    data = bytes(draw(st.integers(0, 255)) for _ in range(min(data_len, 8))) * (data_len // 8 + 1)
    header_len = len(raw) + (draw(st.sampled_from([1, -1, 10 ** 8 + 1])) if chance(10) else 0)
    blob = struct.pack("<Q", max(header_len, 0)) + raw + data[:data_len]
    if chance(20):
        blob = blob[:draw(st.integers(0, 12))]
    keys = [k for k, _ in pairs]
    return blob, len(set(keys)) != len(keys)


def _reference(path):
    """(keys -> (shape, dtype, values or None)) the reference reads, or None when it refuses the file."""
    try:
        with ref_open(path, framework="numpy") as f:
            out, names = {}, f.keys()
            for k in names:
                dt = f.get_slice(k).get_dtype()
                out[k] = (tuple(f.get_slice(k).get_shape()), dt, f.get_tensor(k) if dt in NUMPY_READABLE else None)
            return out
    except Exception as e:  # the reference raises SafetensorError, OSError, ... on a bad file
        if type(e).__name__ != "SafetensorError":
            raise
        return None


@settings(max_examples=300)
@given(crafted_files())
def test_refuses_what_the_reference_refuses_and_reads_what_it_reads(case):
    blob, duplicated = case
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "crafted.safetensors")
        with open(path, "wb") as fh:
            fh.write(blob)
        ref = _reference(path)
        if ref is None or duplicated:
            with pytest.raises(SafetensorsError) as e:
                io.safe_open(path).close()
            assert path in str(e.value)
            return
        with io.safe_open(path) as f:
            assert sorted(f.keys()) == sorted(ref)
            for k, (shape, dt, values) in ref.items():
                assert f.shape(k) == shape and f.dtype(k) == io._TO_NP[dt], k
                got = f.get_array(k)
                if values is not None:
                    np.testing.assert_array_equal(got, values, err_msg=k)
                else:  # bfloat16 / float8: the reference's numpy reader has no such dtype; its bytes are the file's
                    assert got.dtype == io._TO_NP[dt] and got.shape == shape


def _file(path, text, data=b""):
    raw = text.encode() if isinstance(text, str) else text
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("text, data, pattern", [
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
     b"\1", "the key 'a' appears twice"),
    ('{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}', b"", "more elements than"),
    ('{"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}}', b"", "more bytes than"),
    ('{"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}', b"\1\1", "not a list of non-negative integers"),
    ('{"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}}', b"\1\1", "not a list of non-negative integers"),
    ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2.0]}}', b"\1\1", "are not two non-negative integers"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}',
     b"\1\1\1", "'b' begins at byte 2 of the data section: a gap of 1 bytes after 'a'"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\1\1", "1 bytes after the last tensor"),
    ('{"a":[1]}', b"", "corrupt header entry for 'a'"),
    ('{"__metadata__":{"x":NaN}}', b"", "not valid JSON"),
])
def test_refusals_name_the_file_and_key(tmp_path, text, data, pattern):
    path = _file(tmp_path / "bad.safetensors", text, data)
    with pytest.raises(SafetensorsError, match=pattern) as e:
        io.safe_open(path)
    assert str(path) in str(e.value)
    if "twice" not in pattern:  # the reference keeps the last of repeated keys; every other case it refuses too
        assert _reference(str(path)) is None
