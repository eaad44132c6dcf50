"""Writing and reading small safetensors files in the LoRA-file tool tests (test_resize_merge, test_extract,
test_bake): NumPy arrays in, NumPy arrays and the metadata out."""
import numpy as np

from flame_core import io


def write(path, sd, metadata=None):
    io.save_file({k: np.asarray(v) for k, v in sd.items()}, str(path), metadata=metadata)
    return str(path)


def read(path):
    with io.safe_open(str(path)) as f:
        return {k: f.get_array(k) for k in f.keys()}, dict(f.metadata() or {})
