"""kohya sd-scripts' training arguments file (`train_network.py --config_file args.toml`, the TOML of its command-line
arguments: flux_train_network.py, sd3_train_network.py, sdxl_train_network.py) read as a FLAME run.

    proc, notes = read_kohya_args("args.toml")     # a process mapping for config_from_dict, and what to tell the user

kohya argument -> FLAME setting:
    pretrained_model_name_or_path -> model.name_or_path    clip_l / clip_g / t5xxl / ae (vae) -> model.*_path
    output_dir -> training_folder, output_name -> name     dataset_config -> datasets (data/kohya_toml.py)
    network_module networks.lora* -> network.type lora; lycoris.kohya with network_args algo=lokr|loha|locon|lora
    network_dim / network_alpha / network_dropout / network_weights -> network.linear / linear_alpha / dropout /
        pretrained_lora_path; network_args conv_dim / conv_alpha / rank_dropout / module_dropout / factor
    learning_rate (unet_lr over it) / text_encoder_lr / lr_scheduler / lr_warmup_steps / lr_scheduler_num_cycles /
        lr_scheduler_power / optimizer_type / optimizer_args ("k=v" strings) -> train.* (Prodigy with an lr below
        0.1 then gets 1.0, with a warning, as every FLAME config: config.py)
    max_train_epochs -> train.epochs, save_every_n_epochs -> save.save_every_epochs (steps from the datasets'
        batches per epoch; with max_train_steps too the epochs win, as in kohya)
    max_train_steps, train_batch_size, gradient_accumulation_steps, gradient_checkpointing, seed, max_grad_norm,
        full_bf16, noise_offset, ip_noise_gamma, min_snr_gamma, scale_weight_norms, loss_type, huber_c,
        huber_schedule, zero_terminal_snr, min_timestep, max_timestep -> train.* (the same meaning)
    mixed_precision bf16 | fp16 | no -> train.dtype; guidance_scale -> train.guidance (Flux's training guidance);
        timestep_sampling uniform | sigmoid | shift | flux_shift -> train.timestep_type, discrete_flow_shift ->
        train.shift, sigmoid_scale -> train.sigmoid_scale; weighting_scheme / logit_mean / logit_std / mode_scale
    network_train_unet_only (or cache_text_encoder_outputs, which kohya refuses with text-encoder training) ->
        the denoiser alone; without either kohya trains the text encoders too -> train.train_text_encoder (SDXL's)
    fp8_base -> model.quantize fp8; t5xxl_max_token_length -> model.t5_max_length; v_parameterization ->
        model.is_v_pred
    enable_bucket -> the dataset config's subsets that do not set it (off: square crops, data/kohya_toml.py)
    save_every_n_steps -> save.save_every, save_precision -> save.dtype; sample_prompts (kohya's prompt file) ->
        sample.prompts, sample_every_n_steps -> sample.sample_every, sample_sampler -> sample.sampler;
        log_with tensorboard -> logging.use_tensorboard
    model_prediction_type raw (FLAME's; kohya recommends it for Flux; its default sigma_scaled is said in a note)

Accepted, each said in a note: what FLAME always does (cache_latents, cache_text_encoder_outputs[_to_disk]; and
cache_latents_to_disk, which becomes each dataset's) and host/speed hints that change no result (sdpa, xformers,
mem_eff_attn, highvram, lowram, persistent_data_loader_workers, max_data_loader_n_workers, save_model_as =
"safetensors"). Every other key -- train_data_dir without a dataset config,
blocks_to_swap (FLAME's max_gpu_memory), ... -- is an error naming the file and the key: a setting FLAME would not
apply is never dropped silently.
"""
import ast
import os

from .config import ConfigError

# kohya argument -> (section or None for the process level, FLAME field)
_SAME = {
    "pretrained_model_name_or_path": ("model", "name_or_path"), "clip_l": ("model", "clip_l_path"),
    "clip_g": ("model", "clip_g_path"), "t5xxl": ("model", "t5_path"), "ae": ("model", "vae_path"),
    "vae": ("model", "vae_path"), "t5xxl_max_token_length": ("model", "t5_max_length"),
    "v_parameterization": ("model", "is_v_pred"),
    "output_dir": (None, "training_folder"), "output_name": (None, "name"),
    "network_dim": ("network", "linear"), "network_alpha": ("network", "linear_alpha"),
    "network_dropout": ("network", "dropout"), "network_weights": ("network", "pretrained_lora_path"),
    "learning_rate": ("train", "lr"), "text_encoder_lr": ("train", "text_encoder_lr"),
    "lr_scheduler": ("train", "lr_scheduler"), "lr_warmup_steps": ("train", "lr_warmup_steps"),
    "optimizer_type": ("train", "optimizer"), "max_train_steps": ("train", "steps"),
    "max_train_epochs": ("train", "epochs"), "save_every_n_epochs": ("save", "save_every_epochs"),
    "train_batch_size": ("train", "batch_size"),
    "gradient_accumulation_steps": ("train", "gradient_accumulation_steps"),
    "gradient_checkpointing": ("train", "gradient_checkpointing"), "seed": ("train", "seed"),
    "max_grad_norm": ("train", "max_grad_norm"), "full_bf16": ("train", "full_bf16"),
    "noise_offset": ("train", "noise_offset"), "ip_noise_gamma": ("train", "ip_noise_gamma"),
    "min_snr_gamma": ("train", "min_snr_gamma"), "scale_weight_norms": ("train", "scale_weight_norms"),
    "loss_type": ("train", "loss_type"), "huber_c": ("train", "huber_c"), "huber_schedule": ("train", "huber_schedule"),
    "zero_terminal_snr": ("train", "zero_terminal_snr"), "min_timestep": ("train", "min_timestep"),
    "max_timestep": ("train", "max_timestep"), "guidance_scale": ("train", "guidance"),
    "discrete_flow_shift": ("train", "shift"), "sigmoid_scale": ("train", "sigmoid_scale"),
    "weighting_scheme": ("train", "weighting_scheme"), "logit_mean": ("train", "logit_mean"),
    "logit_std": ("train", "logit_std"), "mode_scale": ("train", "mode_scale"),
    "save_every_n_steps": ("save", "save_every"), "save_precision": ("save", "dtype"),
    "sample_every_n_steps": ("sample", "sample_every"), "sample_sampler": ("sample", "sampler"),
}
_TIMESTEPS = {"uniform": "uniform", "sigmoid": "sigmoid", "shift": "shift", "flux_shift": "flux_shift"}
_PRECISION = {"bf16": "bf16", "fp16": "fp16", "no": "fp32", "float": "fp32"}
_ALWAYS = {"cache_latents": "FLAME always caches latents",
           "cache_text_encoder_outputs": "FLAME encodes every caption once before training",
           "cache_text_encoder_outputs_to_disk": "FLAME encodes every caption once before training (kept in host "
                                                 "memory, or beside the latents with cache_latents_to_disk)"}
_HINTS = ("sdpa", "xformers", "mem_eff_attn", "highvram", "lowram", "persistent_data_loader_workers",
          "max_data_loader_n_workers")
_NETWORK_ARGS = {"conv_dim": "conv", "conv_alpha": "conv_alpha", "rank_dropout": "rank_dropout",
                 "module_dropout": "module_dropout", "dropout": "dropout", "factor": "lokr_factor"}
_ALGOS = {"lokr": "lokr", "loha": "loha", "locon": "locon", "lora": "lora"}


def _value(text):
    """A kohya "k=v" argument's value: a Python literal when it reads as one (0.01, True, [1, 2]), else the text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError):   # (someone else's text: a deep nesting is text too)
        return text


def _pairs(items, where):
    """{k: v} of kohya's list of "k=v" strings (optimizer_args, network_args)."""
    if not isinstance(items, list) or not all(isinstance(x, str) and "=" in x for x in items):
        raise ConfigError(f"{where}: a list of \"key=value\" strings, got {items!r}")
    return {k.strip(): _value(v.strip()) for k, v in (x.split("=", 1) for x in items)}


def read_kohya_args(path):
    """(process mapping, notes) from kohya's arguments TOML at `path`; ConfigError naming the file and key of each
    setting FLAME would not apply as kohya does (module docstring)."""
    from ..data.kohya_toml import read_toml
    doc = read_toml(path, ConfigError, "an arguments file is a few kilobytes")
    args = {}
    for k, v in doc.items():   # kohya_ss writes its arguments flat or under section tables: one namespace
        if isinstance(v, dict):
            args.update(v)
        else:
            args[k] = v
    proc, notes, errors = {}, [], []

    def put(section, field, value):
        (proc if section is None else proc.setdefault(section, {}))[field] = value

    for key, value in args.items():
        where = f"{path}: {key}"
        if key in _SAME:
            put(*_SAME[key], value)
        elif key == "unet_lr":
            continue   # (below: the denoiser's lr over learning_rate, whichever comes first in the file)
        elif key == "mixed_precision":
            if value not in _PRECISION:
                errors.append(f"{where}: one of {', '.join(_PRECISION)}, got {value!r}")
            else:
                put("train", "dtype", _PRECISION[value])
        elif key == "timestep_sampling":
            if value not in _TIMESTEPS:
                errors.append(f"{where}: FLAME draws {', '.join(_TIMESTEPS)} ({value!r} is kohya's own)")
            else:
                put("train", "timestep_type", _TIMESTEPS[value])
        elif key == "model_prediction_type":
            if value != "raw":
                errors.append(f"{where}: FLAME trains the raw prediction (kohya's 'raw', its advice for Flux), got "
                              f"{value!r}")
        elif key == "optimizer_args":
            try:
                put("train", "optimizer_params", _pairs(value, where))
            except ConfigError as e:
                errors.append(str(e))
        elif key in ("lr_scheduler_num_cycles", "lr_scheduler_power"):
            proc.setdefault("train", {}).setdefault("lr_scheduler_params", {})[
                "num_cycles" if key.endswith("cycles") else "power"] = value
        elif key in ("network_module", "network_args", "network_train_unet_only", "dataset_config",
                     "sample_prompts", "cache_latents_to_disk", "enable_bucket"):
            continue   # (below: they depend on each other)
        elif key == "fp8_base":
            if value:
                put("model", "quantize", "fp8")
        elif key == "log_with":
            if value not in ("tensorboard", "all"):
                errors.append(f"{where}: FLAME logs to tensorboard (logging.use_tensorboard) or wandb; got {value!r}")
            else:
                put("logging", "use_tensorboard", True)
        elif key == "save_model_as":
            if value != "safetensors":
                errors.append(f"{where}: FLAME writes safetensors, got {value!r}")
        elif key in _ALWAYS:
            if value:
                notes.append(f"{where}: {_ALWAYS[key]}")
        elif key in _HINTS:
            notes.append(f"{where}: not used (a host-side setting of kohya's; FLAME's attention and data loading "
                         f"are its own)")
        else:
            errors.append(f"{where}: not supported by FLAME's kohya reader (flame_models/training/kohya_args.py "
                          f"lists what it reads)")
    if "unet_lr" in args:
        put("train", "lr", args["unet_lr"])
    _network(args, path, proc, errors)
    if not args.get("network_train_unet_only") and not args.get("cache_text_encoder_outputs"):
        put("train", "train_text_encoder", True)
        notes.append(f"{path}: without network_train_unet_only kohya trains the text encoders' LoRA too: so does "
                     f"FLAME (SDXL's; another family says it cannot)")
    if "model_prediction_type" not in args and ("t5xxl" in args or "ae" in args):
        notes.append(f"{path}: FLAME trains Flux's raw prediction (kohya's model_prediction_type raw, its advice); "
                     f"kohya's default would be sigma_scaled")
    if "max_train_epochs" in args and "max_train_steps" in args:   # (kohya: the epochs win)
        proc["train"].pop("steps")
        notes.append(f"{path}: max_train_epochs given with max_train_steps: the epochs set the length, as in kohya")
    if "save_every_n_epochs" in args and "save_every_n_steps" in args:
        errors.append(f"{path}: save_every_n_epochs and save_every_n_steps: FLAME saves on one schedule; give one")
    if not isinstance(args.get("enable_bucket", False), bool):
        errors.append(f"{path}: enable_bucket: true or false, got {args['enable_bucket']!r}")
    if "dataset_config" not in args:
        errors.append(f"{path}: no dataset_config: FLAME reads kohya's datasets from its dataset TOML (a "
                      f"train_data_dir of repeat-named folders is not read)")
    if errors:
        raise ConfigError(f"{len(errors)} problem(s) in kohya's arguments:\n  " + "\n  ".join(errors))
    if "dataset_config" in args:
        from ..data.kohya_toml import KohyaConfigError, read_dataset_config
        dc = _near(args["dataset_config"], path)
        try:
            datasets, batch_size, more = read_dataset_config(dc, enable_bucket=args.get("enable_bucket", False))
        except KohyaConfigError as e:
            raise ConfigError(f"{path}: dataset_config {e}") from None
        if args.get("cache_latents_to_disk"):
            for d in datasets:
                d["cache_latents_to_disk"] = True
        proc["datasets"] = datasets
        notes += more
        if batch_size is not None and "train_batch_size" not in args:
            put("train", "batch_size", batch_size)
    if "sample_prompts" in args:
        from .prompt_files import read_prompt_file
        put("sample", "prompts", read_prompt_file(_near(args["sample_prompts"], path)))
    return proc, notes


def _near(name, path):
    """A file the arguments name: as given (kohya reads it from the working folder), else beside the arguments
    file."""
    if isinstance(name, str) and not os.path.isabs(name) and not os.path.isfile(name):
        near = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        if os.path.isfile(near):
            return near
    return name


def _network(args, path, proc, errors):
    module = args.get("network_module", "networks.lora")
    extra = {}
    if "network_args" in args:
        try:
            extra = _pairs(args["network_args"], f"{path}: network_args")
        except ConfigError as e:
            errors.append(str(e))
    net = proc.setdefault("network", {})
    if isinstance(module, str) and module.startswith("networks.lora"):   # lora, lora_flux, lora_sd3
        net["type"] = "lora"
    elif module == "lycoris.kohya":
        algo = extra.pop("algo", "lora")
        if algo not in _ALGOS:
            errors.append(f"{path}: network_args algo={algo}: FLAME trains {', '.join(_ALGOS)}")
        else:
            net["type"] = _ALGOS[algo]
    else:
        errors.append(f"{path}: network_module {module!r}: FLAME reads networks.lora* and lycoris.kohya")
    for k, v in extra.items():
        if k in _NETWORK_ARGS:
            net[_NETWORK_ARGS[k]] = v
        else:
            errors.append(f"{path}: network_args {k}={v!r}: not supported (FLAME reads "
                          f"{', '.join(_NETWORK_ARGS)} and algo)")
