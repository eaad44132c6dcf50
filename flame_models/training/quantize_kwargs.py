"""ai-toolkit's `model.quantize_kwargs` (optimum-quanto's `exclude`: shell-style patterns of module names kept out of
quantisation). FLAME stores exactly the Linears of the block stacks in fp8, so an exclusion that names only modules
outside them -- the embedders ai-toolkit's examples exclude, `"*time_text_embed*"` -- asks for what FLAME does
already: accepted. A pattern that names a block Linear, by FLAME's name or by the diffusers name a LoRA file would
use, is an error naming it (keeping some block Linears in bf16 beside fp8 ones is not built); so is `include`, and
any other key. Checked against the model built without storage, before anything is cached or loaded."""
from fnmatch import fnmatch

import flame_nn
from flame_core import dtypes

from .config import dtype_name

KEYS = ("exclude",)


def config_problems(cfg, p=""):
    """The keys and value types of model.quantize_kwargs (config checks)."""
    kw, e = cfg.model.quantize_kwargs, []
    if not kw:
        return e
    if not isinstance(kw, dict):
        return [f"{p}model.quantize_kwargs: a mapping (exclude: [patterns]), got {type(kw).__name__}"]
    if not cfg.model.quantize:
        e.append(f"{p}model.quantize_kwargs: only used with model.quantize: true")
    for k, v in kw.items():
        if k not in KEYS:
            e.append(f"{p}model.quantize_kwargs.{k}: not available; FLAME stores every Linear of the blocks in fp8 "
                     f"(exclude may name modules outside them)")
        elif not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            e.append(f"{p}model.quantize_kwargs.{k}: a pattern or a list of patterns, got {v!r}")
    return e


def patterns(cfg):
    v = (cfg.model.quantize_kwargs or {}).get("exclude") or []
    return [v] if isinstance(v, str) else list(v)


def model_problems(cfg, family, spec, model=None):
    """The exclusion patterns that name a block Linear of the family's model of `spec` (or `model`)."""
    pats = patterns(cfg)
    if not pats or not cfg.model.quantize:
        return []
    if model is None:
        model = family.empty_model(spec, dtypes.dtype(dtype_name(cfg.model.dtype)), "cpu")
    name_map = family.lora_name_map(model)
    e = []
    for stack in family.block_stacks(model):
        for n, m in model.get_submodule(stack).named_modules():
            if not isinstance(m, flame_nn.Linear):
                continue
            name = f"{stack}.{n}"
            names = [name] + [peft for peft, _ in name_map.peft_targets(name)]
            for pat in pats:
                hit = next((x for x in names if fnmatch(x, pat)), None)
                if hit is not None:
                    e.append(f"model.quantize_kwargs.exclude: {pat!r} names the block Linear {hit}, which FLAME stores "
                             f"in fp8 with the rest of the blocks (only modules outside the blocks, never quantised, "
                             f"may be excluded)")
                    pats = [x for x in pats if x != pat]   # (each pattern once)
    return e
