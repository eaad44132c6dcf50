"""safetensors files: `save_file` (atomic), `load_file`, and `safe_open` for lazy reads; `atomic_write`, the one
way FLAME writes any file (temp file beside it, fsync, rename, fsync of the folder: a crash or power cut leaves the
old file or the new one, never half of one), and `write_json` on top of it.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}` padded with spaces, then the
raw little-endian C-order bytes of every tensor, back to back. We read and write it ourselves (a few lines) so that
bfloat16 / float8 work with any `safetensors` version and big files stream one tensor at a time: a read maps the file
and copies only the selected tensors, converting each to the target dtype and device on load.

Files from elsewhere are untrusted: opening one checks its header as the reference library does (header size, JSON,
dtypes, integer shapes and offsets, 64-bit overflow, offsets matching shape x dtype, tensors tiling the data section
with no gap, overlap or trailing byte) and refuses it as `SafetensorsError` naming the file and the key. Stricter than
the reference: a key repeated in a JSON object (it keeps the last) and dtypes FLAME has no array type for.

`flame_core.save` / `flame_core.load` (serialization.py) are the torch.save / torch.load-shaped entry points on top
of this: nested containers and state dicts, the structure kept in the metadata.
"""
import contextlib
import json
import mmap
import os
import tempfile

import ml_dtypes
import numpy as np

from . import backend
from . import dtypes as D
from .device import device as _parse_device
from .errors import DTypeError, SafetensorsError

MAX_HEADER = 100_000_000  # bytes of JSON header, the reference library's limit
_U64 = 1 << 64  # sizes and offsets are u64 in the reference implementation

_TO_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}
_TO_NP = {k: np.dtype(v) for k, v in _TO_NP.items()}
_TO_ST = {v: k for k, v in _TO_NP.items()}

__all__ = ["Deferred", "SafetensorsError", "atomic_write", "convert", "load_file", "load_metadata", "safe_open",
           "save_file"]


# ----------------------------------------------------------------------------- array conversion
def _dev(device):
    return None if device is None else _parse_device(device)


def convert(arr, np_dtype=None, device=None, f8=False):
    """(array, is_fp8_bytes): `arr` as `np_dtype` on `device` (None keeps either); `arr` itself when nothing changes.

    Follows the core's conversion (flame_core.ops.conversion): float8 on cuda is raw bytes in a uint8 array (`f8`
    True, as `Tensor._f8`); casts run on the GPU after the move when the target is cuda.
    """
    from .ops.conversion import _convert
    return _convert(arr, f8, _dev(device), None if np_dtype is None else np.dtype(np_dtype), False)


def _st_dtype(dt, key):
    """safetensors name of a NumPy dtype (byte order normalised: files are little-endian)."""
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    st = _TO_ST.get(dt)
    if st is None:
        raise DTypeError(f"save_file: {key!r} has dtype {dt}, which safetensors cannot store")
    return st


def _host_array(v, key):
    """The host (NumPy) array to write for a Tensor (fp8 bytes viewed as float8) or a NumPy/CuPy array."""
    from .tensor import Tensor
    a = v._host() if isinstance(v, Tensor) else backend.to_numpy(v)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)   # (ascontiguousarray makes a 0-d array 1-d)


# ----------------------------------------------------------------------------- writing
class Deferred:
    """A tensor that save_file writes without it being in memory before its turn: its dtype and shape go into the
    header, its values come from `make()` (a NumPy / CuPy array or Tensor of exactly that dtype and shape) when it
    is written -- so a whole checkpoint can be rewritten one tensor at a time."""
    __slots__ = ("dtype", "shape", "make")

    def __init__(self, dtype, shape, make):
        self.dtype, self.shape, self.make = np.dtype(dtype), tuple(int(n) for n in shape), make


def _header(entries, metadata):
    """JSON header bytes (padded to 8) for entries [(name, st_dtype, shape, nbytes)]."""
    h, off = {}, 0
    if metadata:
        h["__metadata__"] = metadata
    for name, st, shape, nbytes in entries:
        h[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw


def save_file(tensors, filename, metadata=None):
    """Write `tensors` (name -> Tensor / NumPy / CuPy array / Deferred) to `filename` atomically, one tensor at a
    time."""
    from .tensor import Tensor
    if not hasattr(tensors, "items"):
        raise TypeError(f"save_file expects a dict of name -> tensor, got {type(tensors).__name__}")
    if metadata is not None:
        bad = [(k, v) for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise TypeError(f"save_file: metadata must map str -> str; offending entries: {bad[:5]}")
        metadata = dict(metadata)
    entries, order = [], []
    for k, v in tensors.items():
        if not isinstance(k, str):
            raise TypeError(f"save_file: tensor names must be str, got {k!r}")
        if k == "__metadata__":
            raise ValueError("save_file: '__metadata__' is reserved; pass metadata=...")
        if isinstance(v, Tensor):
            dt, shape = v.dtype.np, tuple(v.shape)
        elif isinstance(v, Deferred):
            dt, shape = v.dtype, v.shape
        elif backend.is_cuda_array(v) or isinstance(v, np.ndarray):
            dt, shape = v.dtype, v.shape
        else:
            raise TypeError(f"save_file: value of {k!r} must be a Tensor or an array, got {type(v).__name__}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        entries.append((k, _st_dtype(dt, k), shape, nbytes))
        order.append((k, v))
    header = _header(entries, metadata)
    with atomic_write(filename) as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for k, v in order:  # one host copy at a time: a GPU model never sits in host memory whole
            if isinstance(v, Deferred):
                made = v.make()
                a = _host_array(made, k)
                if a.dtype != v.dtype or a.shape != v.shape:
                    raise ValueError(f"save_file: {k!r} was declared {v.dtype} {v.shape} but made {a.dtype} "
                                     f"{a.shape}")
                del made
            else:
                a = _host_array(v, k)
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
            del a


@contextlib.contextmanager
def atomic_write(path, mode="wb", **open_kwargs):
    """A temporary file beside `path`, opened in `mode` (and `open_kwargs`, e.g. encoding) with the permissions
    open() would give it; on a clean exit it is flushed, fsynced and renamed over `path` and the folder is fsynced,
    on an exception removed: `path` is never left half-written."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes the file 0600
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)  # the rename itself is only durable once the folder's entry is on disk


def fsync_dir(folder):
    """Make a rename or a new entry in `folder` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path, obj, *, indent=2, **json_kwargs):
    """`obj` as JSON (json.dumps with `indent` and `json_kwargs`) written to `path` through atomic_write; returns
    `path`. The whole text is made first: an object JSON cannot encode leaves `path` untouched."""
    text = json.dumps(obj, indent=indent, **json_kwargs)
    with atomic_write(path) as f:
        f.write(text.encode("utf-8"))
    return os.fspath(path)


def _umask():
    """The process umask, read without changing it where the OS allows (os.umask can only set, so the fallback sets
    it back at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- reading
def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


class _Duplicate(Exception):
    pass


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _u64(x):
    return type(x) is int and 0 <= x < _U64  # not bool, not float: the reference reads usize


def parse_header(raw, data_len, err):
    """(metadata or None, {name: (st_dtype, shape, begin, end)}) from the JSON header bytes `raw` of a file whose
    data section has `data_len` bytes; anything the reference library rejects raises err(message) (the message
    names the key). Also refused, stricter than the reference: a key repeated in any JSON object (the reference
    keeps the last tensor entry of a repeated name), and dtypes FLAME has no array type for."""
    try:
        h = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _Duplicate as e:
        raise err(f"corrupt header: the key {e.args[0]!r} appears twice in one JSON object") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise err(f"corrupt header: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(h, dict):
        raise err(f"corrupt header: the JSON is a {type(h).__name__}, not an object")
    meta = h.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise err("corrupt header: __metadata__ must map str -> str")
    entries = {}
    for k, e in h.items():
        entries[k] = _entry(k, e, err)
    # the tensors tile the data section: sorted by offsets, each begins where the previous ended, the last ends at
    # the end of the file (no gap, no overlap, no trailing bytes)
    end, prev = 0, None
    for b, e, k in sorted((b, e, k) for k, (_, _, b, e) in entries.items()):
        if b != end:
            what = (f"a gap of {b - end} bytes after {prev!r}" if prev and b > end else
                    f"it overlaps {prev!r}" if prev else f"the first tensor must begin at 0, not {b}")
            raise err(f"corrupt header: tensor {k!r} begins at byte {b} of the data section: {what}")
        end, prev = e, k
    if end != data_len:
        if end > data_len:
            raise err(f"truncated file: tensor {prev!r} ends at byte {end} of the data section, which has only "
                      f"{data_len} bytes")
        raise err(f"corrupt file: {data_len - end} bytes after the last tensor"
                  + (f" ({prev!r}, ending at byte {end})" if prev else "") + " that no tensor covers")
    return meta, entries


def _entry(key, e, err):
    """(st_dtype, shape, begin, end) of the header entry `e` of tensor `key`, checked as the reference checks it."""
    if not isinstance(e, dict) or not all(f in e for f in ("dtype", "shape", "data_offsets")):
        raise err(f"corrupt header entry for {key!r}: {str(e)[:200]} (needs dtype, shape and data_offsets)")
    st, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(st, str) or st not in _TO_NP:
        raise err(f"tensor {key!r} has unknown dtype {st!r} (known: {', '.join(_TO_NP)})")
    if not (isinstance(shape, list) and all(_u64(s) for s in shape)):
        raise err(f"tensor {key!r}: shape {str(shape)[:200]} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_u64(o) for o in offsets)):
        raise err(f"tensor {key!r}: data_offsets {str(offsets)[:200]} are not two non-negative integers")
    count = 1
    for s in shape:  # in order, as the reference's checked multiplication
        count *= s
        if count >= _U64:
            raise err(f"tensor {key!r}: shape {shape} has more elements than a 64-bit count holds")
    want = count * _TO_NP[st].itemsize
    if want >= _U64:
        raise err(f"tensor {key!r}: shape {shape} of {st} needs more bytes than a 64-bit size holds")
    b, end = offsets
    if end < b:
        raise err(f"tensor {key!r}: data_offsets [{b}, {end}] end before they begin")
    if end - b != want:
        raise err(f"tensor {key!r}: shape {shape} of {st} needs {want} bytes but its offsets [{b}, {end}] span "
                  f"{end - b}")
    return st, tuple(shape), b, end


class safe_open:
    """Lazy reader: `with safe_open(path) as f: f.keys(); f.get_tensor(k, dtype=..., device=...)`.

    Only the header is parsed on open; each get_* maps just that tensor's bytes and converts it.
    `framework` is accepted for compatibility with the safetensors package and must be "flame" or "numpy".
    """

    def __init__(self, filename, framework="flame", device=None):
        if framework not in ("flame", "numpy", "np"):
            raise ValueError(f"safe_open: framework must be 'flame' or 'numpy', got {framework!r}")
        self.filename = os.fspath(filename)
        self._device = _dev(device)
        self._file = open(self.filename, "rb")
        try:
            self._parse()
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise

    def _err(self, msg):
        return SafetensorsError(f"{self.filename}: {msg}")

    def _parse(self):
        size = os.fstat(self._file.fileno()).st_size
        if size < 8:
            raise self._err(f"not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(self._file.read(8), "little")
        if n > MAX_HEADER:
            raise self._err(f"corrupt header: it claims {n} bytes, more than the {MAX_HEADER} safetensors allows "
                            f"(not a safetensors file?)")
        if 8 + n > size:
            raise self._err(f"corrupt header: it claims {n} bytes but the file has {size - 8} after the length "
                            f"field (truncated or not a safetensors file)")
        self._start = 8 + n
        self._metadata, self._entries = parse_header(self._file.read(n), size - self._start, self._err)

    # --- queries    # --- queries
    def keys(self):
        return list(self._entries)

    def metadata(self):
        return dict(self._metadata) if self._metadata is not None else None

    def _entry(self, key):
        try:
            return self._entries[key]
        except KeyError:
            near = [k for k in self._entries if key.split(".")[-1] in k][:5]
            raise KeyError(f"{self.filename}: no tensor named {key!r} ({len(self._entries)} keys"
                           + (f"; similar: {near}" if near else "") + ")") from None

    def shape(self, key):
        return self._entry(key)[1]

    def dtype(self, key):
        """The NumPy dtype stored for `key` (bfloat16 / float8 from ml_dtypes)."""
        return _TO_NP[self._entry(key)[0]]

    def read(self, key, dtype=None, device=None):
        """(array, is_fp8_bytes) of tensor `key`, fresh (never a view of the file), converted to `dtype` / `device`;
        float8 on cuda comes back as raw bytes in a uint8 array with the flag set (the core's convention)."""
        st, shape, b, end = self._entry(key)
        dev = _dev(device) or self._device
        want = None if dtype is None else D.dtype(dtype).np
        view = np.frombuffer(self._mm, dtype=_TO_NP[st], count=(end - b) // _TO_NP[st].itemsize,
                             offset=self._start + b).reshape(shape)
        try:
            arr, f8 = convert(view, want, dev)
            if isinstance(arr, np.ndarray) and not arr.flags.owndata:
                arr = arr.copy()
        finally:
            del view
        return arr, f8

    def get_array(self, key, dtype=None, device=None):
        """The tensor `key` as a fresh NumPy (cpu) or CuPy (cuda) array, converted to `dtype` when given."""
        return self.read(key, dtype, device)[0]

    def get_tensor(self, key, dtype=None, device=None):
        from .tensor import _wrap
        arr, f8 = self.read(key, dtype, device)
        if not f8 and arr.dtype not in D._BY_NP:
            raise DTypeError(f"{self.filename}: {key!r} is stored as {arr.dtype}, which FLAME has no dtype for; "
                             f"pass dtype=... to convert it on load")
        t = _wrap(arr)
        if f8:
            t._f8 = True
        return t

    # --- lifetime
    def close(self):
        if getattr(self, "_mm", None) is not None:
            self._mm.close()
            self._mm = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def load_file(filename, device=None, dtype=None, keys=None):
    """name -> Tensor for all tensors (or only `keys`), each converted to `dtype` (floating ones) and `device`."""
    out = {}
    with safe_open(filename) as f:
        names = f.keys() if keys is None else list(keys)
        for k in names:
            dt = dtype if (dtype is not None and f.dtype(k).kind in "fV") else None
            out[k] = f.get_tensor(k, dtype=dt, device=device)
    return out


def load_metadata(filename):
    """The `__metadata__` dict of a file (None when absent), reading only the header."""
    with safe_open(filename) as f:
        return f.metadata()
