"""SimpleTuner's `config.json` or `config.toml` (its training options; keys with or without the leading "--") and the
`multidatabackend.json` it names (data_backend_config; data/simpletuner_backends.py) read as a FLAME run.

    proc, notes = read_simpletuner_config("config/config.json")   # a process mapping for config_from_dict

Values are read as SimpleTuner reads them: its defaults where a key is absent (learning_rate 4e-7, train_batch_size
4, lora_alpha = lora_rank, lora_dropout 0.1, max_grad_norm 2.0 clipped by value, caption_dropout_probability 0.1,
flow_schedule_shift 3, lr_scheduler constant_with_warmup, resolution 1024 pixel_area, ...), numbers and booleans
also as strings ("1e-4", "true"; "false" is false here, where SimpleTuner's JSON loader would drop the key).

SimpleTuner option -> FLAME setting:
    model_family flux | sd3 | sdxl | chroma | qwen_image -> model.arch (flux with model_flavour kontext:
        flux_kontext); pretrained_model_name_or_path -> model.name_or_path, else model_flavour's Hub id
        (SimpleTuner's table; FLAME reads it from the local Hugging Face cache); pretrained_vae_model_name_or_path
        -> model.vae_path; flux schnell's assistant LoRA (SimpleTuner loads ostris/FLUX.1-schnell-training-adapter
        unless disable_assistant_lora) -> model.assistant_lora_path
    output_dir -> training_folder / name (its parent and last folder)
    model_type lora | full; lora_type standard | lycoris (lycoris_config: algo lora / locon / loha / lokr,
        linear_dim, linear_alpha, factor, full_matrix, conv_dim, conv_alpha, dropout, rank_dropout, module_dropout;
        apply_preset when it is the default Attention target) -> network.*; validation_lycoris_strength ->
        sample.network_multiplier; lora_rank, lora_alpha, lora_dropout -> network.linear / linear_alpha / dropout;
        the target: SimpleTuner's module list for the family (flux_lora_target all | all+ffs | context |
        context+ffs | tiny | nano for Flux and Chroma; to_q / to_k / to_v / to_out.0 for the others; LyCORIS's
        Attention modules) -> network.target; init_lora -> network.pretrained_lora_path
    learning_rate, lr_warmup_steps, lr_scheduler constant | constant_with_warmup | linear | polynomial (lr_end,
        lr_power) -> train.*; optimizer adamw_bf16 (its betas, weight decay and eps) | torch-adamw | optimi-adamw |
        bnb-adamw8bit | optimi-lion | bnb-lion | adamw_schedulefree | torch-radam | torch-nadam, optimizer_config
        ("k=v,k=v"), optimizer_beta1 / optimizer_beta2 -> train.optimizer / optimizer_params
    max_grad_norm with grad_clip_method value (SimpleTuner's default) -> train.max_grad_value, norm ->
        train.max_grad_norm
    max_train_steps / num_train_epochs, train_batch_size, gradient_accumulation_steps, gradient_checkpointing, seed,
        mixed_precision -> train.*; base_model_precision fp8-* -> model.quantize fp8; text_encoder_N_precision fp8-*
        for the family's T5 (Qwen-Image's Qwen2.5-VL) -> model.quantize_te; base_model_default_dtype -> model.dtype
    checkpoint_step_interval (checkpointing_steps), checkpoints_total_limit -> save.save_every /
        max_step_saves_to_keep
    validation_prompt, user_prompt_library (its prompts), validation_step_interval (validation_steps),
        validation_num_inference_steps, validation_guidance, validation_negative_prompt (families with CFG),
        validation_resolution WxH, validation_seed, validation_guidance_skip_layers (SD3), validation_guidance_rescale
        (SDXL) -> sample.*; validation_guidance_real > 1 (Flux) -> sample.true_cfg against
        validation_negative_prompt, from validation_no_cfg_until_timestep (sample.true_cfg_start)
    flow_schedule_shift, flow_sigmoid_scale (SimpleTuner's default σ: sigmoid(scale · N(0, 1)) then shifted) ->
        train.timestep_type shift, shift, sigmoid_scale; flow_schedule_auto_shift -> flux_shift;
        flux_guidance_value -> train.guidance, flux_guidance_mode random-range with flux_guidance_min / max ->
        train.guidance_range; loss_type, huber_c; snr_gamma (SDXL) -> train.min_snr_gamma;
        prediction_type (SDXL) -> train.prediction_type; use_ema, ema_decay -> train.ema_config
    report_to tensorboard | wandb, tracker_project_name, tracker_run_name -> logging.*
    an eval backend with eval_steps_interval, eval_timesteps (28), num_eval_images -> validation (folder_path,
        every, timesteps, max_batches; seed 0)
Notes, changing nothing FLAME trains: resume_from_checkpoint latest (FLAME resumes from the newest checkpoint),
host and speed settings (vae_batch_size, quantize_via, disable_benchmark, disable_bucket_pruning,
fuse_qkv_projections, aspect_bucket_rounding, compress_disk_cache, validation_torch_compile, ...), the hub settings
without push_to_hub, validation_disable_unconditional (FLAME renders no unconditional image).
Every other key or value -- push_to_hub, controlnet, TREAD, int8 / int4 quantisation, SimpleTuner's own cosine /
sine schedules, optimizers FLAME does not have, other guidance modes, ... -- is an error naming the file and the key:
a setting FLAME would not apply is never dropped silently.
"""
import math
import os

from ..data.simpletuner_backends import SimpleTunerConfigError, read_backends, read_json
from .config import ConfigError

FAMILIES = ("flux", "sd3", "sdxl", "chroma", "qwen_image")
# SimpleTuner's model_flavour -> Hub id tables (models/<family>/model.py), and each family's default flavour
FLAVOURS = {
    "flux": {"krea": "black-forest-labs/flux.1-krea-dev", "dev": "black-forest-labs/flux.1-dev",
             "schnell": "black-forest-labs/flux.1-schnell", "kontext": "black-forest-labs/flux.1-kontext-dev"},
    "sd3": {"medium": "stabilityai/stable-diffusion-3.5-medium", "large": "stabilityai/stable-diffusion-3.5-large"},
    "sdxl": {"base-1.0": "stabilityai/stable-diffusion-xl-base-1.0",
             "base-0.9": "stabilityai/stable-diffusion-xl-base-0.9"},
    "chroma": {"base": "lodestones/Chroma1-Base", "hd": "lodestones/Chroma1-HD", "flash": "lodestones/Chroma1-Flash"},
    "qwen_image": {"v1.0": "Qwen/Qwen-Image", "v2.0": "Qwen/Qwen-Image-2512"},
}
# which text_encoder_N is the family's large encoder (T5; Qwen-Image's Qwen2.5-VL), the one FLAME can hold in fp8
T5_INDEX = {"flux": 2, "flux_kontext": 2, "sd3": 3, "chroma": 1, "qwen_image": 1}
DEFAULT_FLAVOUR = {"flux": "krea", "sd3": "medium", "sdxl": "base-1.0", "chroma": "base", "qwen_image": "v2.0"}
SCHNELL_ASSISTANT = "ostris/FLUX.1-schnell-training-adapter"
# SimpleTuner's LoRA targets: PEFT module-name suffixes (its fused to_qkv / add_qkv_proj exist only with
# fuse_qkv_projections, which FLAME's fused Linears need not: left out)
_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
_CONTEXT = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_FFS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
FLUX_TARGETS = {"all": _ATTENTION + _CONTEXT, "context": _CONTEXT,
                "context+ffs": _CONTEXT + ["ff_context.net.0.proj", "ff_context.net.2"],
                "all+ffs": _ATTENTION + _CONTEXT + _FFS,
                "tiny": ["single_transformer_blocks.7.proj_out", "single_transformer_blocks.20.proj_out"],
                "nano": ["single_transformer_blocks.7.proj_out"]}
# LyCORIS's "Attention" modules: every Linear of diffusers' Attention (SimpleTuner's DEFAULT_LYCORIS_TARGET)
LYCORIS_ATTENTION = {"flux": _ATTENTION + _CONTEXT, "chroma": _ATTENTION + _CONTEXT, "sd3": _ATTENTION + _CONTEXT,
                     "sdxl": _ATTENTION, "qwen_image": _ATTENTION + _CONTEXT}
# SimpleTuner optimizer -> (FLAME optimizer, its defaults there)
OPTIMIZERS = {"adamw_bf16": ("adamw", {"betas": (0.9, 0.999), "weight_decay": 1e-2, "eps": 1e-6}),
              "torch-adamw": ("adamw", {}), "optimi-adamw": ("adamw", {}), "bnb-adamw8bit": ("adamw8bit", {}),
              "optimi-lion": ("lion", {}), "bnb-lion": ("lion", {}), "adamw_schedulefree": ("adamw_schedulefree", {}),
              "torch-radam": ("radam", {}), "torch-nadam": ("nadam", {})}
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "polynomial")
PRECISION = {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}
# what SimpleTuner does where a key is absent, for the keys read below
DEFAULTS = {"learning_rate": 4e-7, "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 0, "lr_end": 4e-7,
            "lr_power": 0.8, "optimizer_beta1": None, "optimizer_beta2": None, "max_grad_norm": 2.0,
            "grad_clip_method": "value", "train_batch_size": 4, "gradient_checkpointing": True, "lora_rank": 16,
            "lora_alpha": None, "lora_dropout": 0.1, "lora_type": "standard", "flux_lora_target": "all",
            "caption_dropout_probability": 0.1, "resolution": 1024, "resolution_type": "pixel_area",
            "caption_strategy": "filename", "flow_schedule_shift": 3.0, "flow_sigmoid_scale": 1.0,
            "checkpoint_step_interval": 500, "checkpoints_total_limit": 5, "validation_step_interval": 100,
            "validation_num_inference_steps": 30, "validation_guidance": 7.5,
            "validation_negative_prompt": "blurry, cropped, ugly", "validation_resolution": "256",
            "mixed_precision": "bf16", "num_train_epochs": 1, "use_ema": False, "ema_decay": 0.995,
            "validation_guidance_skip_scale": 2.8, "eval_timesteps": 28, "output_dir": "simpletuner-results",
            "tracker_project_name": "simpletuner", "tracker_run_name": "simpletuner-testing", "num_eval_images": 4,
            "validation_seed": None, "validation_guidance_rescale": 0.0, "validation_guidance_real": 1.0,
            "validation_no_cfg_until_timestep": 2, "flux_guidance_min": 0.0, "flux_guidance_max": 4.0,
            "validation_guidance_skip_layers": None, "lora_init_type": "default", "peft_lora_target_modules": None,
            "init_lora": None, "lycoris_config": "config/lycoris_config.json", "assistant_lora_path": None,
            "disable_assistant_lora": False, "huber_c": 0.1, "huber_schedule": "snr", "noise_offset": 0.1,
            "noise_offset_probability": 0.25, "optimizer_config": None}
LIST_OPTIONS = ("validation_guidance_skip_layers", "instance_prompt")   # (the others take one value)
ALIASES = {"checkpointing_steps": "checkpoint_step_interval", "validation_steps": "validation_step_interval",
           "fused_qkv_projections": "fuse_qkv_projections", "save_total_limit": "checkpoints_total_limit"}
# the backends' fall-backs (data/simpletuner_backends.py)
BACKEND_DEFAULTS = ("resolution", "resolution_type", "minimum_image_size", "maximum_image_size",
                    "target_downsample_size", "caption_strategy", "instance_prompt", "prepend_instance_prompt",
                    "only_instance_prompt", "caption_dropout_probability")
_HINTS = ("vae_batch_size", "quantize_via", "disable_benchmark", "disable_bucket_pruning", "fuse_qkv_projections",
          "aspect_bucket_rounding", "compress_disk_cache", "validation_torch_compile", "skip_file_discovery",
          "dataloader_prefetch", "aspect_bucket_worker_count", "write_batch_size", "read_batch_size",
          "max_workers", "enable_xformers_memory_efficient_attention", "attention_mechanism", "vae_dtype",
          "text_encoder_precision", "webhook_config", "tracker_image_layout", "validation_prompt_library")
_HUB = ("hub_model_id", "push_checkpoints_to_hub", "model_card_safe_for_work", "model_card_note")
_INERT = {"vae_cache_ondemand": "FLAME encodes every image once before training (the same latents: its crops are "
                                "drawn once per image and repeat)",
          "gradient_checkpointing_interval": "FLAME checkpoints every block (memory and speed only: the same "
                                             "training)",
          "conditioning_multidataset_sampling": "FLAME pairs each edit with one conditioning dataset: nothing to "
                                                "sample between",
          "validation_disable_unconditional": "FLAME renders no unconditional image beside the previews"}


def _key(k):
    k = k[2:] if k.startswith("--") else k
    return ALIASES.get(k, k)


def _bool(v):
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "y", "on", "0", "false", "no", "n", "off"):
        return v.strip().lower() in ("1", "true", "yes", "y", "on")
    return v if isinstance(v, bool) else None


def _num(v, integer=False):
    """A JSON number or a number written as a string ("1e-4"); None when it is neither (or, integer=True, not a
    whole number)."""
    if isinstance(v, str):
        try:
            v = float(v) if any(c in v for c in ".eE") or not integer else int(v)
        except ValueError:
            return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    if integer:
        return int(v) if float(v).is_integer() else None
    return v


def read_simpletuner_config(path):
    """(process mapping, notes) from SimpleTuner's config.json at `path`; ConfigError naming the file and key of each
    setting FLAME would not apply as SimpleTuner does (module docstring)."""
    if str(path).lower().endswith(".toml"):   # (SimpleTuner's config.toml: the same options)
        from ..data.kohya_toml import read_toml
        doc = read_toml(path, ConfigError, "a SimpleTuner config is a few kilobytes")
    else:
        doc = read_json(path, ConfigError, "a SimpleTuner config.json")
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected an object of SimpleTuner options (config.json)")
    args = {}
    for k, v in doc.items():
        if not isinstance(k, str):
            raise ConfigError(f"{path}: option names are strings, got {k!r}")
        if v is None or v == "":      # (SimpleTuner drops them: its default applies)
            continue
        args[_key(k)] = v
    r = _Reader(path, args)
    r.read()
    if r.errors:
        raise ConfigError(f"{len(r.errors)} problem(s) in SimpleTuner's config:\n  " + "\n  ".join(r.errors))
    return r.proc, r.notes


class _Reader:
    def __init__(self, path, args):
        self.path, self.args = path, args
        self.proc, self.notes, self.errors, self.used = {}, [], [], set()

    # ------------------------------------------------------------------ helpers
    def get(self, key):
        """The option's value, else SimpleTuner's default; a list or an object where one value belongs (someone
        else's file) is an error, and the default stands in for it."""
        self.used.add(key)
        v = self.args.get(key, DEFAULTS.get(key))
        if isinstance(v, (list, dict)) and key not in LIST_OPTIONS:
            self.err(key, f"one value, got {type(v).__name__} {v!r}"[:200])
            return DEFAULTS.get(key)
        return v

    def given(self, key):
        self.used.add(key)
        return key in self.args

    def err(self, key, text):
        self.errors.append(f"{self.path}: {key}: {text}")

    def note(self, key, text):
        self.notes.append(f"{self.path}: {key}: {text}")

    def put(self, section, field, value):
        (self.proc if section is None else self.proc.setdefault(section, {}))[field] = value

    def number(self, key, integer=False, low=None):
        v = self.get(key)
        n = _num(v, integer)
        if n is None or (low is not None and n < low):
            self.err(key, f"{'an integer' if integer else 'a number'}" + (f" >= {low}" if low is not None else "")
                     + f", got {v!r}")
        return n

    def near(self, name):
        """A file the config names: as given (SimpleTuner reads it from its working folder), else beside the config
        file under that relative name, else beside it under its file name; as given when none exists (the reader's
        own error then names it)."""
        if not isinstance(name, str):   # (someone else's file: a number or a list names no file)
            return str(name)
        here = os.path.dirname(os.path.abspath(self.path))
        for cand in (name, os.path.join(here, name), os.path.join(here, os.path.basename(name))):
            if os.path.isfile(cand):
                return cand
        return name

    def flag(self, key):
        v = self.get(key)
        b = _bool(v)
        if b is None and v is not None:
            self.err(key, f"true or false, got {v!r}")
        return bool(b)

    # ------------------------------------------------------------------ the options
    def read(self):
        family = self._model()
        if family is None:
            return
        self._output()
        self._network(family)
        self._optimizer()
        self._length()
        self._timesteps(family)
        self._saves_and_previews(family)
        self._logging()
        self._rest()
        self._datasets(family)
        self._unread()

    def _model(self):
        fam = self.get("model_family")
        if fam is None:
            self.err("model_family", "required (SimpleTuner requires it too)")
            return None
        fam = str(fam).lower()
        if fam not in FAMILIES:
            self.err("model_family", f"{fam!r}: FLAME trains {', '.join(FAMILIES)}")
            return None
        flavour = self.get("model_flavour")
        name = self.get("pretrained_model_name_or_path")
        if flavour is not None and flavour not in FLAVOURS[fam]:
            if name is None or fam != "flux" or flavour not in ("fluxbooru", "libreflux"):
                self.err("model_flavour", f"{flavour!r}: FLAME reads {fam}'s {', '.join(FLAVOURS[fam])}"
                         + ("" if name is None else " (or none beside pretrained_model_name_or_path)"))
                return None
        if name is None:
            flavour = flavour or DEFAULT_FLAVOUR[fam]
            name = FLAVOURS[fam][flavour]
            self.note("model_flavour", f"{flavour}: the model is {name}, as SimpleTuner picks it (read from the local "
                                       f"Hugging Face cache)")
        self.put("model", "name_or_path", name)
        arch = "flux_kontext" if fam == "flux" and flavour == "kontext" else fam
        self.put("model", "arch", arch)
        if self.given("pretrained_vae_model_name_or_path"):
            self.put("model", "vae_path", self.get("pretrained_vae_model_name_or_path"))
        self.family, self.flavour = arch, flavour
        return arch

    def _output(self):
        out = self.get("output_dir")
        folder = os.path.normpath(str(out))
        parent, name = os.path.split(folder)
        self.put(None, "training_folder", parent or ".")
        self.put(None, "name", name)
        self.note("output_dir", f"the run's folder is {folder} (FLAME's training_folder / name); the LoRA file is "
                                f"{name}.safetensors there, not pytorch_lora_weights.safetensors")

    def _network(self, family):
        mtype = str(self.get("model_type") or "").lower()
        if mtype == "full":
            self.put("network", "type", "full")
            return
        if mtype != "lora":
            self.err("model_type", f"lora or full, got {self.get('model_type')!r} (SimpleTuner requires it)")
            return
        kind = str(self.get("lora_type")).lower()
        net = self.proc.setdefault("network", {})
        if kind == "standard":
            net["type"] = "lora"
            rank = self.number("lora_rank", integer=True, low=1)
            alpha = self.number("lora_alpha", low=0) if self.given("lora_alpha") else rank
            net["linear"], net["linear_alpha"] = rank, alpha
            net["dropout"] = self.number("lora_dropout", low=0)
            init = self.get("lora_init_type")
            if init not in (None, "default"):
                self.err("lora_init_type", f"{init!r}: FLAME starts LoRA as PEFT's default (B = 0)")
            net["target"] = self._lora_target(family)
        elif kind == "lycoris":
            self._lycoris(family, net)
        else:
            self.err("lora_type", f"standard or lycoris, got {kind!r}")
        if self.given("init_lora"):
            net["pretrained_lora_path"] = self.get("init_lora")
        if family == "flux" and self.flavour == "schnell" and not self.flag("disable_assistant_lora"):
            path = self.get("assistant_lora_path") or SCHNELL_ASSISTANT
            self.put("model", "assistant_lora_path", path)
            self.note("model_flavour", f"schnell: the assistant LoRA {path} is merged in for training and taken back "
                                       f"out of the previews, as SimpleTuner loads it")
        elif self.given("assistant_lora_path"):
            self.err("assistant_lora_path", "SimpleTuner uses it for Flux schnell only")

    def _lora_target(self, family):
        if self.given("peft_lora_target_modules"):
            self.err("peft_lora_target_modules", "give the targets as FLAME's network.target instead")
        if family in ("flux", "flux_kontext", "chroma"):
            t = self.get("flux_lora_target")
            if t not in FLUX_TARGETS:
                self.err("flux_lora_target", f"{t!r}: FLAME reads {', '.join(FLUX_TARGETS)}")
                return None
            return list(FLUX_TARGETS[t])
        if self.given("flux_lora_target"):
            self.err("flux_lora_target", f"Flux's and Chroma's; {family} trains to_q / to_k / to_v / to_out.0")
        return list(_ATTENTION)

    def _lycoris(self, family, net):
        cfg_path = self.get("lycoris_config")
        where = "lycoris_config"
        try:
            ly = read_json(self.near(cfg_path), SimpleTunerConfigError, "a LyCORIS config")
        except SimpleTunerConfigError as e:
            self.err(where, str(e))
            return
        if not isinstance(ly, dict):
            self.err(where, f"{cfg_path}: expected an object")
            return
        algos = {"lora": "lora", "locon": "locon", "loha": "loha", "lokr": "lokr"}
        algo = ly.get("algo")
        if algo not in algos:
            self.err(where, f"{cfg_path}: algo {algo!r}: FLAME trains {', '.join(algos)}")
            return
        net["type"] = algos[algo]
        if ly.get("multiplier", 1.0) != 1.0:
            self.err(where, f"{cfg_path}: multiplier {ly['multiplier']!r}: FLAME's adapters train at weight 1")
        net["linear"] = ly.get("linear_dim", 4)
        net["linear_alpha"] = ly.get("linear_alpha", 1)
        for k, field in (("factor", "lokr_factor"), ("full_matrix", "lokr_full_rank"), ("conv_dim", "conv"),
                         ("conv_alpha", "conv_alpha"), ("dropout", "dropout"), ("rank_dropout", "rank_dropout"),
                         ("module_dropout", "module_dropout")):
            if k in ly:
                net[field] = ly[k]
        preset = ly.get("apply_preset")
        if preset is not None:
            # the default target written out ({"target_module": ["Attention"], "module_algo_map": {"Attention":
            # {...}}}, SimpleTuner's SDXL example): its settings for Attention are the adapters' own
            algo_map = preset.get("module_algo_map", {}) if isinstance(preset, dict) else None
            extra = algo_map.get("Attention", {}) if isinstance(algo_map, dict) and set(algo_map) <= {"Attention"} \
                else None
            if not isinstance(preset, dict) or preset.get("target_module") != ["Attention"] \
                    or set(preset) - {"target_module", "module_algo_map"} or not isinstance(extra, dict) \
                    or set(extra) - {"factor", "linear_dim", "linear_alpha"}:
                self.err(where, f"{cfg_path}: apply_preset: FLAME reads target_module [\"Attention\"] (SimpleTuner's "
                                f"default) with module_algo_map settings factor / linear_dim / linear_alpha for it")
            else:
                for k, field in (("factor", "lokr_factor"), ("linear_dim", "linear"), ("linear_alpha", "linear_alpha")):
                    if k in extra:
                        net[field] = extra[k]
        if ly.get("bypass_mode"):
            self.note(where, "bypass_mode: LyCORIS's way of computing the adapter beside the weight, as FLAME does")
        known = {"algo", "multiplier", "linear_dim", "linear_alpha", "factor", "full_matrix", "conv_dim", "conv_alpha",
                 "dropout", "rank_dropout", "module_dropout", "apply_preset", "bypass_mode"}
        for k in ly:
            if k not in known:
                self.err(where, f"{cfg_path}: {k}: not supported (FLAME reads {', '.join(sorted(known))})")
        net["target"] = list(LYCORIS_ATTENTION[family if family != "flux_kontext" else "flux"])

    def _optimizer(self):
        t = self.proc.setdefault("train", {})
        t["lr"] = self.number("learning_rate", low=0)
        name = self.get("optimizer")
        if name is None:
            self.err("optimizer", "required (SimpleTuner requires it too)")
        elif name not in OPTIMIZERS:
            self.err("optimizer", f"{name!r}: FLAME has {', '.join(OPTIMIZERS)} of SimpleTuner's "
                                  f"(prodigy there is the schedule-free ProdigyPlus, which FLAME does not have)")
        else:
            flame_name, params = OPTIMIZERS[name]
            t["optimizer"], params = flame_name, dict(params)
            extra = self.get("optimizer_config")
            if extra is not None:
                params.update(self._optimizer_config(extra))
            b1, b2 = self.get("optimizer_beta1"), self.get("optimizer_beta2")
            if b1 is not None or b2 is not None:
                old = params.get("betas", (0.9, 0.999))
                params["betas"] = (_num(b1) if b1 is not None else old[0], _num(b2) if b2 is not None else old[1])
            if params:
                t["optimizer_params"] = params
        sched = self.get("lr_scheduler")
        if sched == "cosine_with_warmup":
            sched = "cosine"
        if sched not in SCHEDULERS:
            self.err("lr_scheduler", f"{sched!r}: FLAME follows SimpleTuner's {', '.join(SCHEDULERS)} (its cosine, "
                                     f"sine and cosine_with_restarts are schedules of its own)")
        else:
            t["lr_scheduler"] = sched
            if sched == "polynomial":
                t["lr_scheduler_params"] = {"lr_end": self.number("lr_end", low=0),
                                            "power": self.number("lr_power", low=0)}
        t["lr_warmup_steps"] = self.number("lr_warmup_steps", integer=True, low=0)
        norm, method = self.number("max_grad_norm", low=0), self.get("grad_clip_method")
        if method == "value":
            if norm:
                t["max_grad_value"] = norm
            t["max_grad_norm"] = 0.0
        elif method == "norm":
            t["max_grad_norm"] = norm
        else:
            self.err("grad_clip_method", f"value or norm, got {method!r}")

    def _optimizer_config(self, text):
        out = {}
        for item in str(text).split(","):
            if not item.strip():
                continue
            if "=" not in item:
                self.err("optimizer_config", f"\"k=v,k=v\", got {text!r}")
                return {}
            k, v = (x.strip() for x in item.split("=", 1))
            low = v.lower()
            out[k] = {"true": True, "false": False, "none": None}.get(low, _num(v) if _num(v) is not None else v)
        return out

    def _length(self):
        t = self.proc.setdefault("train", {})
        steps = self.number("max_train_steps", integer=True, low=0) if self.given("max_train_steps") else None
        epochs = self.number("num_train_epochs", integer=True, low=0)
        if steps and epochs:
            self.err("num_train_epochs", f"{epochs} with max_train_steps {steps}: SimpleTuner refuses both; set "
                                         f"num_train_epochs to 0")
        elif steps:
            t["steps"] = steps
        elif epochs:
            t["epochs"] = epochs
        else:
            self.err("max_train_steps", "neither it nor num_train_epochs is above 0")
        t["batch_size"] = self.number("train_batch_size", integer=True, low=1)
        if self.given("gradient_accumulation_steps"):
            t["gradient_accumulation_steps"] = self.number("gradient_accumulation_steps", integer=True, low=1)
        t["gradient_checkpointing"] = self.flag("gradient_checkpointing")
        seed = self.get("seed")
        if seed is not None:
            s = _num(seed, integer=True)
            if s is None or s <= 0:
                self.err("seed", f"a positive integer (SimpleTuner's 0 / -1 draw one at random), got {seed!r}")
            else:
                t["seed"] = s
        else:
            self.note("seed", "not set: SimpleTuner draws one; FLAME uses its default 42")
        mp = self.get("mixed_precision")
        if mp not in PRECISION:
            self.err("mixed_precision", f"one of {', '.join(PRECISION)}, got {mp!r}")
        else:
            t["dtype"] = PRECISION[mp]
        prec = self.get("base_model_precision")
        if prec not in (None, "no_change"):
            if str(prec).startswith("fp8"):
                self.put("model", "quantize", "fp8")
                self.note("base_model_precision", f"{prec}: FLAME stores the blocks' weights in fp8 (e4m3, a scale "
                                                  f"per row)")
            else:
                self.err("base_model_precision", f"{prec!r}: FLAME stores weights in fp8 or as they are: give "
                                                 f"fp8-torchao (or any fp8-*: about int8's memory) or no_change")
        self._text_encoder_precision()
        dt = self.get("base_model_default_dtype")
        if dt is not None:
            if dt not in ("bf16", "fp32"):
                self.err("base_model_default_dtype", f"bf16 or fp32, got {dt!r}")
            else:
                self.put("model", "dtype", dt)
        if self.flag("use_ema"):
            t["ema_config"] = {"use_ema": True, "ema_decay": self.number("ema_decay", low=0)}

    def _text_encoder_precision(self):
        """text_encoder_N_precision: fp8 for the family's T5 (Qwen-Image: Qwen2.5-VL) -> model.quantize_te; a CLIP
        stays as it is (no_change)."""
        big = T5_INDEX.get(self.family)
        for i in range(1, 5):
            key = f"text_encoder_{i}_precision"
            v = self.get(key)
            if v in (None, "no_change"):
                continue
            if i == big and str(v).startswith("fp8"):
                self.put("model", "quantize_te", True)
                self.note(key, f"{v}: FLAME stores the text encoder's Linear weights in fp8 (model.quantize_te)")
            else:
                self.err(key, f"{v!r}: FLAME stores " + ("this text encoder as it is (no_change)" if i != big else
                                                         "it in fp8 (any fp8-*) or as it is (no_change)"))

    def _timesteps(self, family):
        t = self.proc.setdefault("train", {})
        flow = family != "sdxl"
        for k in ("flow_use_uniform_schedule", "flow_use_beta_schedule", "flux_fast_schedule"):
            if self.given(k) and self.flag(k):
                self.err(k, "FLAME draws SimpleTuner's default σ (sigmoid of a normal, shifted) or Flux's "
                            "resolution-dependent shift")
        if flow:
            auto = self.flag("flow_schedule_auto_shift") if self.given("flow_schedule_auto_shift") else False
            shift = self.number("flow_schedule_shift", low=0)
            if auto and (shift is None or shift <= 0 or not self.given("flow_schedule_shift")):
                t["timestep_type"] = "flux_shift"
            else:
                t["timestep_type"] = "shift"
                t["shift"] = shift
            t["sigmoid_scale"] = self.number("flow_sigmoid_scale", low=0)
        else:
            for k in ("flow_schedule_shift", "flow_schedule_auto_shift", "flow_sigmoid_scale"):
                if self.given(k):
                    self.note(k, "SDXL trains with DDPM timesteps: not used (SimpleTuner's too)")
        mode = self.get("flux_guidance_mode")
        if mode not in (None, "constant", "random-range"):
            self.err("flux_guidance_mode", f"{mode!r}: FLAME trains Flux at one guidance value (constant) or at one "
                                           f"drawn per sample (random-range)")
        elif mode == "random-range" and family in ("flux", "flux_kontext"):
            lo, hi = self.number("flux_guidance_min", low=0), self.number("flux_guidance_max", low=0)
            if lo is not None and hi is not None and lo > hi:
                self.err("flux_guidance_max", f"{hi} is below flux_guidance_min {lo}")
            t["guidance_range"] = [lo, hi]
            if self.given("flux_guidance_value"):
                self.note("flux_guidance_value", "random-range draws each sample's guidance: not used")
        elif mode == "random-range":
            self.note("flux_guidance_mode", f"{family} has no guidance embedding: not used")
        if self.given("flux_guidance_value") and mode != "random-range":
            if family in ("flux", "flux_kontext"):
                t["guidance"] = self.number("flux_guidance_value", low=0)
            else:
                self.note("flux_guidance_value", f"{family} has no guidance embedding: not used")
        loss = self.get("loss_type")
        if loss not in (None, "l2"):
            if loss not in ("huber", "smooth_l1"):
                self.err("loss_type", f"l2, huber or smooth_l1, got {loss!r}")
            else:
                t["loss_type"] = loss
                t["huber_c"] = self.number("huber_c", low=0)
                sched = self.get("huber_schedule")
                if sched == "snr" and flow:
                    self.err("huber_schedule", "snr (SimpleTuner's default) is SDXL's in FLAME; give constant or "
                                               "exponential")
                else:
                    t["huber_schedule"] = sched
        if self.given("snr_gamma"):
            if flow:
                self.note("snr_gamma", "not used for flow-matching models (SimpleTuner ignores it there too)")
            else:
                t["min_snr_gamma"] = self.number("snr_gamma", low=0)
        if self.given("prediction_type"):
            pt = self.get("prediction_type")
            if flow or pt not in ("epsilon", "v_prediction"):
                self.err("prediction_type", f"{pt!r}: SDXL's epsilon or v_prediction (a flow model predicts the "
                                            f"flow)")
            else:
                t["prediction_type"] = pt
        if self.flag("offset_noise"):
            p = self.number("noise_offset_probability", low=0)
            if flow:
                self.note("offset_noise", "SimpleTuner offsets the noise of non-flow models only: not used")
            elif p != 1:
                self.err("offset_noise", f"SimpleTuner offsets the noise in a share {p} of the steps; FLAME's "
                                         f"train.noise_offset offsets every step (noise_offset_probability 1.0)")
            else:
                t["noise_offset"] = self.number("noise_offset", low=0)

    def _saves_and_previews(self, family):
        s = self.proc.setdefault("save", {})
        s["save_every"] = self.number("checkpoint_step_interval", integer=True, low=1)
        s["max_step_saves_to_keep"] = self.number("checkpoints_total_limit", integer=True, low=1)
        resume = self.get("resume_from_checkpoint")
        if resume not in (None, "latest"):
            self.err("resume_from_checkpoint", f"{resume!r}: FLAME resumes from the newest intact checkpoint of the "
                                               f"run's folder (SimpleTuner's latest)")
        prompts = []
        if self.given("validation_prompt"):
            prompts.append(str(self.get("validation_prompt")))
        if self.given("user_prompt_library"):
            prompts += self._prompt_library(self.get("user_prompt_library"))
        smp = self.proc.setdefault("sample", {})
        if not prompts:
            smp["sample_every"] = 0
            self.note("validation_prompt", "none: no previews")
            return
        smp["prompts"] = prompts
        smp["sample_every"] = self.number("validation_step_interval", integer=True, low=1)
        smp["sample_steps"] = self.number("validation_num_inference_steps", integer=True, low=1)
        smp["guidance_scale"] = self.number("validation_guidance", low=0)
        real = self._real_cfg(family)
        if family in ("sd3", "sdxl", "chroma", "qwen_image") or real > 1:
            smp["neg"] = str(self.get("validation_negative_prompt"))
        elif self.given("validation_negative_prompt"):
            self.note("validation_negative_prompt", "Flux's previews take no negative prompt without real CFG "
                                                    "(validation_guidance_real > 1): not used")
        if real > 1:   # (Flux's: true CFG against the negative prompt, from SimpleTuner's step on)
            smp["true_cfg"] = real
            smp["true_cfg_start"] = self.number("validation_no_cfg_until_timestep", integer=True, low=0)
        elif self.given("validation_no_cfg_until_timestep"):
            self.note("validation_no_cfg_until_timestep", "no real CFG (validation_guidance_real 1): not used")
        if self.given("validation_seed"):
            smp["seed"] = self.number("validation_seed", integer=True, low=0)
        size = str(self.get("validation_resolution"))
        sides = [_num(p, integer=True) for p in size.lower().split("x")]
        if "," in size or len(sides) > 2 or any(v is None or v <= 0 for v in sides):
            self.err("validation_resolution", f"one WxH or N (FLAME's previews share one size), got {size!r}")
        else:
            w, h = sides[0], sides[-1]
            if w < 128:
                self.err("validation_resolution", f"{size}: megapixel sizes are not read; give WxH")
            else:
                smp["width"], smp["height"] = w, h
        if self.given("validation_guidance_skip_layers"):
            layers = self.get("validation_guidance_skip_layers")
            if family != "sd3" or not isinstance(layers, list):
                self.err("validation_guidance_skip_layers", "SD3's, a list of block indices")
            else:
                smp["slg_layers"] = layers
                smp["slg_scale"] = self.number("validation_guidance_skip_scale", low=0)
        rescale = self.number("validation_guidance_rescale", low=0)
        if rescale is not None and rescale > 1:
            self.err("validation_guidance_rescale", f"a number in [0, 1], got {rescale!r}")
        elif rescale and family != "sdxl":
            self.err("validation_guidance_rescale", f"FLAME rescales SDXL's previews' guidance; the {family} previews "
                                                    f"take none (0.0)")
        elif rescale:
            smp["guidance_rescale"] = float(rescale)

    def _real_cfg(self, family):
        """validation_guidance_real: SimpleTuner's real CFG of a guidance-distilled Flux's previews (FLAME's
        sample.true_cfg); 1 for none. Other families run CFG with validation_guidance: > 1 there is an error."""
        real = self.number("validation_guidance_real", low=1)
        if real is None or real <= 1:
            return 1.0
        if family not in ("flux", "flux_kontext"):
            self.err("validation_guidance_real", f"real CFG is for Flux's guidance-distilled previews; the {family} "
                                                 f"previews run CFG with validation_guidance")
            return 1.0
        return float(real)

    def _evaluation(self, held_out):
        """The eval backend's folder as FLAME's validation loss: every eval_steps_interval steps, at eval_timesteps
        evenly spaced timesteps (SimpleTuner takes its scheduler's inference steps: a note), at most num_eval_images
        batches (its default 4), fixed noise (SimpleTuner seeds 0)."""
        every = self.get("eval_steps_interval")
        if self.given("eval_epoch_interval"):
            self.err("eval_epoch_interval", "FLAME evaluates every N steps (eval_steps_interval)")
            return
        if held_out is None:
            for k in ("eval_steps_interval", "num_eval_images", "eval_timesteps"):
                if self.given(k):
                    self.note(k, "no eval backend: not used (SimpleTuner evaluates none either)")
            return
        if every is None:
            self.note("eval_steps_interval", "not set: the eval backend is not evaluated (SimpleTuner's too)")
            return
        n = self.number("eval_timesteps", integer=True, low=1)
        v = {**held_out, "every": self.number("eval_steps_interval", integer=True, low=1), "timesteps": n,
             "seed": 0, "max_batches": self.number("num_eval_images", integer=True, low=1)}
        self.proc["validation"] = v
        self.note("eval_timesteps", f"{n} evenly spaced timesteps (SimpleTuner's are its scheduler's {n} inference "
                                    f"steps, shifted): the same held-out loss, measured at other noise levels")

    def _prompt_library(self, name):
        try:
            lib = read_json(self.near(name), SimpleTunerConfigError, "a prompt library")
        except SimpleTunerConfigError as e:
            self.err("user_prompt_library", str(e))
            return []
        if not isinstance(lib, dict):
            self.err("user_prompt_library", f"{name}: expected an object of name: prompt")
            return []
        out = []
        for k, v in lib.items():
            if isinstance(v, dict):
                v = next((v[f] for f in ("prompt", "caption", "tags") if isinstance(v.get(f), str)), None)
            if not isinstance(v, str):
                self.err("user_prompt_library", f"{name}: {k}: a prompt text, got {v!r}")
                continue
            out.append(v)
        return out

    def _logging(self):
        to = self.get("report_to")
        if to in (None, "none"):
            return
        if to not in ("tensorboard", "wandb"):
            self.err("report_to", f"{to!r}: FLAME logs to tensorboard or wandb")
            return
        self.put("logging", "use_tensorboard" if to == "tensorboard" else "use_wandb", True)
        if self.given("tracker_project_name") and to == "wandb":   # (TensorBoard has no project)
            self.put("logging", "project_name", str(self.get("tracker_project_name")))
        if self.given("tracker_run_name"):
            self.put("logging", "run_name", str(self.get("tracker_run_name")))

    def _rest(self):
        if self.flag("push_to_hub"):
            self.err("push_to_hub", "FLAME does not upload (it never reaches the network)")
        else:
            for k in _HUB:
                if self.given(k):
                    self.note(k, "a Hub setting: not used without push_to_hub")
        if self.flag("controlnet"):
            self.err("controlnet", "FLAME trains LoRAs and full fine-tunes of the model itself")
        if self.flag("quantize_activations"):
            self.err("quantize_activations", "FLAME quantises weights only (model.quantize)")
        if self.flag("strict_epoch_limit") and "epochs" not in self.proc.get("train", {}):
            self.err("strict_epoch_limit", "with max_train_steps: FLAME trains to the step count")
        if self.given("validation_lycoris_strength"):
            w = self.number("validation_lycoris_strength")
            if self.get("lora_type") == "lycoris" and w is not None:
                self.put("sample", "network_multiplier", w)
            elif w not in (None, 1, 1.0):
                self.err("validation_lycoris_strength", "LyCORIS's (lora_type lycoris) previews' weight")
        for k in _HINTS:
            if self.given(k):
                self.note(k, "not used (a host or speed setting of SimpleTuner's)")
        for k, why in _INERT.items():
            if self.given(k):
                self.note(k, why)
        if self.given("resume_from_checkpoint"):
            self.note("resume_from_checkpoint", "FLAME resumes from the run's newest intact checkpoint on its own")

    def _unread(self):
        """The options nothing above read: one SimpleTuner has but leaves unused in this configuration (lora_rank in
        a full fine-tune, the validation settings without a prompt, ...) is a note; any other an error."""
        for k in self.args:
            if k in self.used:
                continue
            if k in DEFAULTS:
                self.note(k, "not used in this configuration (SimpleTuner does not use it either)")
            else:
                self.err(k, "not supported by FLAME's SimpleTuner reader (flame_models/training/simpletuner_config.py "
                            "lists what it reads)")
    def _datasets(self, family):
        name = self.get("data_backend_config")
        if name is None:
            self.err("data_backend_config", "required (the multidatabackend.json; SimpleTuner requires it too)")
            return
        defaults = {k: self.get(k) for k in BACKEND_DEFAULTS}
        defaults["model_type"] = str(self.get("model_type") or "").lower()
        for k in ("caption_dropout_probability",):
            n = _num(defaults[k])
            if n is None or not 0 <= n <= 1:
                self.err(k, f"a probability in [0, 1], got {defaults[k]!r}")
                return
            defaults[k] = n
        for k in ("prepend_instance_prompt", "only_instance_prompt"):
            defaults[k] = bool(_bool(defaults[k])) if defaults[k] is not None else None
        for k in ("resolution", "minimum_image_size", "maximum_image_size", "target_downsample_size"):
            if defaults[k] is not None:
                defaults[k] = _num(defaults[k])
        try:
            datasets, notes, held_out = read_backends(self.near(name), defaults)
        except SimpleTunerConfigError as e:
            self.errors.append(f"{self.path}: data_backend_config {e}")
            return
        self._evaluation(held_out)
        if family == "flux_kontext" and not all("control_path" in d for d in datasets):
            self.errors.append(f"{self.path}: data_backend_config: Flux Kontext trains on edit pairs: every image "
                               f"backend needs conditioning_data (its reference images)")
        self.proc["datasets"] = datasets
        self.notes += notes
