"""kohya sd-scripts' sample-prompt files (its --sample_prompts; the command line's --sample-prompts) read as
sample.prompts: each prompt a string with its own flags (prompt_options.py reads them).

    prompts = read_prompt_file("prompts.txt")     # .txt, .json or .toml

.txt   one prompt per line, flags included ("a cat --w 768 --h 512 --d 1 --s 28 --l 3.5 --n blurry"); blank lines
       and lines starting with # are skipped
.json  a list of objects with kohya's keys: prompt (required), negative_prompt, width, height, sample_steps,
       scale (--l), guidance_scale (--g), seed, sample_sampler (--ss)
.toml  a [prompt] table whose keys other than `subset` are the defaults of its [[prompt.subset]] entries (kohya's
       layout), each entry an object as in .json

A key FLAME does not read (controlnet_image, enum, ...) is an error naming the file and the entry; the flags of each
prompt are checked with the config (validation: prompt_options.problems).
"""
import json
import os

from .config import ConfigError

# kohya's keys -> the prompt flags FLAME reads
_KEYS = {"negative_prompt": "--n", "width": "--w", "height": "--h", "sample_steps": "--s", "scale": "--l",
         "guidance_scale": "--g", "seed": "--d", "sample_sampler": "--ss"}
MAX_BYTES = 1 << 20
MAX_PROMPTS = 1000


def _from_entry(entry, where):
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object with a prompt, got {type(entry).__name__}")
    bad = sorted(k for k in entry if k != "prompt" and k not in _KEYS)
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)}: not read by FLAME (it reads prompt, {', '.join(_KEYS)})")
    text = entry.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: a non-empty prompt string is required")
    parts = [text.strip()]
    for key, flag in _KEYS.items():
        if key in entry:
            v = entry[key]
            if isinstance(v, (dict, list)) or v is None:
                raise ConfigError(f"{where}.{key}: a value, got {v!r}")
            parts.append(f"{flag} {v}")
    return " ".join(parts)


def read_prompt_file(path):
    """[prompt string] from kohya's prompt file at `path` (module docstring); ConfigError naming what is wrong."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    if os.path.getsize(path) > MAX_BYTES:
        raise ConfigError(f"{path}: {os.path.getsize(path):,} bytes; a prompt file is at most {MAX_BYTES:,}")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".json":
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, list):
                raise ConfigError(f"{path}: expected a list of prompt objects")
            out = [_from_entry(e, f"{path}[{i}]") for i, e in enumerate(doc)]
        elif ext == ".toml":
            import tomllib
            with open(path, "rb") as f:
                doc = tomllib.load(f)
            table = doc.get("prompt")
            if set(doc) != {"prompt"} or not isinstance(table, dict) or not isinstance(table.get("subset"), list):
                raise ConfigError(f"{path}: expected a [prompt] table with [[prompt.subset]] entries (kohya's layout)")
            defaults = {k: v for k, v in table.items() if k != "subset"}
            out = [_from_entry({**defaults, **e} if isinstance(e, dict) else e, f"{path} [[prompt.subset]] #{i + 1}")
                   for i, e in enumerate(table["subset"])]
        else:
            with open(path, encoding="utf-8") as f:
                out = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path}: cannot be read as {ext.lstrip('.') or 'text'}: {e}") from None
    if not out:
        raise ConfigError(f"{path}: holds no prompt")
    if len(out) > MAX_PROMPTS:
        raise ConfigError(f"{path}: {len(out)} prompts; at most {MAX_PROMPTS} are sampled at each preview step")
    return out
