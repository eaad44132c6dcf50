"""Training checkpoints on disk: written whole or not at all, verified before use, the newest valid one found.

A checkpoint is a folder <run>/checkpoints/step_NNNNNN/ with the files the trainer gives (safetensors of the adapter,
optimizer and EMA state, state.json) and manifest.json: each file's size and SHA-256. It is written into
step_NNNNNN.tmp/ -- every file fsynced (flame_core.io.atomic_write does) -- then the manifest, then the
folder is fsynced and renamed, and the parent folder fsynced. Saving a step that exists already (a run resumed
from an earlier checkpoint reaches it again) moves the old folder to step_NNNNNN.old first, then the new one in, then
removes the old one. A process killed at any point leaves the complete folder, or a .tmp folder (complete or not),
or -- between the two renames of a re-save -- a complete .tmp folder and the .old one: `recover(run)`, called
before a run picks its checkpoint, promotes a .tmp folder that verifies where its step has no intact folder, restores
an .old folder that verifies where neither does, and removes what is left over.
`latest_valid(run)` checks the manifests from the newest checkpoint down and returns the first intact one with
the ones it skipped and why. `prune` counts intact checkpoints only: it never removes one for a damaged newer one.
`crash_point(name)` marks each step of a save (a no-op; the fault-injection tests replace it to kill the process
there).
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


def crash_point(name):
    """Called at each step of a save, in order: begin, folder, file:<name> (after each file), state, manifest,
    synced, old-moved (re-save only), renamed, root-synced, done. A no-op; tests replace it to kill the process."""


def write_checkpoint(run_dir, step, writers, state):
    """Write checkpoint `step`: `writers` maps a file name to a function that writes that file (given its path),
    `state` is stored as state.json. Returns the final folder."""
    final = checkpoint_dir(run_dir, step)
    root = os.path.dirname(final)
    crash_point("begin")
    os.makedirs(root, exist_ok=True)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # the leftover of a save that was killed
    os.makedirs(tmp)
    crash_point("folder")
    for name, write in writers.items():
        write(os.path.join(tmp, name))
        crash_point(f"file:{name}")
    atomic_write_json(os.path.join(tmp, STATE), state, default=_json_default)
    crash_point("state")
    files = {}
    for name in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, name)
        files[name] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    atomic_write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "files": files}, indent=1)
    crash_point("manifest")
    fsync_dir(tmp)
    crash_point("synced")
    old = None
    if os.path.exists(final):  # the same step saved again (e.g. after resuming from an earlier one)
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # killed from here to the next rename: recover() promotes the complete .tmp
        crash_point("old-moved")
    os.replace(tmp, final)
    crash_point("renamed")
    fsync_dir(root)
    crash_point("root-synced")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _verified.pop(final, None)
    _intact(final, known=True)  # just hashed for its manifest
    crash_point("done")
    return final


def recover(run_dir):
    """Finish or undo the saves a killed process left half done; returns [(what, path)] of what it did. Per step:
    a .tmp folder that verifies becomes the checkpoint when there is no intact one (a save killed after its
    manifest: between the renames of a re-save, or before the first); else an intact .old folder comes back when
    there is no intact checkpoint (a re-save killed between its renames whose new folder is damaged); the leftovers
    (an incomplete .tmp, an .old next to an intact checkpoint) are removed."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    done = []
    for suffix in (".tmp", ".old"):  # the new copy of a step first: an .old one only where no new one verifies
        for entry in sorted(os.listdir(root)):
            base = entry[:-len(suffix)]
            if not (entry.endswith(suffix) and base.startswith("step_") and base[5:].isdigit()):
                continue
            path, final = os.path.join(root, entry), os.path.join(root, base)
            if not os.path.isdir(path):
                continue
            if verify(final) is not None and verify(path) is None:
                if os.path.exists(final):
                    shutil.rmtree(final)  # damaged: the intact copy of the same step replaces it
                os.replace(path, final)
                done.append(("promoted" if suffix == ".tmp" else "restored", final))
            else:
                shutil.rmtree(path, ignore_errors=True)
                done.append(("removed", path))
    if done:
        fsync_dir(root)
    return done


def verify(path):
    """None when the checkpoint folder `path` is intact, else the reason it is not."""
    if not os.path.isdir(path):
        return "missing"
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


def _intact(path, known=False):
    """verify(path) is None, remembered for the folder as it is (the files' names, sizes and times): a save prunes
    after each checkpoint and would otherwise hash every kept one again."""
    try:
        sig = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
    except OSError:
        return False
    hit = _verified.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    ok = True if known else verify(path) is None
    _verified[path] = (sig, ok)
    return ok


_verified = {}  # path -> (folder signature, intact?)


def prune(run_dir, keep, also=None):
    """Remove all but the newest `keep` intact checkpoints; also(step) lists more files or folders of a removed step
    (its LoRA or model).
    Only intact checkpoints count and go: a damaged one neither takes the place of an intact one nor is removed
    here (the next run skips it, saying why)."""
    steps = [s for s in checkpoint_steps(run_dir) if _intact(checkpoint_dir(run_dir, s))]
    removed = steps[:-keep] if len(steps) > keep else []
    for s in removed:
        shutil.rmtree(checkpoint_dir(run_dir, s), ignore_errors=True)
        _verified.pop(checkpoint_dir(run_dir, s), None)
        for f in (also(s) if also else []):
            if os.path.isdir(f):   # (a diffusers-folder model of the step)
                shutil.rmtree(f, ignore_errors=True)
            elif os.path.exists(f):
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
