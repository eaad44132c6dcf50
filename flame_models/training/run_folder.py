"""A run's folder <training_folder>/<name>/: that it can be written (checked at set-up, before anything is cached or
loaded), what in it is the trainer's output, and starting over (`--fresh`)."""
import os
import re
import shutil
import tempfile

from flame_core.errors import FlameError

from .checkpoint import CHECKPOINTS
from .logging import LossLog


class RunFolderError(FlameError, ValueError):
    """The run's folder holds another run's outputs that this one would mix with."""


def check_writable(run_dir):
    """Prove that `run_dir` can be made and written: a file is written and removed in it, or where it does not
    exist yet in its nearest existing parent (nothing is created) -- a real write, not a permission check: root
    passes those, and a read-only mount only shows on writing. RunFolderError naming the path and why otherwise (a
    file where a folder should be, no permission, ...)."""
    where = os.path.abspath(run_dir)
    for part in [where] + [os.path.join(where, sub) for sub in (CHECKPOINTS, "samples")]:
        if os.path.lexists(part) and not os.path.isdir(part):
            raise RunFolderError(f"output folder {where}: {part} is a file, not a folder; choose another "
                                 f"training_folder (--output) or name")
    parent = where
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise RunFolderError(f"output folder {where}: {parent} is a file, not a folder; choose another "
                             f"training_folder (--output)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".flame-write-check-", dir=parent)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise RunFolderError(f"output folder {where} cannot be written: {e.strerror or e}"
                             f"{f' ({e.filename})' if e.filename else ''}; choose another training_folder "
                             f"(--output) or fix its permissions") from None
    return where


def output_path(run_dir, name, step=None, folder=False):
    """Where the run's model output goes: its final LoRA or model (`step` None) or that of a checkpoint's step --
    `name`[_<step>].safetensors, or a folder `name`[_<step>] (a full fine-tune's save.save_format: diffusers)."""
    stem = name if step is None else f"{name}_{step:06d}"
    return os.path.join(run_dir, stem if folder else stem + ".safetensors")


def outputs(run_dir, name):
    """The trainer's outputs present in `run_dir` (config.json alone is not one: a run that never stepped)."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    lora = re.compile(re.escape(name) + r"(_\d{6})?\.safetensors")
    model_folder = re.compile(re.escape(name) + r"(_\d{6})?")   # (save.save_format: diffusers)
    for entry in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, entry)
        if entry in (CHECKPOINTS, "samples"):
            if os.path.isdir(path) and os.listdir(path):
                found.append(path)
        elif entry in ("loss.csv", "loss.json", "loss.png", "samples.png") or lora.fullmatch(entry) \
                or (model_folder.fullmatch(entry) and os.path.isdir(path)):
            found.append(path)
    return found


def finished_outputs(run_dir, lora, steps):
    """The result of a run that had finished before (its final LoRA `lora`, at step `steps`): its files as they
    are -- the loss log and plot, the samples grid, the validation log -- in Trainer.train's result keys;
    `finished_before` True."""
    rows = LossLog(run_dir).load()
    result = {"lora": lora, "loss_csv": os.path.join(run_dir, "loss.csv"),
              "loss_json": os.path.join(run_dir, "loss.json"),
              "steps": steps, "losses": [r["loss"] for r in rows], "interrupted": None, "finished_before": True}
    for key, name in (("loss_plot", "loss.png"), ("samples", "samples.png")):
        if os.path.isfile(os.path.join(run_dir, name)):
            result[key] = os.path.join(run_dir, name)
    if "samples" in result:  # a decoded run wrote a PNG per prompt and sampling step
        folder = os.path.join(run_dir, "samples")
        result["samples_decoded"] = os.path.isdir(folder) and any(f.endswith("_0.png") for f in os.listdir(folder))
    validation = LossLog(run_dir, "validation")
    if os.path.isfile(validation.json_path):  # (validation_loss.ValidationStage.results' entries)
        result.update({"validation_csv": validation.csv_path, "validation_json": validation.json_path,
                       "validation_losses": [(r["step"], r["loss"]) for r in validation.load()]})
    return result


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
