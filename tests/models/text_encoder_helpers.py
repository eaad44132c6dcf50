"""Shared pieces of the text encoder tests: the golden fixtures of tests/fixtures/make_text_encoder_fixtures.py
(transformers' outputs on tiny random configs) and ways to lay their weights out as other checkpoints do."""
import json
import os
import shutil

import numpy as np

from flame_core.io import load_file, save_file

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "text_encoders")
CLIP_NAMES = ("clip_l_legacy", "clip_l_eos", "clip_g_proj")
TIGHT = dict(rtol=1e-5, atol=2e-5)  # float32 against transformers' float32


def folder(name):
    return os.path.join(FIXTURES, name)


def io(name):
    return {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, name, "io.safetensors")).items()}


def weights(name):
    """The fixture's checkpoint tensors (transformers 4.x keys) as NumPy arrays."""
    return {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, name, "model.safetensors")).items()}


def config(name):
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return json.load(f)


def save(tensors, path):
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    save_file(tensors, str(path))
    return str(path)


def copy_folder(name, dest):
    """The fixture's transformers folder (config.json + model.safetensors) copied to `dest`."""
    os.makedirs(dest, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIXTURES, name, f), os.path.join(dest, f))
    return str(dest)


def shard(tensors, dest, stem="model", n=3):
    """`tensors` written as n shards plus `<stem>.safetensors.index.json` in `dest`; returns the index path."""
    os.makedirs(dest, exist_ok=True)
    keys = list(tensors)
    weight_map = {}
    for i in range(n):
        part = keys[i::n]
        name = f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(dest, name))
        weight_map.update({k: name for k in part})
    index = os.path.join(dest, f"{stem}.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


def outputs_close(out, ref, tag, **tol):
    """Every output of `out` (a ModelOutput) against the fixture's `tag.*` entries; returns the names checked."""
    tol = tol or TIGHT
    checked = []
    for name in ("last_hidden_state", "pooler_output", "text_embeds"):
        key = f"{tag}.{name}"
        if key in ref and name in out:
            np.testing.assert_allclose(np.asarray(out[name].float().numpy()), ref[key], err_msg=key, **tol)
            checked.append(name)
    n = len([k for k in ref if k.startswith(f"{tag}.hidden_states.")])
    if out.hidden_states is not None:
        assert len(out.hidden_states) == n
        for i, h in enumerate(out.hidden_states):
            np.testing.assert_allclose(h.float().numpy(), ref[f"{tag}.hidden_states.{i}"],
                                       err_msg=f"{tag}.hidden_states.{i}", **tol)
        checked.append("hidden_states")
    return checked
