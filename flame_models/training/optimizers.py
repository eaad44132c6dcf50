"""The trainer's optimizers by the peers' names (ai-toolkit's `optimizer:`, kohya's `optimizer_type`, matched without
case, `_` or `-`) and the `optimizer_params` each accepts: the reference implementation's keyword arguments
(prodigyopt.Prodigy, transformers' Adafactor, lion_pytorch.Lion, schedulefree.AdamWScheduleFree, torch.optim's
RAdam / NAdam), type-checked.
"""
import difflib

import flame_nn

NUMBER, BOOL, INT, PAIR, OPT_NUMBER = "number", "bool", "int", "pair", "number or null"
_ADAMW = {"weight_decay": NUMBER, "betas": PAIR, "eps": NUMBER}
SPECS = {  # canonical name: (class name in flame_nn.optim, {param: kind})
    "adamw": ("AdamW", _ADAMW),
    "adamw8bit": ("AdamW8bit", _ADAMW),
    "prodigy": ("Prodigy", {"betas": PAIR, "beta3": OPT_NUMBER, "eps": NUMBER, "weight_decay": NUMBER,
                            "decouple": BOOL, "use_bias_correction": BOOL, "safeguard_warmup": BOOL, "d0": NUMBER,
                            "d_coef": NUMBER, "growth_rate": NUMBER, "slice_p": INT}),
    "adafactor": ("Adafactor", {"eps": PAIR, "clip_threshold": NUMBER, "decay_rate": NUMBER, "beta1": OPT_NUMBER,
                                "weight_decay": NUMBER, "scale_parameter": BOOL, "relative_step": BOOL,
                                "warmup_init": BOOL}),
    "lion": ("Lion", {"betas": PAIR, "weight_decay": NUMBER, "decoupled_weight_decay": BOOL}),
    "adamw_schedulefree": ("AdamWScheduleFree", {"betas": PAIR, "eps": NUMBER, "weight_decay": NUMBER,
                                                 "warmup_steps": INT, "r": NUMBER, "weight_lr_power": NUMBER}),
    "radam": ("RAdam", dict(_ADAMW, decoupled_weight_decay=BOOL)),   # torch.optim's
    "nadam": ("NAdam", dict(_ADAMW, momentum_decay=NUMBER, decoupled_weight_decay=BOOL)),
}
OPTIMIZERS = tuple(SPECS)
_ALIASES = {"adamw8bit": "adamw8bit", "adamw_8bit": "adamw8bit", "adamwschedulefree": "adamw_schedulefree",
            "schedulefreeadamw": "adamw_schedulefree", "schedulefree.adamwschedulefree": "adamw_schedulefree",
            "prodigyopt": "prodigy"}   # (ai-toolkit's UI value: the package's name)
# ai-toolkit's Prodigy: an lr below this is raised to 1.0 (Prodigy's step is lr x its own estimate of the step size)
PRODIGY_MIN_LR = 0.1
# ai-toolkit's Adafactor: an external lr and schedule unless the config asks otherwise
ADAFACTOR_DEFAULTS = {"relative_step": False, "scale_parameter": False, "warmup_init": False}
# optimizer state bytes per trained parameter (fp32 state), for the memory planner
STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "prodigy": 16, "adafactor": 4, "lion": 4, "adamw_schedulefree": 8,
               "radam": 8, "nadam": 8}


def canonical(name):
    """The canonical name of optimizer `name` (any peer spelling), or None when unknown."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().replace("-", "_")
    if key in SPECS:
        return key
    return _ALIASES.get(key) or _ALIASES.get(key.replace("_", "")) or next(
        (k for k in SPECS if k.replace("_", "") == key.replace("_", "")), None)


def check_params(name, params, where, errors, number):
    """`params` checked for optimizer `name`; returns the cleaned dict (errors appended, each naming its field).
    `number(v, type, where, errors)` converts a number or records why not (config.py's)."""
    kinds = SPECS[name][1]
    out = {}
    for k, v in params.items():
        at = f"{where}.{k}"
        kind = kinds.get(k)
        if kind is None:
            near = difflib.get_close_matches(str(k), list(kinds), n=1)
            errors.append(f"{at}: unknown; supported: {', '.join(kinds)}" + (f" (optimizer {name})" if name not in
                          ("adamw", "adamw8bit") else "") + (f"; did you mean '{near[0]}'?" if near else ""))
        elif kind == BOOL:
            if isinstance(v, bool):
                out[k] = v
            else:
                errors.append(f"{at}: expected true or false, got {v!r}")
        elif kind == PAIR:
            if not (isinstance(v, (list, tuple)) and len(v) == 2):
                errors.append(f"{at}: expected two numbers such as [0.9, 0.999], got {v!r}")
                continue
            pair = [number(b, float, f"{at}[{i}]", errors) for i, b in enumerate(v)]
            if all(isinstance(b, float) for b in pair):
                if k == "betas" and not all(0 <= b < 1 for b in pair):
                    errors.append(f"{at}: each beta must be in [0, 1), got {v!r}")
                else:
                    out[k] = pair
        elif v is None:
            if kind == OPT_NUMBER:
                out[k] = None
            else:
                errors.append(f"{at}: expected a number, got null")
        else:
            x = number(v, int if kind == INT else float, at, errors)
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                continue
            if k in ("eps", "d0") and x <= 0 or k in ("weight_decay", "warmup_steps") and x < 0 or \
                    k == "slice_p" and x < 1:
                errors.append(f"{at}: must be {'> 0' if k in ('eps', 'd0') else '>= 1' if k == 'slice_p' else '>= 0'}"
                              f", got {x}")
                continue
            out[k] = x
    if name == "adafactor" and out.get("relative_step"):
        errors.append(f"{where}.relative_step: true is not supported by the trainer (its lr and lr_scheduler set "
                      f"the step size); leave it false")
    return out


def make(name, groups, lr, params):
    """The optimizer `name` over param `groups` ([{"params", "lr"}]) with `params` (checked by check_params)."""
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    if name == "adafactor":
        kw = {**ADAFACTOR_DEFAULTS, **kw}
    opt = getattr(flame_nn.optim, SPECS[name][0])(groups, lr=lr, **kw)
    if hasattr(opt, "train"):  # schedule-free: gradients are taken at y
        opt.train()
    return opt
