"""Training configuration: ai-toolkit-style YAML (the files users already have) -> validated dataclasses.

`load_config(path)` reads `job / config.name / config.process[0]` (or the process mapping at the top level) and
returns a `TrainConfig`. Every problem is reported at once, before anything is loaded or trained, with the path of
the field (`config.process[0].train.lr: ...`). Unknown keys are errors with a suggestion; ai-toolkit keys that mean
nothing here (yet) are accepted with a warning that says so (`TrainConfig.warnings`).
YAML 1.1 reads `1e-4` as a string: numeric strings are accepted wherever a number is expected.
"""
import difflib
import os
import typing
from dataclasses import dataclass, field, fields, is_dataclass

from flame_core.errors import FlameError

NETWORK_TYPES = ("lora", "locon", "dora", "lokr", "loha")
OPTIMIZERS = ("adamw", "adamw8bit")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32", "float": "float32"}
FILE_FORMATS = ("kohya", "peft")
MODEL_SIZES = ("flux-dev", "flux-schnell", "flux-tiny")


class ConfigError(FlameError, ValueError):
    """An invalid training configuration; the message lists every problem with the path of its field."""


# ----------------------------------------------------------------------------- sections
@dataclass
class NetworkConfig:
    type: str = "lora"                   # lora | locon (= lora; Flux has no convolutions) | dora | lokr | loha
    linear: int = 16                     # rank (alias: rank)
    linear_alpha: float = 16.0           # alpha (alias: alpha); scale = alpha / rank (rsLoRA: alpha / sqrt(rank))
    dropout: float = 0.0                 # dropout on the adapter input (LoRA / DoRA)
    rslora: bool = False
    lokr_factor: int = -1                # -1: the most balanced factorisation
    lokr_full_rank: bool = False         # LoKr: full w2 instead of w2_a @ w2_b
    target: typing.Any = "attention"     # preset ('attention', 'attention_all', 'all_linear') or list of patterns
    network_kwargs: dict = field(default_factory=dict)  # ai-toolkit: only_if_contains / ignore_if_contains


@dataclass
class SaveConfig:
    dtype: str = "bf16"                  # dtype of the written LoRA file (checkpoints keep float32)
    save_every: int = 250
    max_step_saves_to_keep: int = 4
    format: str = "kohya"                # kohya (ComfyUI, kohya, diffusers read it) | peft (diffusers)


@dataclass
class DatasetConfig:
    folder_path: str = None              # one .safetensors per sample: latents, prompt_embeds, pooled_prompt_embeds
    num_repeats: int = 1
    shuffle: bool = True


@dataclass
class SyntheticConfig:
    num_samples: int = 16
    height: int = 128                    # pixels; latents are (16, height/8, width/8)
    width: int = 128
    text_length: int = 16
    seed: int = 0


@dataclass
class EMAConfig:
    use_ema: bool = False
    ema_decay: float = 0.99


@dataclass
class TrainSection:
    batch_size: int = 1
    steps: int = 2000
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = True
    cuda_graph: bool = True              # forward + backward replayed as a CUDA graph on cuda (flame_core.cuda)
    noise_scheduler: str = "flowmatch"
    timestep_type: str = "sigmoid"       # sigmoid | logit_normal | uniform | shift | flux_shift
    shift: float = 3.0                   # for timestep_type 'shift'
    sigmoid_scale: float = 1.0
    optimizer: str = "adamw8bit"
    lr: float = 1e-4
    optimizer_params: dict = field(default_factory=dict)  # weight_decay, betas, eps
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0           # 0 disables clipping
    ema_config: EMAConfig = field(default_factory=EMAConfig)
    dtype: str = "bf16"                  # autocast dtype of the forward pass
    train_unet: bool = True
    train_text_encoder: bool = False
    guidance: float = 1.0                # flux-dev guidance embedding value while training
    seed: int = 42
    skip_first_sample: bool = False
    disable_sampling: bool = False


@dataclass
class ModelConfig:
    name_or_path: str = None             # BFL / diffusers / ComfyUI Flux .safetensors; None: random init of `size`
    arch: str = "flux"
    size: str = "flux-tiny"              # preset used when name_or_path is None
    dtype: str = "bf16"                  # dtype of the frozen base weights
    quantize: bool = False               # store the blocks' frozen Linear weights as fp8 (e4m3, per-channel scales)


@dataclass
class SampleConfig:
    sample_every: int = 250              # 0: never
    width: int = 1024
    height: int = 1024
    sample_steps: int = 20
    seed: int = 42
    walk_seed: bool = False
    guidance_scale: float = 4.0
    num_samples: int = 2                 # samples use the text embeddings of the first dataset items
    prompt_embeds: list = field(default_factory=list)  # or .safetensors files with prompt_embeds + pooled


@dataclass
class TrainConfig:
    name: str = "flux_lora"
    training_folder: str = "runs"
    device: str = None                   # None: cuda when available, else cpu
    max_gpu_memory: typing.Any = None    # e.g. '12GiB' (or a number of GiB): stream the transformer blocks from
                                         # pinned host memory, keeping as many resident as this budget allows
    trigger_word: str = None
    network: NetworkConfig = field(default_factory=NetworkConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    datasets: typing.List[DatasetConfig] = field(default_factory=list)
    synthetic: SyntheticConfig = None    # used when `datasets` is empty
    train: TrainSection = field(default_factory=TrainSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    log_every: int = 1
    warnings: list = field(default_factory=list)

    @property
    def output_dir(self):
        return os.path.join(self.training_folder, self.name)


_ALIASES = {NetworkConfig: {"rank": "linear", "alpha": "linear_alpha"}, SaveConfig: {"save_dtype": "dtype"}}
_NO_EFFECT = {  # ai-toolkit keys that are accepted, with the reason they change nothing here
    "type": "the process type is always LoRA-family training; datasets are precomputed latents",
    "performance_log_every": "timings are in the progress bar",
    "push_to_hub": "uploading is not supported",
    "is_flux": "the architecture comes from model.arch",
    "low_vram": "memory techniques are chosen separately",
    "linear_timesteps": "use train.timestep_type",
    "sampler": "samples always use the Flux Euler sampler",
    "neg": "Flux-dev samples use no negative prompt",
    "meta": "metadata of the config only",
    "trigger_word": "captions are precomputed text embeddings; the trigger word must be in them already",
    "prompts": "text encoders are not available yet; samples use sample.prompt_embeds or the dataset's embeddings",
    "caption_ext": "captions are precomputed text embeddings",
    "caption_dropout_rate": "caption dropout needs the empty prompt's embedding, which needs the text encoder",
    "shuffle_tokens": "captions are precomputed text embeddings",
    "cache_latents_to_disk": "latents are precomputed already",
    "cache_latents": "latents are precomputed already",
    "resolution": "the resolution is that of the precomputed latents",
    "quantize_te": "text encoders are not loaded",
}


_KEPT_NO_EFFECT = ("trigger_word",)


# ----------------------------------------------------------------------------- building dataclasses from mappings
_BAD = object()


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _coerce(value, tp, path, errors, warnings):
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return value
    if is_dataclass(tp):
        if value is None:
            return tp()
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return _BAD
        return _build(tp, value, path, errors, warnings)
    if origin in (list, typing.List):
        (item_tp,) = typing.get_args(tp) or (typing.Any,)
        if value is None:
            return []
        if not isinstance(value, list):
            value = [value] if item_tp is str else value
            if not isinstance(value, list):
                errors.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
                return _BAD
        items = [_coerce(v, item_tp, f"{path}[{i}]", errors, warnings) for i, v in enumerate(value)]
        return [v for v in items if v is not _BAD]
    if tp is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return _BAD
        return value
    if tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return _BAD
        return value
    if value is None:
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path}: expected true or false, got {value!r}")
        return _BAD
    if tp in (int, float):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                errors.append(f"{path}: expected a number, got {value!r}")
                return _BAD
        if not _is_number(value):
            errors.append(f"{path}: expected a number, got {type(value).__name__} {value!r}")
            return _BAD
        if tp is int:
            if float(value) != int(value):
                errors.append(f"{path}: expected an integer, got {value!r}")
            return int(value)
        return float(value)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return _BAD
    return value


def _build(cls, data, path, errors, warnings):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls) if f.name != "warnings"]
    aliases = _ALIASES.get(cls, {})
    kwargs = {}
    for key, value in data.items():
        key = str(key)
        where = f"{path}.{key}" if path else key
        name = aliases.get(key, key)
        if name in names:
            if name in kwargs:
                errors.append(f"{where}: given twice (also as an alias)")
            v = _coerce(value, hints[name], where, errors, warnings)
            if v is not _BAD:  # a bad value keeps the default, so it causes no follow-up errors
                kwargs[name] = v
            if name in _KEPT_NO_EFFECT and value:  # a field we keep but cannot honour yet
                warnings.append(f"{where}: ignored ({_NO_EFFECT[name]})")
        elif key in _NO_EFFECT:
            if value not in (None, False, [], "", {}):
                warnings.append(f"{where}: ignored ({_NO_EFFECT[key]})")
        else:
            near = difflib.get_close_matches(key, names + list(aliases), n=1)
            errors.append(f"{where}: unknown field" + (f"; did you mean '{near[0]}'?" if near else
                                                       f"; known: {', '.join(names)}"))
    return cls(**kwargs)


# ----------------------------------------------------------------------------- validation
def _choice(errors, path, value, choices):
    if value not in choices:
        near = difflib.get_close_matches(str(value), list(choices), n=1)
        errors.append(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}"
                      + (f"; did you mean '{near[0]}'?" if near else ""))


def _positive(errors, path, value, minimum=1):
    if value is not None and value < minimum:
        errors.append(f"{path}: must be >= {minimum}, got {value}")


def validate(cfg, prefix="", check_files=True):
    """Every problem of a TrainConfig, as a list of messages (empty: valid)."""
    e, p = [], prefix
    n, t, s, m, sm = cfg.network, cfg.train, cfg.save, cfg.model, cfg.sample
    _choice(e, f"{p}network.type", n.type, NETWORK_TYPES)
    _positive(e, f"{p}network.linear", n.linear)
    if n.linear_alpha is not None and n.linear_alpha <= 0:
        e.append(f"{p}network.linear_alpha: must be > 0, got {n.linear_alpha}")
    if not 0 <= n.dropout < 1:
        e.append(f"{p}network.dropout: must be in [0, 1), got {n.dropout}")
    if n.lokr_factor != -1 and n.lokr_factor < 1:
        e.append(f"{p}network.lokr_factor: -1 (balanced) or a positive factor, got {n.lokr_factor}")
    if not (isinstance(n.target, str) or (isinstance(n.target, list) and n.target
                                          and all(isinstance(x, str) for x in n.target))):
        e.append(f"{p}network.target: a preset name or a non-empty list of name patterns, got {n.target!r}")
    for k, v in n.network_kwargs.items():
        if k not in ("only_if_contains", "ignore_if_contains"):
            e.append(f"{p}network.network_kwargs.{k}: unknown; supported: only_if_contains, ignore_if_contains")
        elif not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            e.append(f"{p}network.network_kwargs.{k}: expected a list of strings, got {v!r}")
    if n.type in ("lokr", "loha") and s.format == "peft":
        e.append(f"{p}save.format: 'peft' cannot hold {n.type} adapters (diffusers has no {n.type}); use 'kohya'")

    _choice(e, f"{p}save.format", s.format, FILE_FORMATS)
    _choice(e, f"{p}save.dtype", s.dtype, DTYPES)
    _positive(e, f"{p}save.save_every", s.save_every)
    _positive(e, f"{p}save.max_step_saves_to_keep", s.max_step_saves_to_keep)

    _positive(e, f"{p}train.steps", t.steps)
    _positive(e, f"{p}train.batch_size", t.batch_size)
    _positive(e, f"{p}train.gradient_accumulation_steps", t.gradient_accumulation_steps)
    if t.lr is None or t.lr <= 0:
        e.append(f"{p}train.lr: must be > 0, got {t.lr}")
    _choice(e, f"{p}train.optimizer", t.optimizer, OPTIMIZERS)
    _choice(e, f"{p}train.lr_scheduler", t.lr_scheduler, SCHEDULERS)
    _positive(e, f"{p}train.lr_warmup_steps", t.lr_warmup_steps, 0)
    if t.lr_warmup_steps >= t.steps > 0:
        e.append(f"{p}train.lr_warmup_steps: {t.lr_warmup_steps} warm-up steps leave nothing of {t.steps} steps")
    if t.max_grad_norm < 0:
        e.append(f"{p}train.max_grad_norm: must be >= 0 (0 = no clipping), got {t.max_grad_norm}")
    from .timesteps import TIMESTEP_TYPES
    _choice(e, f"{p}train.timestep_type", t.timestep_type, TIMESTEP_TYPES)
    if t.shift <= 0:
        e.append(f"{p}train.shift: must be > 0, got {t.shift}")
    if t.noise_scheduler not in ("flowmatch", "flow_match"):
        e.append(f"{p}train.noise_scheduler: Flux trains with 'flowmatch', got {t.noise_scheduler!r}")
    _choice(e, f"{p}train.dtype", t.dtype, DTYPES)
    if not t.train_unet:
        e.append(f"{p}train.train_unet: false leaves nothing to train (text encoder training is not available)")
    if t.train_text_encoder:
        e.append(f"{p}train.train_text_encoder: text encoder training is not available yet; set it to false")
    for k in t.optimizer_params:
        if k not in ("weight_decay", "betas", "eps"):
            e.append(f"{p}train.optimizer_params.{k}: unknown; supported: weight_decay, betas, eps")
    if not 0 <= t.ema_config.ema_decay < 1:
        e.append(f"{p}train.ema_config.ema_decay: must be in [0, 1), got {t.ema_config.ema_decay}")

    if m.arch != "flux":
        e.append(f"{p}model.arch: only 'flux' is available, got {m.arch!r}")
    _choice(e, f"{p}model.dtype", m.dtype, DTYPES)
    if m.name_or_path is None:
        _choice(e, f"{p}model.size", m.size, MODEL_SIZES)
    elif check_files and not os.path.exists(m.name_or_path):
        e.append(f"{p}model.name_or_path: no such file or folder: {m.name_or_path}")

    _positive(e, f"{p}sample.sample_every", sm.sample_every, 0)
    _positive(e, f"{p}sample.sample_steps", sm.sample_steps)
    _positive(e, f"{p}sample.num_samples", sm.num_samples)
    for k in ("width", "height"):
        v = getattr(sm, k)
        if v is None or v <= 0 or v % 16:
            e.append(f"{p}sample.{k}: must be a positive multiple of 16, got {v}")
    for i, f in enumerate(sm.prompt_embeds):
        if check_files and not os.path.isfile(f):
            e.append(f"{p}sample.prompt_embeds[{i}]: no such file: {f}")

    if not cfg.datasets and cfg.synthetic is None:
        e.append(f"{p}datasets: no dataset (give datasets: [{{folder_path: ...}}] or synthetic: {{...}})")
    for i, d in enumerate(cfg.datasets):
        where = f"{p}datasets[{i}]"
        _positive(e, f"{where}.num_repeats", d.num_repeats)
        if not d.folder_path:
            e.append(f"{where}.folder_path: required")
        elif check_files:
            if not os.path.isdir(d.folder_path):
                e.append(f"{where}.folder_path: no such folder: {d.folder_path}")
            elif not any(x.endswith(".safetensors") for x in os.listdir(d.folder_path)):
                e.append(f"{where}.folder_path: {d.folder_path} holds no .safetensors files (one per sample, with "
                         f"'latents', 'prompt_embeds' and 'pooled_prompt_embeds')")
    if cfg.synthetic is not None:
        sy = cfg.synthetic
        _positive(e, f"{p}synthetic.num_samples", sy.num_samples)
        _positive(e, f"{p}synthetic.text_length", sy.text_length)
        for k in ("width", "height"):
            v = getattr(sy, k)
            if v <= 0 or v % 16:
                e.append(f"{p}synthetic.{k}: must be a positive multiple of 16, got {v}")
    _positive(e, f"{p}log_every", cfg.log_every)
    if cfg.max_gpu_memory is not None:
        try:
            if max_gpu_memory_bytes(cfg.max_gpu_memory) <= 0:
                raise ValueError
        except (TypeError, ValueError):
            e.append(f"{p}max_gpu_memory: a size such as '12GiB' or '24 GB', or a number of GiB, got "
                     f"{cfg.max_gpu_memory!r}")
    if cfg.device is not None:
        dev = str(cfg.device)
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            e.append(f"{p}device: 'cpu', 'cuda' or 'cuda:N', got {dev!r}")
        elif dev.startswith("cuda"):
            from flame_core import backend
            if not backend.cuda_available():
                e.append(f"{p}device: {dev} requested but no GPU is visible to CuPy (use device: cpu)")
    return e


# ----------------------------------------------------------------------------- entry points
def config_from_dict(data, source="<dict>", check_files=True):
    """A validated TrainConfig from an ai-toolkit-style mapping (or a bare process mapping)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    errors, warnings = [], []
    if "config" in data:
        for k in data:
            if k not in ("job", "config", "meta"):
                errors.append(f"{k}: unknown top-level field (expected job, config, meta)")
        c = data["config"]
        if not isinstance(c, dict):
            raise ConfigError(f"{source}: config: expected a mapping")
        procs = c.get("process")
        if not isinstance(procs, list) or not procs or not isinstance(procs[0], dict):
            raise ConfigError(f"{source}: config.process: expected a list with one process mapping")
        if len(procs) > 1:
            errors.append("config.process: only one process is supported, got %d" % len(procs))
        for k in c:
            if k not in ("name", "process"):
                errors.append(f"config.{k}: unknown field (expected name, process)")
        proc = dict(procs[0])
        if "name" in c:
            proc.setdefault("name", c["name"])
        prefix = "config.process[0]"
    else:
        proc, prefix = data, ""
    cfg = _build(TrainConfig, proc, prefix, errors, warnings)
    errors += validate(cfg, prefix + "." if prefix else "", check_files)
    if errors:
        raise ConfigError(f"{source}: {len(errors)} problem(s) in the training config:\n  " + "\n  ".join(errors))
    cfg.warnings = warnings
    return cfg


def load_config(path, check_files=True):
    """Read and validate a YAML training config."""
    import yaml
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as ex:
            raise ConfigError(f"{path}: not valid YAML: {ex}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    return config_from_dict(data, path, check_files)


def max_gpu_memory_bytes(value):
    """Bytes of a max_gpu_memory setting: a size string ('12GiB', '24 GB', '512MiB') or a number of GiB."""
    from flame_core.memory.stats import parse_size
    if isinstance(value, bool):
        raise TypeError("max_gpu_memory: expected a size, got a boolean")
    if isinstance(value, (int, float)):
        return int(value * 2 ** 30)
    if isinstance(value, str) and value.strip().replace(".", "", 1).isdigit():
        return int(float(value) * 2 ** 30)
    return parse_size(value)


def dtype_name(name):
    """'bf16' -> 'bfloat16' etc. (a flame dtype name)."""
    return DTYPES[name]
