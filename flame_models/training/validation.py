"""Every check of a TrainConfig that can run before anything is loaded: ranges, contradictions between fields, the
model family's own checks, and (check_files) the model file's and the dataset files' headers."""
import difflib
import math
import os

from flame_core.memory.stats import parse_budget

from ..checkpoint_io import hub_cache
from ..data.config import validate_dataset_config
from ..samplers import PREDICTION_TYPES
from . import base_loras, prompt_options
from .config import DTYPES, FILE_FORMATS, NETWORK_TYPES, OPTIMIZERS, PROCESS_TYPES, SCHEDULERS
from .limits import steps_problems
from .loss_types import HUBER_SCHEDULES, LOSS_TYPES
from .objective import DENSITY_SCHEMES, WEIGHTING_SCHEMES
from .timesteps import MODE_SCALE_RANGE
from .validation_loss import timestep_problems

NUM_TRAIN_TIMESTEPS = 1000  # the DDPM schedule of SDXL

# which timestep types read which train.* settings (a setting given for another type would be ignored)
_TIMESTEP_SETTINGS = {"shift": ("shift",), "sigmoid_scale": ("sigmoid", "shift", "flux_shift"),
                      "logit_mean": ("logit_normal",), "logit_std": ("logit_normal",), "mode_scale": ("mode",)}


def choice(errors, path, value, choices):
    if value not in choices:
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        errors.append(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}"
                      + (f"; did you mean '{near[0]}'?" if near else ""))


def _at_least(errors, path, value, minimum=1):
    if value < minimum:
        errors.append(f"{path}: must be >= {minimum}, got {value}")


SAVE_FORMATS = ("safetensors", "diffusers")   # save.save_format (ai-toolkit's values)

# the network settings of adapters: a full fine-tune has none of them
_ADAPTER_SETTINGS = ("linear", "linear_alpha", "dropout", "rslora", "lokr_factor", "lokr_full_rank", "target", "conv",
                     "conv_alpha", "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio",
                     "rank_dropout", "module_dropout")


def _full_problems(cfg, p):
    """What network.type full cannot be given with: the adapters' settings, the LoRA file's layout, and what this
    version does not train in full (fp8-stored or streamed blocks; text encoders: see validate's family checks)."""
    e, given, t, m = [], cfg.given, cfg.train, cfg.model
    if cfg.network.pretrained_lora_path is not None:
        e.append(f"{p}network.pretrained_lora_path: a LoRA to train on; network.type full trains the model's own "
                 f"weights -- bake the LoRA into the model first (python -m flame_nn.adapters.bake) and train the "
                 f"baked file")
    for k in _ADAPTER_SETTINGS:
        if f"network.{k}" in given:
            e.append(f"{p}network.{k}: an adapter setting; network.type full trains the model's own weights (pick them "
                     f"with network.network_kwargs only_if_contains / ignore_if_contains)")
    if "save.format" in given:
        e.append(f"{p}save.format: the LoRA file's layout; a full fine-tune writes the model in its own checkpoint "
                 f"layout (leave save.format out), or as a diffusers folder with save.save_format: diffusers")
    if m.quantize:
        e.append(f"{p}model.quantize: fp8-stored weights cannot be trained in full; leave it out with network.type "
                 f"full")
    for k in ("assistant_lora_path", "inference_lora_path"):
        if getattr(m, k):
            e.append(f"{p}model.{k}: previews of adapters beside the weights; a full fine-tune trains the weights "
                     f"themselves (model.lora_path merges a LoRA into them before training)")
    if t.full_bf16 and t.optimizer not in ("adamw8bit", "adafactor"):
        e.append(f"{p}train.full_bf16: bf16 weights need adamw8bit or adafactor (their stochastic rounding keeps "
                 f"small updates), got {t.optimizer}")
    if t.full_bf16 and m.dtype not in ("bf16", "bfloat16"):
        e.append(f"{p}train.full_bf16: keeps the weights in model.dtype, which must then be bf16 (got {m.dtype})")
    if cfg.max_gpu_memory is not None:   # the blocks stream and each is updated inside backward (layer-wise)
        why = "max_gpu_memory with network.type full updates each streamed block inside backward"
        if t.optimizer in ("prodigy", "adamw_schedulefree"):
            e.append(f"{p}train.optimizer: {why}, and {t.optimizer} couples the parameters (a block's step is not its "
                     f"part of a whole step); use adafactor (kohya's choice for Flux: its factored state is a few "
                     f"MiB), adamw8bit, adamw or lion")
        if t.gradient_accumulation_steps > 1:
            e.append(f"{p}train.gradient_accumulation_steps: {why}, so gradients cannot accumulate over micro-batches "
                     f"(got {t.gradient_accumulation_steps}); raise train.batch_size instead")
        if t.ema_config.use_ema:
            e.append(f"{p}train.ema_config.use_ema: {why}; an EMA of every weight would need the whole model's "
                     f"float32 copy on the GPU, what max_gpu_memory avoids")
    return e


def validate(cfg, prefix="", check_files=True):
    """Every problem of a TrainConfig, as a list of messages (empty: valid)."""
    from .family import get_family
    e, p, given = [], prefix, cfg.given
    n, t, s, m, sm = cfg.network, cfg.train, cfg.save, cfg.model, cfg.sample
    choice(e, f"{p}type", cfg.type, PROCESS_TYPES)
    if not cfg.name or os.sep in cfg.name or cfg.name in (".", ".."):
        e.append(f"{p}name: a non-empty name without '{os.sep}' (it names the run's folder), got {cfg.name!r}")

    choice(e, f"{p}network.type", n.type, NETWORK_TYPES)
    _at_least(e, f"{p}network.linear", n.linear)
    if n.linear_alpha <= 0:
        e.append(f"{p}network.linear_alpha: must be > 0, got {n.linear_alpha}")
    swn = t.scale_weight_norms
    if swn is not None:
        if isinstance(swn, bool) or not isinstance(swn, (int, float)) or not swn > 0 or swn == float("inf"):
            e.append(f"{p}train.scale_weight_norms: a norm > 0 (kohya's max-norm; 1.0 its suggestion), got {swn!r}")
        elif n.type not in ("lora", "locon"):
            e.append(f"{p}train.scale_weight_norms: kohya's max-norm scales LoRA / LoCon adapters; network.type is "
                     f"{n.type}")
    for k in ("dropout", "rank_dropout", "module_dropout"):
        if not 0 <= getattr(n, k) < 1:
            e.append(f"{p}network.{k}: must be in [0, 1), got {getattr(n, k)}")
    if n.type in ("lokr", "loha"):
        for k in ("rank_dropout", "module_dropout"):
            if getattr(n, k):
                e.append(f"{p}network.{k}: LoRA's, DoRA's and LoCon's (kohya's); network.type {n.type} has none")
    if n.lokr_factor != -1 and n.lokr_factor < 1:
        e.append(f"{p}network.lokr_factor: -1 (balanced) or a positive factor, got {n.lokr_factor}")
    for k in ("lokr_factor", "lokr_full_rank"):
        if f"network.{k}" in given and n.type != "lokr":
            e.append(f"{p}network.{k}: only used by network type 'lokr' (the type is {n.type!r})")
    if n.type in ("lokr", "loha"):
        if n.dropout:
            e.append(f"{p}network.dropout: {n.type} adapters have no input dropout; use 0")
        if n.rslora:
            e.append(f"{p}network.rslora: only LoRA and DoRA scale by alpha/sqrt(rank)")
    if n.target is not None and not (isinstance(n.target, str) or (
            isinstance(n.target, list) and n.target and all(isinstance(x, str) for x in n.target))):
        e.append(f"{p}network.target: a preset name or a non-empty list of name patterns, got {n.target!r}")
    for k, v in n.network_kwargs.items():
        if k not in ("only_if_contains", "ignore_if_contains"):
            e.append(f"{p}network.network_kwargs.{k}: unknown; supported: only_if_contains, ignore_if_contains, "
                     f"rank_dropout, module_dropout")
        elif not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            e.append(f"{p}network.network_kwargs.{k}: expected a list of strings, got {v!r}")
    if n.conv is not None and n.conv < 0:
        e.append(f"{p}network.conv: the convolutions' rank, >= 1 (0 or null: none), got {n.conv}")
    if n.conv_alpha is not None and n.conv_alpha <= 0:
        e.append(f"{p}network.conv_alpha: must be > 0, got {n.conv_alpha}")
    if n.conv and n.type not in ("lora", "locon"):
        e.append(f"{p}network.conv: convolution adapters are LoRA (LoCon) only; network.type is {n.type!r} (use "
                 f"lora or locon, or leave conv out)")
    if n.conv_alpha is not None and not n.conv:
        e.append(f"{p}network.conv_alpha: only used with network.conv (the convolutions' rank), which is not set")
    for k in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        v = getattr(n, k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            e.append(f"{p}network.{k}: a ratio > 0 (LoRA+: the up matrices' lr = lr x ratio), got {v!r}")
        elif n.type in ("lokr", "loha"):
            e.append(f"{p}network.{k}: LoRA+ scales the up (B) matrices of LoRA / DoRA / LoCon; network.type "
                     f"{n.type!r} has none")
        elif k == "loraplus_text_encoder_lr_ratio" and not t.train_text_encoder:
            e.append(f"{p}network.{k}: only used with train.train_text_encoder, which is false")
        elif t.optimizer == "prodigy" and v != 1:
            e.append(f"{p}network.{k}: prodigy takes one lr for every parameter group (it estimates the step size "
                     f"itself); LoRA+ needs another optimizer")
    if n.type in ("lokr", "loha") and s.format == "peft":
        e.append(f"{p}save.format: 'peft' cannot hold {n.type} adapters (diffusers has no {n.type}); use 'kohya'")

    if n.type == "full":
        e += _full_problems(cfg, p)
    elif t.full_bf16:
        e.append(f"{p}train.full_bf16: the weights' dtype of a full fine-tune; network.type is {n.type!r}")

    choice(e, f"{p}save.format", s.format, FILE_FORMATS)
    choice(e, f"{p}save.save_format", s.save_format, SAVE_FORMATS)
    if s.save_format == "diffusers" and n.type != "full":
        e.append(f"{p}save.save_format: diffusers writes a full fine-tune's model as a diffusers folder; a "
                 f"{n.type} is one .safetensors file (save.format: peft writes diffusers' LoRA layout)")
    choice(e, f"{p}save.dtype", s.dtype, DTYPES)
    _at_least(e, f"{p}save.save_every", s.save_every)
    _at_least(e, f"{p}save.max_step_saves_to_keep", s.max_step_saves_to_keep)

    _at_least(e, f"{p}train.steps", t.steps)
    e += steps_problems(t.steps, t.gradient_accumulation_steps, p)  # before anything is laid out for them
    for name, v, other in (("train.epochs", t.epochs, "train.steps"),
                           ("save.save_every_epochs", s.save_every_epochs, "save.save_every")):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            e.append(f"{p}{name}: an integer >= 1, got {v!r}")
        elif other in given:
            e.append(f"{p}{name}: given together with {p}{other}, which it sets; give one")
        elif not cfg.datasets:
            e.append(f"{p}{name}: counts epochs of image datasets; this run has none (give {other})")
    _at_least(e, f"{p}train.batch_size", t.batch_size)
    _at_least(e, f"{p}train.gradient_accumulation_steps", t.gradient_accumulation_steps)
    if t.lr <= 0:
        e.append(f"{p}train.lr: must be > 0, got {t.lr}")
    choice(e, f"{p}train.optimizer", t.optimizer, OPTIMIZERS)
    choice(e, f"{p}train.lr_scheduler", t.lr_scheduler, SCHEDULERS)
    _at_least(e, f"{p}train.lr_warmup_steps", t.lr_warmup_steps, 0)
    if t.lr_warmup_steps >= t.steps > 0:
        e.append(f"{p}train.lr_warmup_steps: {t.lr_warmup_steps} warm-up steps leave nothing of {t.steps} steps")
    if t.max_grad_norm < 0:
        e.append(f"{p}train.max_grad_norm: must be >= 0 (0 = no clipping), got {t.max_grad_norm}")
    v = t.max_grad_value
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
        e.append(f"{p}train.max_grad_value: null (no clipping by value) or a number > 0, got {v!r}")
    if t.shift <= 0:
        e.append(f"{p}train.shift: must be > 0, got {t.shift}")
    if t.sigmoid_scale <= 0:
        e.append(f"{p}train.sigmoid_scale: must be > 0, got {t.sigmoid_scale}")
    if t.logit_std <= 0:
        e.append(f"{p}train.logit_std: must be > 0, got {t.logit_std}")
    lo, hi = MODE_SCALE_RANGE
    if not lo < t.mode_scale < hi:
        e.append(f"{p}train.mode_scale: must lie in ({lo:g}, {hi:.4f}) (sigma stays in [0, 1] and decreasing), got "
                 f"{t.mode_scale}")
    choice(e, f"{p}train.weighting_scheme", t.weighting_scheme, WEIGHTING_SCHEMES)
    if t.weighting_scheme in DENSITY_SCHEMES and t.timestep_type != t.weighting_scheme:
        e.append(f"{p}train.weighting_scheme: {t.weighting_scheme!r} names a timestep density (diffusers, kohya): "
                 f"it needs train.timestep_type {t.weighting_scheme!r} (leave timestep_type out to get it), got "
                 f"{t.timestep_type!r}")
    if t.noise_offset < 0:
        e.append(f"{p}train.noise_offset: must be >= 0, got {t.noise_offset}")
    choice(e, f"{p}train.prediction_type", t.prediction_type, PREDICTION_TYPES)
    if t.min_snr_gamma is not None and t.min_snr_gamma <= 0:
        e.append(f"{p}train.min_snr_gamma: must be > 0 (5 is the paper's; remove the key for no weighting), got "
                 f"{t.min_snr_gamma}")
    if not 0 <= t.min_timestep < t.max_timestep <= NUM_TRAIN_TIMESTEPS:
        e.append(f"{p}train.min_timestep / max_timestep: timesteps are drawn from [min_timestep, max_timestep) "
                 f"within [0, {NUM_TRAIN_TIMESTEPS}], got [{t.min_timestep}, {t.max_timestep})")
    for k, kinds in _TIMESTEP_SETTINGS.items():
        if f"train.{k}" in given and t.timestep_type not in kinds:
            e.append(f"{p}train.{k}: only used by timestep_type {' / '.join(kinds)} (the type is "
                     f"{t.timestep_type!r})")
    choice(e, f"{p}train.dtype", t.dtype, DTYPES)
    if not t.train_unet:
        e.append(f"{p}train.train_unet: false is not available (the text encoders train beside the UNet / "
                 f"transformer, not alone)")
    if not 0 <= t.ip_noise_gamma < float("inf"):
        e.append(f"{p}train.ip_noise_gamma: must be >= 0, got {t.ip_noise_gamma}")
    if t.ip_noise_gamma_random_strength and not t.ip_noise_gamma:
        e.append(f"{p}train.ip_noise_gamma_random_strength: only used with train.ip_noise_gamma > 0")
    choice(e, f"{p}train.loss_type", t.loss_type, LOSS_TYPES)
    if t.huber_schedule is not None:
        choice(e, f"{p}train.huber_schedule", t.huber_schedule, HUBER_SCHEDULES)
    if not 0 < t.huber_c <= 1:
        e.append(f"{p}train.huber_c: must be in (0, 1], got {t.huber_c}")
    if not t.huber_scale > 0:
        e.append(f"{p}train.huber_scale: must be > 0, got {t.huber_scale}")
    for k in ("huber_c", "huber_schedule", "huber_scale"):
        if f"train.{k}" in given and t.loss_type not in ("huber", "smooth_l1"):
            e.append(f"{p}train.{k}: only used by loss_type huber / smooth_l1 (the type is {t.loss_type!r})")
    if t.text_encoder_lr is not None and t.text_encoder_lr <= 0:
        e.append(f"{p}train.text_encoder_lr: must be > 0, got {t.text_encoder_lr}")
    if t.text_encoder_lr is not None and not t.train_text_encoder:
        e.append(f"{p}train.text_encoder_lr: only used with train.train_text_encoder, which is false")
    if t.train_text_encoder:
        if cfg.synthetic is not None or sm.prompt_embeds:
            e.append(f"{p}train.train_text_encoder: needs captions to encode -- image folders (datasets), not "
                     f"{'synthetic samples' if cfg.synthetic is not None else 'sample.prompt_embeds'}")
    if not 0 <= t.ema_config.ema_decay < 1:
        e.append(f"{p}train.ema_config.ema_decay: must be in [0, 1), got {t.ema_config.ema_decay}")

    choice(e, f"{p}model.dtype", m.dtype, DTYPES)
    if m.t5_max_length is not None and not 1 <= m.t5_max_length <= 512:
        e.append(f"{p}model.t5_max_length: T5 tokens per caption, 1 to 512, got {m.t5_max_length}")
    if m.name_or_path is not None and m.size is not None:
        e.append(f"{p}model.size: a random-init preset, but model.name_or_path is given (its config is read from "
                 f"the file); remove one")

    _at_least(e, f"{p}sample.sample_every", sm.sample_every, 0)
    _at_least(e, f"{p}sample.sample_start_step", sm.sample_start_step, 0)
    _at_least(e, f"{p}sample.sample_steps", sm.sample_steps)
    _at_least(e, f"{p}sample.num_samples", sm.num_samples)
    if sm.network_multiplier != 1.0 and n.type == "full":
        e.append(f"{p}sample.network_multiplier: a full fine-tune has no adapters to weigh (network.type full)")
    if not (sm.neg is None or sm.neg is False or isinstance(sm.neg, str)):
        e.append(f"{p}sample.neg: a negative prompt (a string; false or \"\" for none), got {sm.neg!r}")
    if sm.slg_scale < 0:
        e.append(f"{p}sample.slg_scale: must be >= 0 (0: no skip-layer guidance), got {sm.slg_scale}")
    if not 0 <= sm.guidance_rescale <= 1:
        e.append(f"{p}sample.guidance_rescale: a number in [0, 1] (0: none), got {sm.guidance_rescale}")
    if not sm.true_cfg >= 1:
        e.append(f"{p}sample.true_cfg: the true-CFG scale, >= 1 (1: none), got {sm.true_cfg}")
    _at_least(e, f"{p}sample.true_cfg_start", sm.true_cfg_start, 0)
    if not (sm.slg_layers and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                  for i in sm.slg_layers)):
        e.append(f"{p}sample.slg_layers: a non-empty list of joint block indices (>= 0), got {sm.slg_layers!r}")
    if sm.prompt_embeds and "sample.num_samples" in given:
        e.append(f"{p}sample.num_samples: picks dataset items to sample with, but sample.prompt_embeds gives the "
                 f"prompts; remove one")

    if not cfg.datasets and cfg.synthetic is None:
        e.append(f"{p}datasets: no dataset (give datasets: [{{folder_path: ...}}] or synthetic: {{...}})")
    if cfg.datasets and cfg.synthetic is not None:
        e.append(f"{p}synthetic: given together with datasets; use one")
    for i, d in enumerate(cfg.datasets):
        e += validate_dataset_config(d, f"{p}datasets[{i}]", check_files=False)
    e += _reg_problems(cfg, p)
    if any(d.control_path is not None for d in cfg.datasets):
        for i, d in enumerate(cfg.datasets):
            if d.control_path is None:
                e.append(f"{p}datasets[{i}].control_path: missing; another dataset has control images, and every "
                         f"sample of a run needs one (give this folder's control_path too)")
    if cfg.synthetic is not None:
        sy = cfg.synthetic
        _at_least(e, f"{p}synthetic.num_samples", sy.num_samples)
        _at_least(e, f"{p}synthetic.text_length", sy.text_length)
        if sm.prompts:
            e.append(f"{p}sample.prompts: the synthetic dataset's conditioning is random, not a text encoder's: "
                     f"prompts would mean nothing to the model (use an image folder, or leave prompts out)")
    if cfg.trigger_word is not None and not cfg.trigger_word.strip():
        e.append(f"{p}trigger_word: an empty trigger word; remove the key or give a word")
    e += _preservation_problems(cfg, p)
    e += _prior_reg_problems(cfg, p)
    for i, x in enumerate(sm.prompts):
        if not isinstance(x, str) or not x.strip():
            e.append(f"{p}sample.prompts[{i}]: expected a non-empty string, got {x!r}")
    if sm.prompts and sm.prompt_embeds:
        e.append(f"{p}sample.prompt_embeds: given together with sample.prompts; use one")
    if sm.prompts and "sample.num_samples" in given:
        e.append(f"{p}sample.num_samples: picks dataset items to sample with, but sample.prompts gives the "
                 f"prompts; remove one")
    _at_least(e, f"{p}log_every", cfg.log_every)
    pl = cfg.performance_log_every
    if isinstance(pl, bool) or not isinstance(pl, int) or pl < 0:
        e.append(f"{p}performance_log_every: an integer >= 0 (steps between timing reports; 0: none), got {pl!r}")
    lg = cfg.logging
    for name in ("use_tensorboard", "use_wandb", "verbose"):
        if not isinstance(getattr(lg, name), bool):
            e.append(f"{p}logging.{name}: expected true or false, got {getattr(lg, name)!r}")
    for name in ("project_name", "run_name"):
        v = getattr(lg, name)
        if v is not None and (not isinstance(v, str) or not v.strip() or any(c in v for c in "/\\")):
            e.append(f"{p}logging.{name}: expected a name without slashes, got {v!r}")
    if lg.log_every is not None:
        _at_least(e, f"{p}logging.log_every", lg.log_every)
    e += validation_problems(cfg, p)
    if cfg.train.offload_activations and cfg.max_gpu_memory is None:
        e.append(f"{p}train.offload_activations: the block inputs are offloaded by the streamed blocks of "
                 f"max_gpu_memory; set max_gpu_memory (or leave offload_activations null)")
    if cfg.max_gpu_memory is not None:
        try:
            parse_budget(cfg.max_gpu_memory, f"{p}max_gpu_memory")
        except ValueError as err:
            e.append(str(err))
        for i, d in enumerate(cfg.datasets):
            if d.resolution_mode == "short_side" and d.max_aspect > 1:
                e.append(f"{p}datasets[{i}].resolution_mode: short_side buckets hold up to max_aspect x "
                         f"resolution² pixels, more than the step that max_gpu_memory's auto-fit measures; use "
                         f"resolution_mode area (or max_aspect 1) under a budget")
        for k in ("lora_path", "assistant_lora_path"):
            if getattr(cfg.model, k) and cfg.model.name_or_path is None:
                e.append(f"{p}model.{k}: merged into the weights as they are read; a random model's streamed blocks "
                         f"are drawn as they are packed (give model.name_or_path, or run without max_gpu_memory)")
    if cfg.device is not None:
        dev = str(cfg.device)
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            e.append(f"{p}device: 'cpu', 'cuda' or 'cuda:N', got {dev!r}")
        elif dev.startswith("cuda"):
            from flame_core import backend
            if not backend.cuda_available():
                e.append(f"{p}device: {dev} requested but no GPU is visible to CuPy (use device: cpu)")

    try:
        family = get_family(m.arch)
    except ValueError as ex:
        e.append(f"{p}model.arch: {ex}")
        return e
    e += _family_checks(cfg, family, p)
    if check_files:
        e += file_problems(cfg, family, p)
    return e


def _preservation_problems(cfg, p):
    """train.diff_output_preservation / blank_prompt_preservation (ai-toolkit's, one of them): image folders (the
    preservation prompts are encoded with the captions), the adapters (switched off for the prior prediction) and
    the text embeddings cached (trained text encoders would change the preservation prompt's embedding too, as
    ai-toolkit refuses for the first); the differential one a class word and a trigger word in every caption to
    replace by it (the run's or each dataset's); each one's multiplier (and class) only with it."""
    e, t = [], cfg.train
    for kind, extra in (("diff_output", ("multiplier", "class")), ("blank_prompt", ("multiplier",))):
        if not getattr(t, f"{kind}_preservation"):
            for k in extra:
                if f"train.{kind}_preservation_{k}" in cfg.given:
                    e.append(f"{p}train.{kind}_preservation_{k}: only used with train.{kind}_preservation: true")
            continue
        setting = f"{p}train.{kind}_preservation"
        mult = getattr(t, f"{kind}_preservation_multiplier")
        if not mult >= 0:
            e.append(f"{setting}_multiplier: the preservation loss's weight, >= 0, got {mult}")
        if not cfg.datasets:
            e.append(f"{setting}: needs image folders with captions (the preservation prompts are encoded with them)")
        if t.train_text_encoder:
            e.append(f"{setting}: not with train.train_text_encoder (the preservation prompt's embedding would train "
                     f"too)")
        if cfg.network.type == "full":
            e.append(f"{setting}: the prior prediction is the model without its adapters; a full fine-tune trains "
                     f"the weights themselves")
    if t.diff_output_preservation and t.blank_prompt_preservation:
        e.append(f"{p}train.blank_prompt_preservation: give one of it and train.diff_output_preservation (each holds "
                 f"the model's prediction for its own prompt)")
    cls = t.diff_output_preservation_class
    if t.diff_output_preservation:
        if not isinstance(cls, str) or not cls.strip():
            e.append(f"{p}train.diff_output_preservation_class: the class word that replaces the trigger word in the "
                     f"preservation prompts (e.g. person), got {cls!r}")
        elif cfg.datasets and cfg.trigger_word is None and any(d.trigger_word is None for d in cfg.datasets):
            e.append(f"{p}train.diff_output_preservation: needs a trigger word (trigger_word, or each dataset's "
                     f"trigger_word): the preservation prompt is each caption with it replaced by the class word")
        elif cls.strip() in {cfg.trigger_word, *(d.trigger_word for d in cfg.datasets)}:
            e.append(f"{p}train.diff_output_preservation_class: {cls!r} is the trigger word itself")
    return e


def _prior_reg_problems(cfg, p):
    """Datasets' prior_reg (ai-toolkit's): the adapters (switched off for the prior prediction), the text embeddings
    cached (the prior takes the caption's conditioning as the step does), and other images to learn from."""
    e = []
    where = [f"{p}datasets[{i}].prior_reg" for i, d in enumerate(cfg.datasets) if getattr(d, "prior_reg", False)]
    if not where:
        return e
    if cfg.network.type == "full":
        e.append(f"{where[0]}: the prior prediction is the model without its adapters; a full fine-tune trains the "
                 f"weights themselves")
    if cfg.train.train_text_encoder:
        e.append(f"{where[0]}: not with train.train_text_encoder (the prior takes the caption's cached embedding)")
    if len(where) == len(cfg.datasets):
        e.append(f"{where[0]}: every dataset is prior_reg: the adapters would learn only to change nothing; give at "
                 f"least one dataset without it")
    return e


def _reg_problems(cfg, p):
    """Regularisation images (is_reg) and their settings: train.reg_weight / reg_ratio only with such a dataset
    (never accepted and ignored), and at least one dataset to train on besides them."""
    e, t = [], cfg.train
    regs = [d.is_reg is True for d in cfg.datasets]
    if t.reg_weight < 0:
        e.append(f"{p}train.reg_weight: the regularisation images' loss weight, >= 0, got {t.reg_weight}")
    if not 0 < t.reg_ratio < 1:
        e.append(f"{p}train.reg_ratio: the share of micro-batches drawn from the regularisation images, in (0, 1), "
                 f"got {t.reg_ratio}")
    if not any(regs):
        for k in ("reg_weight", "reg_ratio"):
            if f"train.{k}" in cfg.given:
                e.append(f"{p}train.{k}: no dataset has is_reg: true (regularisation images); give one or remove "
                         f"the key")
    elif all(regs):
        e.append(f"{p}datasets: every dataset is is_reg: true; regularisation images go beside the images being "
                 f"trained (give at least one dataset without is_reg)")
    return e


def validation_problems(cfg, p=""):
    """What is wrong with `validation:` (the files it names are checked in file_problems)."""
    v, e = cfg.validation, []
    if v is None:
        return e
    w = f"{p}validation"
    if v.folder_path is None and not v.split:
        e.append(f"{w}: give folder_path (a held-out image folder) or split (a fraction of the training images to "
                 f"hold out, e.g. 0.1)")
    if v.folder_path is not None and v.split:
        e.append(f"{w}.split: given together with folder_path; use one")
    if v.folder_path is not None and (not isinstance(v.folder_path, str) or not v.folder_path):
        e.append(f"{w}.folder_path: a folder of images with captions, got {v.folder_path!r}")
    if v.split and not 0 < v.split < 1:
        e.append(f"{w}.split: a fraction of each training folder's images in (0, 1), got {v.split}")
    if v.control_path is not None and v.folder_path is None:
        e.append(f"{w}.control_path: only with folder_path (a split takes its control images from the datasets)")
    _at_least(e, f"{w}.every", v.every)
    if v.batch_size is not None:
        _at_least(e, f"{w}.batch_size", v.batch_size)
    if v.max_batches is not None:
        _at_least(e, f"{w}.max_batches", v.max_batches)
    e += timestep_problems(v.timesteps, f"{w}.timesteps")
    if cfg.synthetic is not None:
        e.append(f"{w}: needs image folders (datasets); the synthetic samples have no held-out images")
    elif cfg.datasets and v.folder_path is not None:
        mine = os.path.realpath(v.folder_path)
        for i, d in enumerate(cfg.datasets):
            if not isinstance(d.folder_path, str) or not d.folder_path:
                continue
            theirs = os.path.realpath(d.folder_path)
            if mine == theirs or mine.startswith(theirs + os.sep) or theirs.startswith(mine + os.sep):
                e.append(f"{w}.folder_path: {v.folder_path} overlaps datasets[{i}].folder_path {d.folder_path} "
                         f"(folders are read recursively: its images would be trained on); use a separate folder, "
                         f"or validation.split")
    return e


def _validation_file_problems(cfg, family, kinds, p):
    v, e = cfg.validation, []
    if v is None:
        return e
    w = f"{p}validation"
    if any(k == "samples" for k in kinds):
        e.append(f"{w}: needs image folders; datasets of precomputed samples have no images to hold out")
    if v.folder_path is not None and isinstance(v.folder_path, str) and v.folder_path:
        from ..data.samples import dataset_kind
        if not os.path.isdir(v.folder_path):
            e.append(f"{w}.folder_path: no such folder: {v.folder_path}")
        elif dataset_kind(v.folder_path) != "images":
            e.append(f"{w}.folder_path: {v.folder_path} holds no images")
        controls = any(d.control_path is not None for d in cfg.datasets)
        if v.control_path is not None and not family.control_images:
            e.append(f"{w}.control_path: the {family.name} family takes no control images")
        elif v.control_path is None and controls:
            e.append(f"{w}.control_path: missing; the datasets have control images, and every held-out image needs "
                     f"one too (give the folder of its control images)")
        elif v.control_path is not None and not os.path.isdir(v.control_path):
            e.append(f"{w}.control_path: no such folder: {v.control_path}")
    return e


def _family_checks(cfg, family, p):
    from .config import _asks_for_nothing
    from .family import FAMILY_FIELDS
    e = []
    for path in FAMILY_FIELDS:
        if path in cfg.given and path not in family.fields:
            section, name = path.split(".")
            if not _asks_for_nothing(getattr(getattr(cfg, section), name)):
                e.append(f"{p}{path}: not available: " + family.field_notes.get(
                    path, f"the {family.name} family does not use it"))
    e += family.config_problems(cfg, p)
    if not family.control_images:
        for i, d in enumerate(cfg.datasets):
            if d.control_path is not None:
                e.append(f"{p}datasets[{i}].control_path: the {family.name} family takes no control images "
                         f"(model.arch flux_kontext trains on pairs)")
    e += prompt_options.problems(cfg, family, p)   # the sample prompts' flags (--w, --h, --d, --n, --ctrl_img, ...)
    mult = family.pixel_multiple
    for k in ("width", "height"):
        v = getattr(cfg.sample, k)
        if v is not None and (v <= 0 or v % mult):
            e.append(f"{p}sample.{k}: must be a positive multiple of {mult}, got {v}")
        sy = cfg.synthetic
        if sy is not None and (getattr(sy, k) <= 0 or getattr(sy, k) % mult):
            e.append(f"{p}synthetic.{k}: must be a positive multiple of {mult}, got {getattr(sy, k)}")
    from .timesteps import BIASES
    cs = cfg.train.content_or_style
    if cs not in BIASES:
        e.append(f"{p}train.content_or_style: one of {', '.join(BIASES)}, got {cs!r}")
    elif cs != "balanced" and "train.timestep_type" not in family.fields:
        e.append(f"{p}train.content_or_style: {cs!r} biases a flow-matching family's timesteps; the {family.name} "
                 f"family draws DDPM timesteps (train.min_timestep / max_timestep narrow them)")
    gr = cfg.train.guidance_range
    if gr is not None and "train.guidance_range" in family.fields:
        ok = isinstance(gr, (list, tuple)) and len(gr) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in gr)
        if not ok or gr[0] > gr[1]:
            e.append(f"{p}train.guidance_range: [min, max], two numbers with 0 <= min <= max (each sample's guidance "
                     f"drawn uniformly in them), got {gr!r}")
        elif "train.guidance" in cfg.given:
            e.append(f"{p}train.guidance: train.guidance_range draws each sample's guidance; give one of the two")
    if cfg.train.bypass_guidance_embedding and family.name not in ("flux", "flux_kontext"):
        e.append(f"{p}train.bypass_guidance_embedding: Flux's (a guidance-embedding Flux trains without it); the "
                 f"{family.name} family has no guidance embedding")
    if cfg.train.train_text_encoder and family.text_encoder_targets is None:
        e.append(f"{p}train.train_text_encoder: the {family.name} family cannot train its text encoders (available "
                 f"for sdxl)")
    if cfg.network.type == "full" and cfg.train.train_text_encoder and family.name != "sdxl":
        e.append(f"{p}train.train_text_encoder: with network.type full only for SDXL (its checkpoint holds the text "
                 f"encoders; the {family.name} family writes its denoiser alone); train a LoRA to adapt them")
    elif cfg.network.type == "full" and cfg.train.train_text_encoder and not cfg.model.name_or_path:
        e.append(f"{p}train.train_text_encoder: with network.type full the written checkpoint takes the base "
                 f"model's VAE -- give model.name_or_path")
    if cfg.network.type == "full" and family.save_model is None:
        e.append(f"{p}network.type: full -- the {family.name} family cannot write its model (no save_model); train "
                 f"adapters")
    if cfg.network.conv and family.conv_targets is None:
        e.append(f"{p}network.conv: the {family.name} model has no convolutions to adapt (LoCon is for SDXL's "
                 f"UNet); leave network.conv out")
    if cfg.network.target is None and family.default_target is None:
        e.append(f"{p}network.target: required ({family.name} has no default preset)")
    return e


# the fields a folder of precomputed samples uses; every other dataset field is for image folders
SAMPLE_FOLDER_FIELDS = ("folder_path", "num_repeats", "shuffle")


def _ctrl_imgs(cfg):
    """[(i, path)] of the sample prompts with ai-toolkit's `--ctrl_img <path>` ('' when it has no path; prompts whose
    flags do not read are reported by prompt_options.problems)."""
    out = []
    for i, x in enumerate(cfg.sample.prompts):
        try:
            o = prompt_options.parse(x) if isinstance(x, str) else None
        except prompt_options.PromptOptionError:
            continue
        if o is not None and o.ctrl_img is not None:
            out.append((i, o.ctrl_img))
    return out


def dataset_kinds(cfg):
    """['images' | 'samples' | None per datasets entry] (data.dataset_kind of each folder)."""
    from ..data.samples import dataset_kind
    return [dataset_kind(d.folder_path) if d.folder_path else None for d in cfg.datasets]


def parts_needed(cfg, kinds):
    """(VAE?, text encoders?) a run needs: image folders need both; sample.prompts need the text encoders;
    precomputed samples are decoded for previews when model.vae_path names their VAE."""
    images = "images" in kinds
    return images or (bool(kinds) and cfg.model.vae_path is not None), images or bool(cfg.sample.prompts)


def file_problems(cfg, family, p=""):
    """What is wrong with the files the config names, read from their headers only (model first: the datasets'
    shapes are checked against it): the model, each dataset folder (image folders: that it holds images --
    every image is decoded by the trainer before any model is loaded; sample folders: every file's header), and
    the other parts the run needs (VAE, text encoders, tokenizers)."""
    from ..data.samples import scan_folder
    from .family import ModelFileError
    e, spec = [], None
    path = cfg.model.name_or_path
    lora = cfg.network.pretrained_lora_path
    if lora is not None and not os.path.isfile(lora):
        e.append(f"{p}network.pretrained_lora_path: no such file: {lora}")
    e += base_loras.file_problems(cfg, p)
    if path is not None and not os.path.exists(path):
        e.append(f"{p}model.name_or_path: no such file or folder: {path}"
                 + (f" ({hub_cache.fetch_hint(path)})" if hub_cache.looks_like_repo_id(path) else ""))
    else:
        try:
            spec = family.describe_model(cfg.model)
        except ModelFileError as ex:
            e.append(f"{p}model.name_or_path: {ex}")
    if spec is not None:
        e += family.spec_problems(cfg, spec, p)

    def check(shapes):
        return family.check_sample(shapes, spec)
    kinds = dataset_kinds(cfg)
    for i, (d, kind) in enumerate(zip(cfg.datasets, kinds)):
        where = f"{p}datasets[{i}]"
        if not d.folder_path:
            continue  # reported with the fields
        if not os.path.isdir(d.folder_path):
            e.append(f"{where}.folder_path: no such folder: {d.folder_path}")
            continue
        if kind is None:
            e.append(f"{where}.folder_path: {d.folder_path} holds neither images nor precomputed samples "
                     f"(.safetensors)")
        elif kind == "images" and isinstance(d.mask_path, str) and d.mask_path and not os.path.isdir(d.mask_path):
            e.append(f"{where}.mask_path: no such folder: {d.mask_path}")
        elif kind == "samples":
            extra = sorted(k.split(".", 1)[1] for k in cfg.given
                           if k.startswith(f"datasets[{i}].") and k.split(".", 1)[1] not in SAMPLE_FOLDER_FIELDS)
            for k in extra:
                e.append(f"{where}.{k}: only for image folders; {d.folder_path} holds precomputed samples")
            if cfg.train.train_text_encoder:
                e.append(f"{where}.folder_path: {d.folder_path} holds precomputed samples, but "
                         f"train.train_text_encoder needs image folders with captions")
            _, _, problems = scan_folder(d.folder_path, family.sample_keys, check)
            e += [f"{where}.folder_path: {x}" for x in problems[:20]]
            if len(problems) > 20:
                e.append(f"{where}.folder_path: ... and {len(problems) - 20} more files")
    e += _validation_file_problems(cfg, family, kinds, p)
    if "images" in kinds and "samples" in kinds:
        e.append(f"{p}datasets: image folders and precomputed-sample folders cannot be mixed in one run "
                 f"(datasets {[i for i, k in enumerate(kinds) if k == 'samples']} hold samples)")
    images = [d for d, k in zip(cfg.datasets, kinds) if k == "images"]
    if len({d.shuffle for d in images}) > 1:
        e.append(f"{p}datasets: image folders share one batch order; give every one the same shuffle value")
    vae, text = parts_needed(cfg, kinds)
    m = cfg.model
    if not vae and m.vae_path is not None:
        e.append(f"{p}model.vae_path: not used: the synthetic dataset's latents come from no VAE")
    if not text:
        if cfg.trigger_word is not None:
            e.append(f"{p}trigger_word: not used: this run has no captions (precomputed or synthetic samples) and "
                     f"no sample.prompts")
        for k in ("clip_l_path", "clip_g_path", "t5_path", "tokenizer_path", "quantize_te", "t5_max_length"):
            if f"model.{k}" in cfg.given and getattr(m, k) not in (None, False):
                e.append(f"{p}model.{k}: not used: no text is encoded in this run (no image folder, no "
                         f"sample.prompts)")
    if (vae or text) and spec is not None:
        e += family.parts_problems(cfg, vae=vae, text=text, prefix=p)
    for i, path in _ctrl_imgs(cfg):
        if not family.control_images or not path:
            continue  # reported with the fields
        if not vae:
            e.append(f"{p}sample.prompts[{i}]: --ctrl_img needs a VAE to encode it: image folders, or model.vae_path")
        elif not os.path.isfile(path):
            e.append(f"{p}sample.prompts[{i}]: --ctrl_img: no such file: {path}")
    for i, f in enumerate(cfg.sample.prompt_embeds):
        msg = sample_file_problem(f, family, spec)
        if msg:
            e.append(f"{p}sample.prompt_embeds[{i}]: {msg}")
    return e


def sample_file_problem(path, family, spec):
    """None, or what is wrong with a sample-prompt file (the conditioning arrays of one prompt)."""
    from flame_core import io
    if not os.path.isfile(path):
        return f"no such file: {path}"
    keys = family.sample_keys[1:]
    try:
        with io.safe_open(path) as f:
            have = set(f.keys())
            missing = [k for k in keys if k not in have]
            if missing:
                return f"{path}: missing {missing} (has {sorted(have)})"
            shapes = {k: tuple(f.shape(k)) for k in keys}
    except Exception as ex:  # noqa: BLE001 - reported with the file's name
        return f"{path}: not a readable .safetensors file ({type(ex).__name__}: {ex})"
    err = family.check_sample(shapes, spec)
    return f"{path}: {err}" if err else None


def image_size_problems(cfg, family, spec, dataset=None, validation=None):
    """The image datasets' buckets, and the previews' size, larger than the model takes (family.image_size_limit):
    one message per dataset and resolution, naming the limit. dataset: the checked ImageDataset (None: previews
    only); validation: the held-out images' ImageDataset (validation_loss.py), or None."""
    limit = family.image_size_limit(spec)
    if limit is None:
        return []
    side, why = limit
    over = {}
    for s in dataset.samples if dataset is not None else ():
        if max(s.bucket) > side:
            over.setdefault((s.config, s.resolution), set()).add(s.bucket)
    for s in validation.samples if validation is not None else ():
        if max(s.bucket) > side:
            over.setdefault((-1 - s.config, s.resolution), set()).add(s.bucket)   # (held out: negative)
    e = []
    for (ci, r), buckets in sorted(over.items()):
        names = ", ".join(str(b) for b in sorted(buckets, key=max, reverse=True)[:3])
        what = family.label or family.name
        where = f"datasets[{ci}].resolution {r}" if ci >= 0 else (
            f"validation.split (held-out images of datasets[{-1 - ci}]) at resolution {r}" if cfg.validation.split
            else f"validation.folder_path at resolution {r}")
        e.append(f"{where}: the {names} bucket{'s' if len(buckets) > 1 else ''} exceed"
                 f"{'' if len(buckets) > 1 else 's'} {side} px a side, the most this {what} model takes ({why}); "
                 f"use a resolution whose buckets stay within {side} px (--resolution), or a model with a larger table")
    sm = cfg.sample
    if sm.height is not None and sm.width is not None and max(sm.height, sm.width) > side:
        e.append(f"sample.width x height {sm.width}x{sm.height}: exceeds {side} px a side, the most this "
                 f"{family.label or family.name} model takes ({why})")
    for i, text in enumerate(sm.prompts):
        try:
            o = prompt_options.parse(text)
        except (prompt_options.PromptOptionError, TypeError):
            continue  # (reported by validate)
        if max(o.width or 0, o.height or 0) > side:
            e.append(f"sample.prompts[{i}]: --w {o.width or sm.width} --h {o.height or sm.height}: exceeds {side} px "
                     f"a side, the most this {family.label or family.name} model takes ({why})")
    return e
