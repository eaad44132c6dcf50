"""flame_core.save / flame_core.load: the PyTorch-shaped entry points (torch.save / torch.load) on safetensors.

`save(obj, path)` writes every tensor of `obj` as a safetensors entry (through `flame_core.io.save_file`: temp file,
fsync, rename) and the container structure around them as JSON in the file's metadata. Nothing is pickled, so a
file from anywhere can be loaded without running code. `obj` may nest dicts (any hashable keys of the kinds
below; OrderedDict is kept), lists and tuples of: Tensors (dtype, device and requires_grad are kept; the same
Tensor object twice is stored once and loads as one object), NumPy arrays and scalars, int, float (inf / NaN
too), str, bool, None, flame dtypes and devices. A state dict {name: tensor} becomes an ordinary safetensors
state dict whose entry names are its keys, readable by any safetensors tool.

`load(path, map_location=None)` gives the saved object back. A safetensors file not written by `save` (or of an
unknown structure version) loads as a plain dict {name: tensor}. A pickle file (a torch.save .pt / .pth / .ckpt)
is refused with an explanation of how to convert it. The structure of a file from elsewhere is untrusted: load
accepts the aliasing save writes and no more (a tensor referenced many times loads once and is shared; an array
referenced twice, or a scalar of a non-numeric dtype, is refused), so a small file cannot make it allocate more than
its own tensors.
"""
import collections
import json
import math
import os
import warnings

import numpy as np

from . import backend
from . import dtypes as D
from .device import Device
from .device import device as _parse_device
from .errors import DeviceError, FlameError
from .io import SafetensorsError, safe_open, save_file
from .tensor import Tensor

STRUCTURE_KEY = "flame.structure"
VERSION_KEY = "flame.serialization"
VERSION = "1"
_PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle", ".tar")


class PickleFileError(FlameError, ValueError):
    """A pickle file (PyTorch's torch.save format) given to flame_core.load, which never unpickles."""


# ----------------------------------------------------------------------------- save
class _Encoder:
    """Walks `obj`, naming each tensor by its path ("model/layer.weight", "state/0/exp_avg") and returning the JSON
    structure that refers to the names."""

    def __init__(self):
        self.entries = {}   # file name -> Tensor / ndarray
        self.by_id = {}     # id(tensor) -> file name (a tensor met twice is stored once)

    def _name(self, path):
        base = "/".join(str(p) for p in path) or "tensor"
        name, n = base, 1
        while name in self.entries or name == "__metadata__":
            n += 1
            name = f"{base}#{n}"
        return name

    def encode(self, obj, path):
        if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
            if obj.dtype.kind not in "biuf":
                raise TypeError(f"save: the NumPy scalar at {_where(path)} has dtype {obj.dtype}; store it as a "
                                f"0-d array or a Python number")
            return {"n": obj.dtype.str, "v": self.encode(obj.item(), path)}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"f": repr(obj)}
        if isinstance(obj, Tensor):
            name = self.by_id.get(id(obj))
            if name is None:
                name = self.by_id[id(obj)] = self._name(path)
                self.entries[name] = obj
            node = {"t": name}
            if obj.is_cuda:
                node["d"] = str(obj.device)
            if obj.requires_grad:
                node["g"] = 1
            return node
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biuf" and obj.dtype not in (D.bfloat16.np, D.float8_e4m3fn.np):
                raise TypeError(f"save: the NumPy array at {_where(path)} has dtype {obj.dtype}, which safetensors "
                                f"cannot store")
            name = self._name(path)
            self.entries[name] = obj
            return {"a": name}
        if isinstance(obj, D.DType):
            return {"dt": obj.name}
        if isinstance(obj, Device):
            return {"dv": str(obj)}
        if type(obj) in (dict, collections.OrderedDict):
            items = []
            for k, v in obj.items():
                if isinstance(k, (Tensor, np.ndarray)) or not (k is None or isinstance(k, (bool, int, float, str,
                                                                                            tuple))):
                    raise TypeError(f"save: the dict at {_where(path)} has a key of type {type(k).__name__}; keys "
                                    f"must be str, int, float, bool, None or tuples of them")
                items.append([self.encode(k, path + ["<key>"]), self.encode(v, path + [k])])
            return {"OD" if type(obj) is collections.OrderedDict else "D": items}
        if type(obj) is list:
            return {"L": [self.encode(v, path + [i]) for i, v in enumerate(obj)]}
        if type(obj) is tuple:
            return {"U": [self.encode(v, path + [i]) for i, v in enumerate(obj)]}
        raise TypeError(f"save: cannot store a {type(obj).__module__}.{type(obj).__qualname__} at {_where(path)}: "
                        f"FLAME files hold tensors, NumPy arrays / scalars, int, float, str, bool, None, dtypes and "
                        f"devices in dicts, lists and tuples (nothing is pickled)")


def _where(path):
    return "obj" + "".join(f"[{p!r}]" for p in path)


def save(obj, f):
    """torch.save's counterpart: write `obj` (a state dict, or nested dicts / lists / tuples of tensors and plain
    values, see the module doc) to the path `f` as one safetensors file, atomically."""
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"save: f must be a file path (str or os.PathLike), got {type(f).__name__}; FLAME writes "
                        f"files atomically by renaming a finished temp file, which a file object does not allow")
    enc = _Encoder()
    structure = enc.encode(obj, [])
    meta = {"format": "pt",  # the tensors are plain little-endian arrays, what loaders of "pt" files expect
            VERSION_KEY: VERSION, STRUCTURE_KEY: json.dumps(structure, separators=(",", ":"))}
    save_file(enc.entries, f, metadata=meta)


# ----------------------------------------------------------------------------- load
def _check_not_pickle(path):
    with open(path, "rb") as fh:
        head = fh.read(8)
    zip_magic = head[:4] == b"PK\x03\x04"
    pickle_magic = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    if not (zip_magic or pickle_magic):
        return
    raise PickleFileError(
        f"{path}: this is a pickle file (PyTorch's torch.save format{', a zip archive' if zip_magic else ''}). "
        f"FLAME does not unpickle: loading a pickle can run arbitrary code. Convert it once to safetensors where "
        f"PyTorch is installed:\n"
        f"    import torch; from safetensors.torch import save_file\n"
        f"    sd = torch.load({os.fspath(path)!r}, map_location='cpu', weights_only=True)\n"
        f"    save_file({{k: v.contiguous() for k, v in sd.items()}}, 'model.safetensors')\n"
        f"(for a training checkpoint, save its state dict, e.g. sd['state_dict'] or sd['model']), then load that "
        f"file with flame_core.load or flame_core.io.load_file.")


def _target(map_location, saved):
    """The device a tensor saved on `saved` (a string) goes to."""
    if map_location is None:
        dev = _parse_device(saved)
    elif isinstance(map_location, dict):
        dev = _parse_device(map_location.get(saved, saved))
    else:
        dev = _parse_device(map_location)
    if dev.type == "cuda" and not backend.cuda_available():
        raise DeviceError(f"load: a tensor was saved on {saved} but no GPU is available here; pass "
                          f"map_location='cpu' to load it into host memory")
    return dev


class _Decoder:
    """Rebuilds the saved object. Aliasing is what `save` writes and no more: a tensor name ("t") may be referenced
    many times and loads as one shared Tensor (the same object saved twice), a NumPy array name ("a") once, and no
    name as both -- a crafted structure referencing one entry thousands of times cannot multiply memory."""

    def __init__(self, reader, path, map_location):
        self.f, self.path, self.map_location = reader, path, map_location
        self.names = set(reader.keys())
        self.loaded = {}  # "t" name -> (Tensor, the node that loaded it)
        self.arrays = set()  # "a" names already given out

    def _bad(self, msg):
        return SafetensorsError(f"{self.path}: {msg}")

    def decode(self, node):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, dict) and len(node) >= 1:
            if "t" in node:
                return self._shared_tensor(node)
            if "a" in node:
                return self._array(node["a"])
            if "f" in node:
                return float(node["f"])
            if "n" in node:
                return self._scalar(node)
            if "dt" in node:
                return D.dtype(node["dt"])
            if "dv" in node:
                return _parse_device(node["dv"])
            for tag, make in (("D", dict), ("OD", collections.OrderedDict)):
                if tag in node:
                    return make((self.decode(k), self.decode(v)) for k, v in node[tag])
            if "L" in node:
                return [self.decode(v) for v in node["L"]]
            if "U" in node:
                return tuple(self.decode(v) for v in node["U"])
        raise self._bad(f"corrupt {STRUCTURE_KEY} metadata: unexpected node {str(node)[:80]}")

    def _shared_tensor(self, node):
        name = node["t"]
        if name in self.arrays:
            raise self._bad(f"the {STRUCTURE_KEY} metadata refers to {name!r} both as an array and as a tensor "
                            f"(save never writes that)")
        if name not in self.loaded:
            self.loaded[name] = (self._tensor(name, node), node)
        t, first = self.loaded[name]
        if (node.get("d"), node.get("g")) != (first.get("d"), first.get("g")):
            raise self._bad(f"the {STRUCTURE_KEY} metadata refers to tensor {name!r} twice with different devices "
                            f"or requires_grad (save never writes that)")
        return t

    def _array(self, name):
        if not isinstance(name, str):
            raise self._bad(f"corrupt {STRUCTURE_KEY} metadata: array name {str(name)[:80]}")
        if name in self.loaded:
            raise self._bad(f"the {STRUCTURE_KEY} metadata refers to {name!r} both as an array and as a tensor "
                            f"(save never writes that)")
        if name in self.arrays:
            raise self._bad(f"the {STRUCTURE_KEY} metadata refers to the array {name!r} more than once (save writes "
                            f"each NumPy array once; a repeated reference would copy it again)")
        self.arrays.add(name)
        return self._entry(name, lambda: self.f.get_array(name, device="cpu"))

    def _scalar(self, node):
        """A NumPy scalar of a numeric dtype, as save writes (a void or string dtype could allocate what the file
        says, e.g. np.void(10**9))."""
        try:
            dt = np.dtype(node["n"])
        except (TypeError, ValueError):
            dt = None
        if dt is None or dt.kind not in "biuf":
            raise self._bad(f"corrupt {STRUCTURE_KEY} metadata: NumPy scalar of dtype {str(node['n'])[:40]!r} (save "
                            f"writes bool, int, uint and float scalars only)")
        value = self.decode(node.get("v"))
        if not isinstance(value, (bool, int, float)):
            raise self._bad(f"corrupt {STRUCTURE_KEY} metadata: NumPy {dt} scalar of value {str(value)[:40]!r}")
        return dt.type(value)

    def _entry(self, name, read):
        if name not in self.names:
            raise self._bad(f"the {STRUCTURE_KEY} metadata refers to a tensor {name!r} the file does not have")
        return read()

    def _tensor(self, name, node):
        dev = _target(self.map_location, node.get("d", "cpu"))
        t = self._entry(name, lambda: self.f.get_tensor(name, device=dev))
        if node.get("g") and t.dtype.is_floating_point:
            t.requires_grad_(True)
        return t


def load(f, map_location=None, *, weights_only=True):
    """torch.load's counterpart for files written by `save` (or any safetensors file: a plain dict of tensors).

    map_location: None (each tensor on the device it was saved from), a device ('cpu', 'cuda', 'cuda:1', a
    Device), or a dict mapping saved device strings to devices ({'cuda:0': 'cpu'}). weights_only may only be True:
    FLAME never unpickles, so there is nothing else to allow."""
    if weights_only is not True:
        raise ValueError("load: weights_only=False would allow unpickling arbitrary objects; FLAME never unpickles "
                         "(files hold tensors and plain values only), so leave weights_only at True")
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"load: f must be a file path (str or os.PathLike), got {type(f).__name__}")
    if map_location is not None and not isinstance(map_location, (str, Device, dict)):
        raise TypeError(f"load: map_location must be None, a device (str or Device) or a dict of device strings, "
                        f"got {type(map_location).__name__}")
    path = os.fspath(f)
    _check_not_pickle(path)
    try:
        reader = safe_open(path)
    except SafetensorsError as e:
        if path.lower().endswith(_PICKLE_SUFFIXES):
            raise PickleFileError(f"{path}: not a safetensors file ({e}); if it is a PyTorch checkpoint, convert it "
                                  f"to safetensors first (FLAME does not unpickle)") from e
        raise
    with reader:
        meta = reader.metadata() or {}
        raw = meta.get(STRUCTURE_KEY)
        version = meta.get(VERSION_KEY)
        if raw is not None and version != VERSION:
            warnings.warn(f"{path}: saved by a FLAME serialization version {version!r} this version does not know; "
                          f"loading it as a plain dict of tensors", stacklevel=2)
            raw = None
        if raw is None:
            return {k: _Decoder(reader, path, map_location)._tensor(k, {}) for k in reader.keys()}
        try:
            structure = json.loads(raw)
            return _Decoder(reader, path, map_location).decode(structure)
        except SafetensorsError:
            raise
        except (json.JSONDecodeError, RecursionError, TypeError, ValueError, KeyError) as e:
            # malformed nodes (a pair that is not one, an unhashable key, nesting deeper than Python's stack)
            raise SafetensorsError(f"{path}: corrupt {STRUCTURE_KEY} metadata ({type(e).__name__}: "
                                   f"{str(e)[:200]})") from None
