"""Training checkpoints on disk: written whole or not at all, verified before use, the newest valid one found.

A checkpoint is a folder <run>/checkpoints/step_NNNNNN/ with the files the trainer gives (safetensors of the adapter,
optimizer and EMA state, state.json) and manifest.json: each file's size and SHA-256. It is written into
step_NNNNNN.tmp/ -- every file fsynced (flame_core.io.atomic_write does) -- then the manifest, then the
folder is fsynced and renamed, and the parent folder fsynced. A process killed at any point leaves either the
complete folder or a .tmp folder that no reader takes for a checkpoint (the next save removes it).
`latest_valid(run)` checks the manifests from the newest checkpoint down and returns the first intact one with
the ones it skipped and why.
"""
import hashlib
import json
import os
import shutil

from flame_core.io import fsync_dir
from flame_core.io import write_json as atomic_write_json

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = 1


def checkpoint_root(run_dir):
    return os.path.join(run_dir, CHECKPOINTS)


def checkpoint_dir(run_dir, step):
    return os.path.join(checkpoint_root(run_dir), f"step_{step:06d}")


def sha256(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_checkpoint(run_dir, step, writers, state):
    """Write checkpoint `step`: `writers` maps a file name to a function that writes that file (given its path),
    `state` is stored as state.json. Returns the final folder."""
    final = checkpoint_dir(run_dir, step)
    root = os.path.dirname(final)
    os.makedirs(root, exist_ok=True)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # the leftover of a save that was killed
    os.makedirs(tmp)
    for name, write in writers.items():
        write(os.path.join(tmp, name))
    atomic_write_json(os.path.join(tmp, STATE), state, default=_json_default)
    files = {}
    for name in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, name)
        files[name] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    atomic_write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "files": files}, indent=1)
    fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # the same step saved again (e.g. after resuming from an earlier one)
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path):
    """None when the checkpoint folder `path` is intact, else the reason it is not."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return f"no {MANIFEST} (an incomplete save, or written by an older FLAME)"
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__}: {e})"
    if STATE not in files:
        return f"{MANIFEST} lists no {STATE}"
    for name, want in files.items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return f"{name} is missing"
        size = os.path.getsize(p)
        if size != want.get("size"):
            return f"{name} has {size} bytes, the manifest says {want.get('size')} (truncated or overwritten)"
        if sha256(p) != want.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    try:
        read_state(path)
    except (ValueError, OSError) as e:
        return f"unreadable {STATE} ({type(e).__name__}: {e})"
    return None


def read_state(path):
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


def checkpoint_steps(run_dir):
    """Steps of the checkpoint folders present (complete or not; unfinished .tmp folders excluded), ascending."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for d in os.listdir(root):
        if d.startswith("step_") and d[5:].isdigit() and os.path.isdir(os.path.join(root, d)):
            steps.append(int(d[5:]))
    return sorted(steps)


def latest_valid(run_dir):
    """(path, step, skipped): the newest intact checkpoint (path None when there is none) and [(path, reason)] of
    the newer ones that are not intact."""
    skipped = []
    for step in reversed(checkpoint_steps(run_dir)):
        path = checkpoint_dir(run_dir, step)
        why = verify(path)
        if why is None:
            return path, step, skipped
        skipped.append((path, why))
    return None, None, skipped


def prune(run_dir, keep, also=None):
    """Remove all but the newest `keep` checkpoints; also(step) lists more files of a removed step (its LoRA)."""
    steps = checkpoint_steps(run_dir)
    removed = steps[:-keep] if len(steps) > keep else []
    for s in removed:
        shutil.rmtree(checkpoint_dir(run_dir, s), ignore_errors=True)
        for f in (also(s) if also else []):
            if os.path.exists(f):
                os.remove(f)
    if removed:
        fsync_dir(checkpoint_root(run_dir))
    return removed


def _json_default(o):
    import numpy as np
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    raise TypeError(f"cannot store {type(o).__name__} in a checkpoint's state.json")
