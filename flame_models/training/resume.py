"""What a checkpoint holds (`contents`, `restore`), which one a run resumes from (`choose_checkpoint`), and what a
resumed run may change: the config a checkpoint was written with against the config it resumes with.

Changes that break continuing the run -- the adapters' shape or meaning (network), the model, the data and the order
it is drawn in (datasets, synthetic, batch_size, seed), the optimizer's kind or the EMA switch, the device (its random
streams) -- are an error naming the fields. Everything else applies from the resumed step on (the learning rate and
optimizer settings, the step count and schedule, timestep sampling, sample / save / log / validation cadence, ...)
and is listed as a warning.
"""
import glob
import hashlib
import os
import time
from typing import NamedTuple

import flame_core as flame
from flame_core import io
from flame_core.autograd import no_grad
from flame_core.errors import FlameError
from flame_nn import adapters as A

from . import checkpoint as ckpt
from . import run_folder
from .config import config_dict

# the fields that may change on resume (a dotted path, or a prefix ending in '.'); anything else breaks it
APPLICABLE = (
    "name", "training_folder", "type", "max_gpu_memory", "log_every", "performance_log_every", "logging.", "meta",
    "sample.", "save.", "train.force_first_sample", "train.content_or_style", "train.bypass_guidance_embedding",
    "train.steps", "train.epochs", "train.lr", "train.text_encoder_lr", "train.optimizer_params", "train.lr_scheduler",
    "train.lr_scheduler_params", "train.lr_warmup_steps",
    "train.max_grad_norm", "train.max_grad_value", "train.gradient_accumulation_steps", "train.gradient_checkpointing",
    "train.cuda_graph",
    "train.checkpoint_save",
    "train.offload_activations",
    "train.timestep_type", "train.shift", "train.sigmoid_scale", "train.logit_mean", "train.logit_std",
    "train.ema_config.ema_decay", "train.dtype", "train.guidance", "train.skip_first_sample",
    "train.disable_sampling", "train.reg_weight", "validation",
    "validation.",  # (a split that holds out other images changes the training data: the data check refuses that)
)
# whole values compared as one (a list of datasets, free-form mappings)
_LEAVES = ("datasets", "meta", "network.target", "network.network_kwargs", "train.optimizer_params",
           "train.lr_scheduler_params")


class ResumeError(FlameError, ValueError):
    """The run's folder holds a checkpoint that this config cannot continue (the message says why and what to do)."""


def flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and path not in _LEAVES:
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def _applicable(path):
    return any(path == a or (a.endswith(".") and path.startswith(a)) for a in APPLICABLE)


def _norm(v):
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


def _recorded(old, new):
    """`new` with the keys of its mappings that `old` does not record dropped (fields added to a list's entries --
    a dataset's -- after the old config was written), where old and new are lists of mappings of one length."""
    if (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
            and all(isinstance(x, dict) for x in old + new)):
        return [{k: v for k, v in n.items() if k in o} for o, n in zip(old, new)]
    return new


def compare(old, new):
    """(breaking, applied): lists of (path, old value, new value) between two config dicts (config.config_dict).
    Fields the old config does not record (written by an older FLAME) are not compared."""
    a, b = flatten(old), flatten(new)
    breaking, applied = [], []
    for path in sorted(set(a) | set(b)):
        if path not in a:
            continue
        va, vb = _norm(a.get(path)), _norm(_recorded(a.get(path), b.get(path)))
        if va != vb:
            (applied if _applicable(path) else breaking).append((path, va, vb))
    return breaking, applied


def describe(changes):
    return ", ".join(f"{p} {_short(a)} -> {_short(b)}" for p, a, b in changes)


def _short(v):
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ----------------------------------------------------------------------------- the trainer's stages
def choose_checkpoint(cfg, out, *, fresh, fingerprint, dist, log):
    """(path, state) of the checkpoint in run folder `out` to resume from, or (None, None) for a fresh start
    (`fresh`: the run's earlier outputs removed first). Refuses a config that cannot continue it (`fingerprint`: this
    run's data, data_fingerprint), and a folder with another run's outputs but no checkpoint. `dist`: the
    TrainerGroup (rank 0 clears, the global batch is compared); `log`: where notes go."""
    if fresh:
        gone = dist.run_on_main(run_folder.clear, out, cfg.name)  # ddp
        if gone:
            log(f"--fresh: removed {len(gone)} earlier output(s) of {out}: "
                + ", ".join(os.path.basename(g) for g in gone))
        return None, None
    for what, p in dist.run_on_main(ckpt.recover, out):  # ddp: a save killed half way, finished or undone
        log(f"checkpoint save interrupted earlier: {what} {p}")
    path, step, skipped = ckpt.latest_valid(out)
    for p, why in skipped:
        log(f"skipping checkpoint {p}: {why}")
    if path is None:
        found = run_folder.outputs(out, cfg.name)
        if found:
            raise run_folder.RunFolderError(
                f"{out} holds outputs of an earlier run ({', '.join(os.path.basename(f) for f in found)}) "
                f"but no intact checkpoint to resume from"
                + (f" ({len(skipped)} damaged: {'; '.join(w for _, w in skipped)})" if skipped else "")
                + "; start over with --fresh (removes them) or choose another name")
        return None, None
    state = ckpt.read_state(path)
    breaking, applied = compare(*dist.comparable(state, config_dict(cfg)))  # ddp: global batch
    if state.get("data") is not None and state["data"] != fingerprint:
        breaking.append(("datasets (their samples)", f"{state['data']['count']} samples",
                         f"{fingerprint['count']} samples, other files"))
    if breaking:
        raise ResumeError(f"{path}: the config changed in ways that cannot continue this run: "
                          f"{describe(breaking)}. Start over with --fresh (removes the run's checkpoints and "
                          f"outputs), choose another name, or restore those settings")
    if applied:
        log(f"resuming with changed settings, applied from step {step} on: {describe(applied)}")
    return path, state


def finished_lora(path, steps, state):
    """The final LoRA or model at `path` (run_folder.output_path: a .safetensors file, or a diffusers folder whose
    denoiser's weights carry the metadata) of a run whose checkpoint `state` has reached `steps` and that wrote it
    at that checkpoint's step -- nothing left to train or to write -- else None (a header only is read)."""
    if state is None or int(state["step"]) < steps:
        return None
    weights = path
    if os.path.isdir(path):   # (save.save_format: diffusers) the subfolder's diffusion_pytorch_model.safetensors
        found = sorted(glob.glob(os.path.join(path, "*", "diffusion_pytorch_model*.safetensors")))
        if not found:
            return None
        weights = found[0]
    try:
        with io.safe_open(weights) as f:
            written_at = (f.metadata() or {}).get("flame.steps")
    except Exception:  # noqa: BLE001 - missing or unreadable: the run writes it again
        return None
    return path if written_at == str(int(state["step"])) else None


def contents(step, named_params, *, optimizer, scheduler, loader, generators, ema, device, active_time, log_window,
             fingerprint, config):
    """What a checkpoint of `step` holds, the inverse of `restore`: ({file name: write(path)}, state) for
    checkpoint.write_checkpoint -- the adapter parameters (`named_params`), the optimizer's tensors (its scalars and
    groups go into the state), the EMA's shadow; the schedule's and the loader's positions, the random streams
    (`generators` and the default cpu and `device` ones), the training time and the loss log's open window, the
    data's fingerprint and the config (a dict)."""
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for i, st in opt["state"].items():
        for k, v in st.items():
            (tensors if isinstance(v, flame.Tensor) else scalars)[f"{i}.{k}"] = v
    adapter = dict(named_params)
    writers = {"adapter.safetensors": lambda p: io.save_file(adapter, p)}
    if tensors:
        writers["optimizer.safetensors"] = lambda p: io.save_file(tensors, p)
    if ema is not None:
        shadow = {str(i): s for i, s in enumerate(ema.shadow)}
        writers["ema.safetensors"] = lambda p: io.save_file(shadow, p)
    state = {"step": step, "loader": loader.state_dict(), "scheduler_epoch": scheduler.last_epoch,
             "optimizer": {"scalars": scalars, "param_groups": opt["param_groups"]},
             "rng": {**{name: gen.get_state() for name, gen in generators.items()},
                     "default_cpu": flame.get_rng_state("cpu"), "default_device": flame.get_rng_state(device)},
             "ema": None if ema is None else {"decay": ema.decay, "num_updates": ema.num_updates},
             "active_time": active_time, "log_window": log_window, "time": time.time(),
             "data": fingerprint, "config": config}
    return writers, state


class Restored(NamedTuple):
    """What a checkpoint gives back besides the objects it loads into: the step, the schedule's position, the
    training time so far and the loss log's open window."""
    step: int
    scheduler_epoch: int
    active_time: float
    log_window: dict


def restore(path, state, named_params, *, optimizer, loader, generators, ema, ema_decay, device):
    """Load the checkpoint at `path` (its state.json `state`) into what the trainer built: the adapter parameters
    (`named_params`, [(name, Parameter)]), the optimizer's moments (with its own, this config's, hyper-parameters),
    the loader's position, the random streams (`generators`: {"sigma": ..., "noise": ...}, and the default cpu and
    `device` ones) and the EMA (its decay this config's `ema_decay`). Returns Restored."""
    saved = io.load_file(os.path.join(path, "adapter.safetensors"))
    if sorted(saved) != sorted(k for k, _ in named_params):
        raise A.AdapterFormatError(f"checkpoint {path} holds other adapter parameters than this config makes: "
                                   f"e.g. {sorted(set(saved) ^ {k for k, _ in named_params})[:4]}")
    with no_grad():
        for k, p in named_params:
            if tuple(saved[k].shape) != tuple(p.shape):
                raise A.AdapterFormatError(f"checkpoint {path}: {k} has shape {tuple(saved[k].shape)}, the "
                                           f"model's is {tuple(p.shape)}")
            p.copy_(saved[k])
    opt_path = os.path.join(path, "optimizer.safetensors")
    opt_tensors = io.load_file(opt_path, device=device) if os.path.exists(opt_path) else {}
    st = {}
    for k, v in list(opt_tensors.items()) + list(state["optimizer"]["scalars"].items()):
        i, name = k.split(".", 1)
        st.setdefault(int(i), {})[name] = v
    # the optimizer's hyper-parameters are this config's (an applied change), its moments and the running state it
    # keeps in its groups (Prodigy's D estimate, schedule-free's weight sum: `running_keys`) the checkpoint's
    running = getattr(optimizer, "running_keys", ())
    groups = [{**theirs, **{k: v for k, v in mine.items() if k != "params" and not (k in running and k in theirs)}}
              for theirs, mine in zip(state["optimizer"]["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": st, "param_groups": groups})
    loader.load_state_dict(state["loader"])
    for name, gen in generators.items():
        gen.set_state(state["rng"][name])
    flame.set_rng_state(state["rng"]["default_cpu"], "cpu")
    flame.set_rng_state(state["rng"]["default_device"], device)
    if ema is not None:
        shadow = io.load_file(os.path.join(path, "ema.safetensors"), device=device)
        ema.load_state_dict({**state["ema"], "shadow": [shadow[str(i)] for i in range(len(shadow))]})
        ema.decay = ema_decay
    return Restored(int(state["step"]), int(state["scheduler_epoch"]), float(state.get("active_time", 0.0)),
                    state.get("log_window"))


def data_fingerprint(dataset):
    """What identifies the samples a run draws from: their count and, for folders, the files' names and sizes (image
    datasets: the hash of their images, captions, buckets and settings)."""
    if hasattr(dataset, "fingerprint"):
        return {"count": len(dataset), "files": dataset.fingerprint()}
    parts = getattr(dataset, "parts", None) or [dataset]
    h = hashlib.sha256()
    for p in parts:
        for f in getattr(p, "files", []):
            h.update(f"{os.path.basename(f)}:{os.path.getsize(f)}\n".encode())
    return {"count": len(dataset), "files": h.hexdigest()[:16]}
