"""The run's saves against the free space of the disk they go to, checked at set-up -- before hours of training end
in a save that cannot be written (a full fine-tune's checkpoint of Flux-dev holds ~48 GB of float32 weights, its
model file another 24 GB).

    need = save_bytes(named, optimizer="adamw8bit", output_bytes=n_out * 2, ema=False)
    problem, note = disk_problems(run_dir, need, keep=4, final_bytes=n_out * 2)

One save writes a checkpoint (the trained parameters as they are held, the optimizer's state, the EMA's float32
shadow) and a LoRA / model file (at save.dtype); the run keeps save.max_step_saves_to_keep of them and writes the
next before the oldest goes, so it holds up to keep + 1 at once, plus the final file. An error when not even one
save fits the free space; a warning when keep + 1 do not (the run would stop at a later save). Estimates: the small
files (state.json, the random streams, the loss log) and the file system's blocks are not counted. A full
fine-tune is checked twice: from the model's header (its weights counted on a model without storage) before the
caches are built, and exactly once the model is built.
"""
import os
import shutil

from flame_core.memory.stats import fmt_bytes

from .full_finetune import state_bytes


def save_bytes(named, *, optimizer, optimizer_params=None, ema=False, output_bytes=0, held_itemsize=None):
    """Bytes one save writes: the checkpoint of `named` ([(name, Parameter)], at their own dtypes, or at
    `held_itemsize` bytes each: a model not yet converted for training) with `optimizer`'s state and, with `ema`, a
    float32 shadow; plus `output_bytes` (the step's LoRA / model file)."""
    params = list(named)
    total = sum(p.numel() * (held_itemsize or p.dtype.itemsize) for _, p in params)
    total += sum(state_bytes(optimizer, p, optimizer_params) for _, p in params)
    if ema:
        total += sum(p.numel() * 4 for _, p in params)
    return total + int(output_bytes)


def free_bytes(folder):
    """Free bytes of the file system `folder` is on (its nearest existing parent's), or None where it cannot be
    told."""
    where = os.path.abspath(folder)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def disk_problems(folder, need, keep, final_bytes=0, setting="save"):
    """(error or None, warning or None) for saves of `need` bytes each into `folder`, `keep` of them kept (one more
    while the next is written) beside a final file of `final_bytes`."""
    free = free_bytes(folder)
    if free is None:
        return None, None
    if need > free:
        return (f"{setting}: one save of this run writes about {fmt_bytes(need)} (its checkpoint -- the trained "
                f"parameters and the optimizer's state -- and its file), more than the {fmt_bytes(free)} free on "
                f"the disk of {folder}; free space there or choose another training_folder (--output)"), None
    most = (keep + 1) * need + final_bytes
    if most > free:
        return None, (f"{setting}: the run keeps {keep} saves of about {fmt_bytes(need)} each (one more while the "
                      f"next is written) and a final file -- up to {fmt_bytes(most)} -- but {fmt_bytes(free)} is "
                      f"free on the disk of {folder}: a later save will fail for lack of space unless space is "
                      f"freed (or save.max_step_saves_to_keep is lowered)")
    return None, None
