"""What a resumed run may change: the config a checkpoint was written with against the config it resumes with.

Changes that break continuing the run -- the adapters' shape or meaning (network), the model, the data and the order
it is drawn in (datasets, synthetic, batch_size, seed), the optimizer's kind or the EMA switch, the device (its random
streams) -- are an error naming the fields. Everything else applies from the resumed step on (the learning rate and
optimizer settings, the step count and schedule, timestep sampling, sample / save / log cadence, ...) and is listed
as a warning.
"""
import os

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
    "name", "training_folder", "type", "max_gpu_memory", "log_every", "logging.", "meta", "sample.", "save.",
    "train.steps", "train.lr", "train.text_encoder_lr", "train.optimizer_params", "train.lr_scheduler",
    "train.lr_scheduler_params", "train.lr_warmup_steps",
    "train.max_grad_norm", "train.gradient_accumulation_steps", "train.gradient_checkpointing", "train.cuda_graph",
    "train.timestep_type", "train.shift", "train.sigmoid_scale", "train.logit_mean", "train.logit_std",
    "train.ema_config.ema_decay", "train.dtype", "train.guidance", "train.skip_first_sample",
    "train.disable_sampling",
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


def compare(old, new):
    """(breaking, applied): lists of (path, old value, new value) between two config dicts (config.config_dict).
    Fields the old config does not record (written by an older FLAME) are not compared."""
    a, b = flatten(old), flatten(new)
    breaking, applied = [], []
    for path in sorted(set(a) | set(b)):
        if path not in a:
            continue
        va, vb = _norm(a.get(path)), _norm(b.get(path))
        if va != vb:
            (applied if _applicable(path) else breaking).append((path, va, vb))
    return breaking, applied


def describe(changes):
    return ", ".join(f"{p} {_short(a)} -> {_short(b)}" for p, a, b in changes)


def _short(v):
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ----------------------------------------------------------------------------- the trainer's side
def choose_checkpoint(self):
    """For Trainer `self`: (path, state) of the checkpoint to resume from, or (None, None) for a fresh start; refuses a config
    that cannot continue it, and a folder with another run's outputs but no checkpoint."""
    c = self.cfg
    if self.fresh:
        gone = self.dist.run_on_main(run_folder.clear, self.out, c.name)  # ddp
        if gone:
            self.log(f"--fresh: removed {len(gone)} earlier output(s) of {self.out}: "
                     + ", ".join(os.path.basename(g) for g in gone))
        return None, None
    for what, p in self.dist.run_on_main(ckpt.recover, self.out):  # ddp: a save killed half way, finished or undone
        self.log(f"checkpoint save interrupted earlier: {what} {p}")
    path, step, skipped = ckpt.latest_valid(self.out)
    for p, why in skipped:
        self.log(f"skipping checkpoint {p}: {why}")
    if path is None:
        found = run_folder.outputs(self.out, c.name)
        if found:
            raise run_folder.RunFolderError(
                f"{self.out} holds outputs of an earlier run ({', '.join(os.path.basename(f) for f in found)}) "
                f"but no intact checkpoint to resume from"
                + (f" ({len(skipped)} damaged: {'; '.join(w for _, w in skipped)})" if skipped else "")
                + "; start over with --fresh (removes them) or choose another name")
        return None, None
    state = ckpt.read_state(path)
    breaking, applied = compare(*self.dist.comparable(state, config_dict(c)))  # ddp: global batch
    if state.get("data") is not None and state["data"] != self.data_fingerprint:
        breaking.append(("datasets (their samples)", f"{state['data']['count']} samples",
                         f"{self.data_fingerprint['count']} samples, other files"))
    if breaking:
        raise ResumeError(f"{path}: the config changed in ways that cannot continue this run: "
                          f"{describe(breaking)}. Start over with --fresh (removes the run's checkpoints and "
                          f"outputs), choose another name, or restore those settings")
    if applied:
        self.log(f"resuming with changed settings, applied from step {step} on: {describe(applied)}")
    return path, state

def load_checkpoint(self, path, state):
    """Trainer `self` takes the checkpoint at `path` (its state.json `state`): adapters, optimizer moments with this
    config's hyper-parameters, schedule, data position, random streams, EMA, step, training time, logs, samples."""
    saved = io.load_file(os.path.join(path, "adapter.safetensors"))
    named = self.named_adapter_parameters()
    if sorted(saved) != sorted(k for k, _ in named):
        raise A.AdapterFormatError(f"checkpoint {path} holds other adapter parameters than this config makes: "
                                   f"e.g. {sorted(set(saved) ^ {k for k, _ in named})[:4]}")
    with no_grad():
        for k, p in named:
            if tuple(saved[k].shape) != tuple(p.shape):
                raise A.AdapterFormatError(f"checkpoint {path}: {k} has shape {tuple(saved[k].shape)}, the "
                                           f"model's is {tuple(p.shape)}")
            p.copy_(saved[k])
    opt_path = os.path.join(path, "optimizer.safetensors")
    opt_tensors = io.load_file(opt_path, device=self.device) if os.path.exists(opt_path) else {}
    st = {}
    for k, v in list(opt_tensors.items()) + list(state["optimizer"]["scalars"].items()):
        i, name = k.split(".", 1)
        st.setdefault(int(i), {})[name] = v
    # the optimizer's hyper-parameters are this config's (an applied change), its moments and the running state it
    # keeps in its groups (Prodigy's D estimate, schedule-free's weight sum: `running_keys`) the checkpoint's
    running = getattr(self.optimizer, "running_keys", ())
    groups = [{**theirs, **{k: v for k, v in mine.items() if k != "params" and not (k in running and k in theirs)}}
              for theirs, mine in zip(state["optimizer"]["param_groups"], self.optimizer.param_groups)]
    self.optimizer.load_state_dict({"state": st, "param_groups": groups})
    self.scheduler = self._make_scheduler(at_step=int(state["scheduler_epoch"]))
    self.loader.load_state_dict(state["loader"])
    self.sigma_gen.set_state(state["rng"]["sigma"])
    self.noise_gen.set_state(state["rng"]["noise"])
    flame.set_rng_state(state["rng"]["default_cpu"], "cpu")
    flame.set_rng_state(state["rng"]["default_device"], self.device)
    if self.ema is not None:
        shadow = io.load_file(os.path.join(path, "ema.safetensors"), device=self.device)
        self.ema.load_state_dict({**state["ema"], "shadow": [shadow[str(i)] for i in range(len(shadow))]})
        self.ema.decay = self.cfg.train.ema_config.ema_decay
    self.step = int(state["step"])
    self.active_time = float(state.get("active_time", 0.0))
    self._window = dict(state.get("log_window") or self._window)
    self.loss_log.load()
    self.loss_log.truncate(self.step)
    self.previews.restore(self.step)
    self.resumed_from = path
    self.log(f"resumed from {path} (step {self.step}, {self.active_time:.0f} s of training so far)")
