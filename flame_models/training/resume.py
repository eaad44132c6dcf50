"""What a resumed run may change: the config a checkpoint was written with against the config it resumes with.

Changes that break continuing the run -- the adapters' shape or meaning (network), the model, the data and the order
it is drawn in (datasets, synthetic, batch_size, seed), the optimizer's kind or the EMA switch, the device (its random
streams) -- are an error naming the fields. Everything else applies from the resumed step on (the learning rate and
optimizer settings, the step count and schedule, timestep sampling, sample / save / log cadence, ...) and is listed
as a warning.
"""
from flame_core.errors import FlameError

# the fields that may change on resume (a dotted path, or a prefix ending in '.'); anything else breaks it
APPLICABLE = (
    "name", "training_folder", "type", "max_gpu_memory", "log_every", "meta", "sample.", "save.",
    "train.steps", "train.lr", "train.optimizer_params", "train.lr_scheduler", "train.lr_warmup_steps",
    "train.max_grad_norm", "train.gradient_accumulation_steps", "train.gradient_checkpointing", "train.cuda_graph",
    "train.timestep_type", "train.shift", "train.sigmoid_scale", "train.logit_mean", "train.logit_std",
    "train.ema_config.ema_decay", "train.dtype", "train.guidance", "train.skip_first_sample",
    "train.disable_sampling",
)
# whole values compared as one (a list of datasets, free-form mappings)
_LEAVES = ("datasets", "meta", "network.target", "network.network_kwargs", "train.optimizer_params")


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
