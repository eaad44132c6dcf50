"""A run's folder <training_folder>/<name>/: what in it is the trainer's output, and starting over (`--fresh`)."""
import os
import re
import shutil

from flame_core.errors import FlameError

from .checkpoint import CHECKPOINTS


class RunFolderError(FlameError, ValueError):
    """The run's folder holds another run's outputs that this one would mix with."""


def outputs(run_dir, name):
    """The trainer's outputs present in `run_dir` (config.json alone is not one: a run that never stepped)."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    lora = re.compile(re.escape(name) + r"(_\d{6})?\.safetensors")
    for entry in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, entry)
        if entry in (CHECKPOINTS, "samples"):
            if os.path.isdir(path) and os.listdir(path):
                found.append(path)
        elif entry in ("loss.csv", "loss.json", "loss.png", "samples.png") or lora.fullmatch(entry):
            found.append(path)
    return found


def clear(run_dir, name):
    """Remove this run's outputs (and its config.json); other files in the folder stay. Returns what went."""
    gone = outputs(run_dir, name)
    cfg = os.path.join(run_dir, "config.json")
    if os.path.exists(cfg):
        gone.append(cfg)
    for path in gone:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return gone
