"""Training configuration: ai-toolkit-style YAML (the files users already have) -> validated dataclasses.

`load_config(path)` reads `job / config.name / config.process[0] / meta` (or a bare process mapping) and returns a
`TrainConfig`. Every problem is reported at once, before any model, data or GPU work, with the path of its field
(`config.process[0].train.lr: ...`): wrong types, null or non-finite numbers, unknown keys (with a suggestion),
values out of range, settings that contradict each other, a model file that is not the model (read from its header),
dataset files whose tensors do not fit the model (headers only). No key is accepted and ignored: an ai-toolkit key for
a feature FLAME does not have yet is accepted only with a value that asks for nothing (false, 0, empty), and is an
error naming what is missing otherwise. YAML 1.1 reads `1e-4` as a string: numeric strings are accepted wherever a
number is expected.
"""
import difflib
import math
import os
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

from flame_core.errors import FlameError

# a `datasets:` entry: an image folder with captions (every field), or a folder of precomputed samples (one
# .safetensors each with the family's sample_keys: folder_path, num_repeats, shuffle only)
from ..data.config import DatasetConfig
from .optimizers import (
    OPTIMIZERS,  # noqa: F401 (validation.py reads the names from here)
    PRODIGY_MIN_LR,
)
from .optimizers import canonical as _canonical_optimizer
from .optimizers import check_params as _check_optimizer_params

NETWORK_TYPES = ("lora", "locon", "dora", "lokr", "loha", "full")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
SCHEDULER_PARAMS = {"cosine_with_restarts": ("num_cycles",), "polynomial": ("power", "lr_end")}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32", "float": "float32"}
FILE_FORMATS = ("kohya", "peft")
PROCESS_TYPES = ("sd_trainer", "diffusion_trainer", "ui_trainer")  # ui_trainer: a job of ai-toolkit's UI
JOB_TYPES = ("extension", "train")


class ConfigError(FlameError, ValueError):
    """An invalid training configuration; the message lists every problem with the path of its field."""


# ----------------------------------------------------------------------------- sections
@dataclass
class NetworkConfig:
    type: str = "lora"                   # lora | locon (= lora) | dora | lokr | loha | full (the model's own
                                         # weights: full fine-tuning, training/full_finetune.py)
    linear: int = 16                     # rank (alias: rank)
    linear_alpha: float = 16.0           # alpha (alias: alpha); scale = alpha / rank (rsLoRA: alpha / sqrt(rank))
    dropout: float = 0.0                 # dropout on the adapter input (LoRA / DoRA)
    rslora: bool = False
    lokr_factor: int = -1                # LoKr: -1 the most balanced factorisation
    lokr_full_rank: bool = False         # LoKr: full w2 instead of w2_a @ w2_b
    target: typing.Any = None            # preset name or list of patterns; None: the family's default preset
    conv: typing.Optional[int] = None    # LoCon: the convolutions' LoRA rank (kohya's conv_dim; SDXL); 0 / null off
    conv_alpha: typing.Optional[float] = None  # their alpha (kohya's conv_alpha); null: = conv (ai-toolkit's default)
    network_kwargs: dict = field(default_factory=dict)  # ai-toolkit: only_if_contains / ignore_if_contains
    loraplus_lr_ratio: typing.Optional[float] = None  # LoRA+ (kohya's network_args name): the up (B) matrices of
                                                      # LoRA / DoRA / LoCon train at lr x ratio (the paper: 16)
    loraplus_unet_lr_ratio: typing.Optional[float] = None          # the denoiser's ratio (default the one above)
    loraplus_text_encoder_lr_ratio: typing.Optional[float] = None  # the text encoders' (default the one above)
    rank_dropout: float = 0.0            # kohya's: each rank of the adapter's intermediate dropped per sample, the
                                         # rest scaled by 1/(1-p) (LoRA / DoRA / LoCon; also network_kwargs')
    module_dropout: float = 0.0          # kohya's: the whole adapter skipped for a step with this probability
    pretrained_lora_path: typing.Optional[str] = None  # start from this LoRA file's adapters and values (ai-toolkit's
                                         # name; kohya's network_weights): its layers, kind, ranks and scales; the
                                         # settings above left out are the file's (training/pretrained_lora.py)


@dataclass
class SaveConfig:
    dtype: str = "bf16"                  # dtype of the written LoRA file (checkpoints keep float32)
    save_every: int = 250
    save_every_epochs: typing.Optional[int] = None   # kohya's save_every_n_epochs (save_every then derived from it)
    max_step_saves_to_keep: int = 4      # checkpoints (and their step LoRA files) kept; older ones are removed
    format: str = "kohya"                # kohya | peft; the default is one ComfyUI and diffusers both read: kohya
                                         # for Flux and SDXL, peft for SD3 (docs/ARCHITECTURES.md: LoRA layouts)
    save_format: str = "safetensors"     # ai-toolkit's: a full fine-tune's model as one .safetensors file in its
                                         # native layout, or "diffusers": a folder (unet/ or transformer/, and a
                                         # diffusers base's other components) -- checkpoint_io.pipeline_folder


@dataclass
class SyntheticConfig:
    num_samples: int = 16
    height: int = 128                    # pixels
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
    epochs: typing.Optional[int] = None  # kohya's max_train_epochs: the run's length in epochs of the image datasets
                                         # (train.steps then derived from their batches; give one of the two)
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = True
    full_bf16: bool = False              # network.type full: the weights stay bf16 (no float32 copies), adamw8bit
                                         # or adafactor rounding each update stochastically (kohya's full_bf16)
    checkpoint_save: str = "none"        # with gradient_checkpointing: "attention" keeps each block's attention
                                         # output for backward instead of recomputing it (faster, one attention
                                         # output per block more memory; flame_core.checkpoint's save=)
    fp8_compute: bool = False            # with model.quantize: the fp8 blocks' matmuls on the e4m3 tensor cores
                                         # (activations and gradients quantised per tensor; flame_nn.offload)
    fp8_scaling: str = "current"         # with fp8_compute: "current" (each tensor's own amax) or "delayed" (from
                                         # the amaxes of its last calls: one pass; flame_nn.offload.set_fp8_scaling_)
    fp8_cache_transposes: typing.Any = "auto"  # with fp8_compute: the weights' W^T kept resident for the input
                                         # gradient's GEMM (no transpose per backward call, the fp8 weights' size
                                         # again in memory; flame_nn.offload.cache_fp8_transposes_): true, false or
                                         # auto (on without max_gpu_memory); true under max_gpu_memory: the
                                         # resident blocks' only (the fit keeps room for every block's). auto by
                                         # default: 3-6% faster steps on the H200 (BENCHMARKS, issue 45)
    offload_activations: typing.Optional[bool] = None  # under max_gpu_memory: the checkpointed block inputs kept in
                                         # pinned host memory until backward (None: when the budget needs it;
                                         # flame_nn.offload.activations)
    cuda_graph: bool = True              # forward + backward replayed as a CUDA graph on cuda (flame_core.cuda)
    noise_scheduler: str = "flowmatch"   # flowmatch (flux, sd3) | ddpm (sdxl; its default)
    # flow matching (flux, sd3): how sigma is drawn, and the loss weight by sigma (objective.py, timesteps.py)
    timestep_type: str = "sigmoid"       # sigmoid | logit_normal | uniform | linear | shift | flux_shift | mode |
                                         # chroma
                                         # (sd3's default: logit_normal; chroma's: chroma)
    content_or_style: str = "balanced"   # ai-toolkit's: balanced | content (favour high noise) | style (low noise)
    shift: float = 3.0                   # timestep_type 'shift'
    sigmoid_scale: float = 1.0           # timestep_type sigmoid, shift, flux_shift
    logit_mean: float = 0.0              # timestep_type logit_normal (kohya / diffusers names)
    logit_std: float = 1.0
    mode_scale: float = 1.29             # timestep_type mode (kohya / diffusers name and default)
    weighting_scheme: str = "none"       # none | uniform | sigma_sqrt | cosmap | logit_normal | mode (diffusers /
                                         # kohya; the last two name a timestep density: timestep_type follows)
    # DDPM (sdxl): epsilon or v-prediction on the scaled-linear schedule (ddpm_objective.py; kohya's names)
    prediction_type: str = "epsilon"     # epsilon | v_prediction (diffusers' name; ai-toolkit: model.is_v_pred)
    zero_terminal_snr: bool = False      # rescaled betas with alpha_bar = 0 at the last step (use v_prediction)
    min_snr_gamma: typing.Optional[float] = None  # min-SNR-gamma loss weighting (5 is the paper's); None: off
    min_timestep: int = 0                # timesteps drawn from [min_timestep, max_timestep)
    max_timestep: int = 1000
    noise_offset: float = 0.0            # every family: offset * N(0, 1) per sample and channel added to the noise
    ip_noise_gamma: float = 0.0          # kohya's input perturbation: the noise the model sees is ε + γ·ξ (ξ another
                                         # N(0, 1) draw), the target keeps ε (0.1 is the paper's)
    ip_noise_gamma_random_strength: bool = False  # γ drawn uniformly in [0, ip_noise_gamma) per step
    loss_type: str = "l2"                # kohya's: l2 | l1 | huber | smooth_l1 (training/loss_types.py);
                                         # ai-toolkit's mse / mae are l2 / l1
    huber_c: float = 0.1                 # huber / smooth_l1: the threshold, in (0, 1]
    huber_schedule: typing.Optional[str] = None  # constant | exponential | snr (sdxl only); None: sdxl snr
                                                 # (kohya's default), flow families constant
    huber_scale: float = 1.0             # constant / exponential: the threshold's factor
    optimizer: str = "adamw8bit"
    lr: float = 1e-4
    optimizer_params: dict = field(default_factory=dict)  # the optimizer's keyword arguments (optimizers.py)
    lr_scheduler: str = "constant"       # constant and constant_with_warmup both honour lr_warmup_steps
    lr_scheduler_params: dict = field(default_factory=dict)  # cosine_with_restarts: num_cycles (1); polynomial:
                                                             # power (1.0), lr_end (1e-7) -- transformers' defaults
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0           # 0 disables clipping (0 by default when max_grad_value is given)
    max_grad_value: typing.Optional[float] = None  # clamp every gradient element to [-v, v] before the step
                                         # (torch's clip_grad_value_; SimpleTuner's grad_clip_method value)
    scale_weight_norms: typing.Optional[float] = None  # kohya's max-norm regularisation: after each step a LoRA /
                                         # LoCon adapter whose ΔW norm exceeds this is scaled down to it (1.0 is
                                         # kohya's suggestion); None: off (flame_nn.adapters.max_norm)
    ema_config: EMAConfig = field(default_factory=EMAConfig)
    dtype: str = "bf16"                  # autocast dtype of the forward pass
    train_unet: bool = True
    train_text_encoder: bool = False     # sdxl, image folders: LoRA on CLIP-L / CLIP-G too (ai-toolkit's name)
    text_encoder_lr: typing.Optional[float] = None  # their learning rate (kohya --text_encoder_lr); None: lr
    guidance: float = 1.0                # guidance embedding value while training (flux-dev)
    guidance_range: typing.Any = None    # flux-dev: [min, max]: each sample's guidance drawn uniformly in it, from
                                         # the timesteps' random stream (SimpleTuner's flux_guidance_mode
                                         # random-range); None: train.guidance for every sample
    bypass_guidance_embedding: bool = False  # ai-toolkit's: flux-dev trains without its guidance embedding in the
                                         # conditioning vector (previews keep it)
    # regularisation images (datasets with is_reg: true; flame_models/data/reg_mix.py)
    reg_weight: float = 1.0              # their loss's weight (ai-toolkit's name; alias: kohya's prior_loss_weight)
    reg_ratio: float = 0.5               # FLAME: the share of micro-batches drawn from them, in (0, 1)
    # ai-toolkit's differential output preservation (preservation.py): each step, the caption with the trigger word
    # replaced by the class word keeps the prediction the model makes there without the adapters
    diff_output_preservation: bool = False
    diff_output_preservation_multiplier: float = 1.0   # the preservation loss's weight
    diff_output_preservation_class: typing.Optional[str] = None   # the class word, e.g. "person"
    blank_prompt_preservation: bool = False   # ai-toolkit's: the same with the empty prompt (not with the above)
    blank_prompt_preservation_multiplier: float = 1.0
    seed: int = 42
    skip_first_sample: bool = False
    force_first_sample: bool = False     # ai-toolkit's: a resumed run samples before its first step too
    disable_sampling: bool = False


@dataclass
class ModelConfig:
    name_or_path: typing.Optional[str] = None  # the model file or folder; None: random init of `size`
    arch: str = "flux"                   # the model family (family.py): flux | sd3 | sdxl
    size: typing.Optional[str] = None    # random-init preset when name_or_path is None (default: the family's)
    dtype: str = "bf16"                  # dtype of the frozen base weights
    quantize: typing.Any = False         # store the blocks' frozen Linear weights as fp8 (e4m3, per-channel scales):
                                         # true or 'fp8' (also float8 / qfloat8: ai-toolkit's qtype name)
    qtype: typing.Optional[str] = None   # ai-toolkit's quantisation type: only its fp8 ones (qfloat8, float8, fp8),
                                         # what model.quantize stores; others are errors
    quantize_kwargs: dict = field(default_factory=dict)   # ai-toolkit's: exclude: [patterns] of modules outside
                                                          # the blocks (quantize_kwargs.py)
    is_flux: typing.Optional[bool] = None  # ai-toolkit's flags: without arch, the one that is true chooses it;
    is_v3: typing.Optional[bool] = None    # with arch, they must agree with it (is_flux either way with a
                                           # Flux-derived arch: flux_kontext, chroma)
    is_xl: typing.Optional[bool] = None
    is_v_pred: typing.Optional[bool] = None  # ai-toolkit: a v-prediction model (= train.prediction_type v_prediction)
    # the other parts, for image folders and text prompts (default: found in name_or_path's folder, or the random
    # parts of `size`); FLAME's fields for single-file users:
    vae_path: typing.Optional[str] = None        # e.g. ae.safetensors (BFL), a diffusers vae/ folder
    clip_l_path: typing.Optional[str] = None     # e.g. clip_l.safetensors, a text_encoder/ folder
    clip_g_path: typing.Optional[str] = None     # sd3 / sdxl: e.g. clip_g.safetensors, a text_encoder_2/ folder
    t5_path: typing.Optional[str] = None         # e.g. t5xxl_fp16.safetensors, a text_encoder_2/ folder
    tokenizer_path: typing.Optional[str] = None  # a folder with tokenizer/ and tokenizer_2/ (default: the model
                                                 # folder's, else the vocabularies packaged with FLAME)
    quantize_te: bool = False                    # T5's (Qwen-Image: Qwen2.5-VL's) Linear weights in fp8 (e4m3)
    qtype_te: typing.Optional[str] = None        # ai-toolkit's type of quantize_te: its fp8 ones (qfloat8, ...) only
    t5_max_length: typing.Optional[int] = None   # T5 tokens per caption (kohya's t5xxl_max_token_length); default
                                                 # 512 for flux-dev, 256 for schnell and sd3
    use_t5: bool = True                          # sd3: false encodes without T5 (its tokens are zeros, as the
                                                 # references allow); a model without T5 gets zeros either way
    # LoRAs on the frozen base (ai-toolkit's; base_loras.py): a file, or a folder with pytorch_lora_weights.safetensors
    lora_path: typing.Optional[str] = None            # merged into the base for training and previews (its
                                                      # text-encoder part into the text encoders)
    assistant_lora_path: typing.Optional[str] = None  # merged for training, taken out of previews (weight -1): Flux
                                                      # schnell's training adapter
    inference_lora_path: typing.Optional[str] = None  # previews only (weight 1)


@dataclass
class SampleConfig:
    sample_every: int = 250              # 0: never
    sample_start_step: int = 0           # no samples before this step (ai-toolkit)
    width: typing.Optional[int] = None   # None: the dataset's resolution
    height: typing.Optional[int] = None
    sample_steps: int = 20
    seed: int = 42
    walk_seed: bool = False              # prompt i uses seed + i
    guidance_scale: float = 4.0          # flux: the guidance embedding; sd3 / sdxl: CFG (defaults 4.5 / 5.0)
    sampler: typing.Optional[str] = None  # the family's sampler (flux, flux_kontext, chroma, qwen_image, sd3:
                                          # flowmatch / euler (default), heun, dpmpp_2m, dpmpp_2m_sde,
                                          # unipc; sdxl: euler (default),
                                          # euler_ancestral (euler_a), heun, dpm_2, dpm_2_ancestral, dpmpp_2m,
                                          # dpmpp_2m_sde, ddim, unipc, lcm); other values are errors
    scheduler: typing.Optional[str] = None  # flow families: the sigma spacing, simple (default: the family's own),
                                            # karras, exponential or beta (flame_models/samplers/flow_schedules.py);
                                            # sdxl: only None (its previews use the model's sigmas)
    neg: typing.Any = None               # sd3 / sdxl / chroma / qwen_image, and flux with true_cfg: the previews'
                                         # negative prompt (default: sd3 "", sdxl zeros, as diffusers); ai-toolkit's
                                         # false or "" ask for none
    guidance_rescale: float = 0.0        # sdxl: CFG rescaled toward the prompt's prediction's spread, 0 to 1
                                         # (ai-toolkit's; diffusers' guidance_rescale; 0.7 for v-prediction models
                                         # with zero terminal SNR; SimpleTuner's validation_guidance_rescale)
    true_cfg: float = 1.0                # flux / flux_kontext: > 1 runs true classifier-free guidance against neg
                                         # ("" by default): v_neg + true_cfg (v_pos - v_neg), two forwards a step
                                         # (diffusers' true_cfg_scale, SimpleTuner's validation_guidance_real;
                                         # a prompt's --l beside --g sets its own, as kohya's)
    true_cfg_start: int = 0              # the first step (0-based) that runs it; the earlier ones run the prompt
                                         # alone (SimpleTuner's validation_no_cfg_until_timestep)
    slg_scale: float = 0.0               # sd3: skip-layer guidance in previews (SD3.5 Medium's reference: 2.5)
    slg_layers: list = field(default_factory=lambda: [7, 8, 9])  # sd3: the joint blocks it skips
    prompts: list = field(default_factory=list)  # text prompts ([trigger] -> trigger_word); needs the text
                                                 # encoders (image datasets, or the parts of model.size)
    num_samples: int = 2                 # without prompts: the first dataset items' captions / conditioning
    network_multiplier: float = 1.0      # ai-toolkit's: the adapters' weight in the previews without their own --m
    prompt_embeds: list = field(default_factory=list)  # or .safetensors files with the conditioning arrays


@dataclass
class LoggingConfig:
    """ai-toolkit's `logging:` section (plus TensorBoard, which ai-toolkit lacks: kohya's --log_with tensorboard)."""
    log_every: typing.Optional[int] = None  # same as the top-level log_every (a run gives one of the two)
    use_tensorboard: bool = False        # event files under <run folder>/tensorboard (needs tensorboardX: the
                                         # `tensorboard` extra)
    use_wandb: bool = False              # Weights & Biases (needs wandb installed; WANDB_MODE=offline works without
                                         # a network and is the default when WANDB_MODE is unset)
    project_name: str = "flame"          # the wandb project
    run_name: typing.Optional[str] = None  # wandb's run name and TensorBoard's run folder name; None: the run's name
    verbose: bool = False                # ai-toolkit's; FLAME's log lines do not depend on it


@dataclass
class ValidationConfig:
    """A validation loss (validation_loss.py): the loss of held-out images at fixed timesteps and fixed noise, every
    `every` steps. Peers' names are aliases: kohya's validation_split, validate_every_n_steps, validation_seed,
    max_validation_steps; SimpleTuner's eval_steps_interval, eval_timesteps."""
    folder_path: typing.Optional[str] = None  # a held-out image folder (captions, resolutions and buckets as
                                              # datasets[0]'s); or:
    split: float = 0.0                   # this fraction of each training folder's images held out (never trained on)
    control_path: typing.Optional[str] = None  # flux_kontext: folder_path's control images (same names)
    every: int = 250                     # steps between evaluations (also before the first step and after the last)
    timesteps: typing.Any = field(default_factory=lambda: [10, 350, 500, 650, 990])  # on the 0-1000 scale (flow
                                         # matching: sigma = t / 1000); a list, or a count N: N evenly spaced
                                         # (t = 1000 (i + 0.5) / N); default kohya's five
    seed: int = 42                       # the noise (and which images split holds out); not train.seed
    batch_size: typing.Optional[int] = None  # images per forward; None: train.batch_size
    max_batches: typing.Optional[int] = None  # at most this many batches per evaluation; None: every image


@dataclass
class TrainConfig:
    name: str = "flux_lora"
    training_folder: str = "runs"
    type: str = "sd_trainer"             # ai-toolkit's process type: sd_trainer / diffusion_trainer / ui_trainer (a
                                         # job its UI wrote: the inert settings it writes into every job are warnings)
    device: typing.Optional[str] = None  # None: cuda when available, else cpu
    trigger_word: typing.Optional[str] = None  # replaces [trigger] in captions (prepended when missing) and prompts
    max_gpu_memory: typing.Any = None    # e.g. '12GiB' (a bare number is GiB; flame_core.memory.stats.parse_budget):
                                         # stream the transformer blocks from pinned host memory, keeping as many
                                         # resident as this budget allows (network.type full: each block updated
                                         # inside backward, flame_nn.offload.LayerwiseOptimizer)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    datasets: typing.List[DatasetConfig] = field(default_factory=list)
    synthetic: typing.Optional[SyntheticConfig] = None  # used when `datasets` is empty
    train: TrainSection = field(default_factory=TrainSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    log_every: int = 1                   # a loss-log row (the mean of the last log_every steps) every log_every steps
    performance_log_every: int = 0       # ai-toolkit's: every N steps, where the last N steps' time went (timing.py);
                                         # 0: off
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: typing.Optional[ValidationConfig] = None  # a validation loss (off when absent)
    meta: dict = field(default_factory=dict)  # ai-toolkit `meta`: written into the LoRA file's metadata
    warnings: list = field(default_factory=list)   # notes for the user (not part of the config)
    given: frozenset = frozenset()                 # dotted paths of the fields the input set (not part of it)

    @property
    def output_dir(self):
        return os.path.join(self.training_folder, self.name)


_INTERNAL = ("warnings", "given")
_ALIASES = {NetworkConfig: {"rank": "linear", "alpha": "linear_alpha",
                            "network_weights": "pretrained_lora_path"},   # (kohya's --network_weights)
            SaveConfig: {"save_dtype": "dtype"},
            TrainSection: {"prior_loss_weight": "reg_weight",
                           # ai-toolkit's "proper" accumulation (one step per N micro-batches: FLAME's), as its UI
                           # writes it
                           "gradient_accumulation": "gradient_accumulation_steps"},
            ValidationConfig: {"validation_split": "split", "validate_every_n_steps": "every",
                               "eval_steps_interval": "every", "eval_timesteps": "timesteps",
                               "validation_seed": "seed", "max_validation_steps": "max_batches"}}

# ai-toolkit keys of features FLAME does not have yet: accepted only with a value that asks for nothing
_WAITS_FOR = {
    ModelConfig: {"model_kwargs": "no model takes extra keyword arguments here",
                  "is_v2": "SD 1.x / 2.x are not supported: model.arch is flux, sd3 or sdxl"},
    TrainSection: {"linear_timesteps": "use train.timestep_type (sigmoid, logit_normal, uniform, shift, flux_shift)",
                   # kohya's block swapping: FLAME streams blocks to fit a budget, and updates them inside backward
                   "blocks_to_swap": "use max_gpu_memory: the blocks streamed from host memory are chosen to fit "
                                     "that budget (auto-fit)",
                   "fused_backward_pass": "with network.type full under max_gpu_memory each block is updated inside "
                                          "backward already (no flag)"},
    SaveConfig: {"push_to_hub": "uploading is not supported", "hf_repo_id": "uploading is not supported",
                 "hf_private": "uploading is not supported"},
}
# ai-toolkit keys that only one value of makes sense for here: accepted with it, an error naming why otherwise
_ONLY = {DatasetConfig: {"cache_latents": (True, "FLAME always caches latents before training (in host memory; "
                                                 "cache_latents_to_disk: true keeps them on disk)"),
                         # ai-toolkit's, written by its UI into every dataset: image datasets at weight 1
                         "network_weight": (1, "every dataset trains the adapters at weight 1"),
                         "num_frames": (1, "FLAME trains on images (a video model's frames are not read)"),
                         "controls": ([], "Flux Kontext's control images come from control_path")},
         SampleConfig: {"num_frames": (1, "previews are images")}}
# ai-toolkit keys that do nothing here whatever their value (its UI writes them into every job): accepted, and a
# warning says why they change nothing
_INERT = {TrainConfig: {"sqlite_db_path": "the ai-toolkit UI's job database (FLAME has no UI)"},
          # (ai-toolkit's memory placement hint: said only when it asks for something)
          ModelConfig: {"low_vram": "FLAME places a run's memory by max_gpu_memory (give it to bound the GPU's)"},
          DatasetConfig: {"shrink_video_to_frames": None, "do_i2v": None},   # (video files: FLAME reads images)
          SampleConfig: {"fps": None},                                      # (a video preview's)
          TrainSection: {"unload_text_encoder": "FLAME encodes every caption once before training and frees the "
                                                "text encoders",
                         "cache_text_embeddings": "FLAME encodes every caption once before training (the same "
                                                  "embeddings as encoding each step) and frees the text encoders",
                         "switch_boundary_every": None}}   # (Wan 2.2's two experts)
_INERT_WHEN_SET = ("low_vram",)   # said only when they ask for something (false is no request)


def _asks_for_nothing(value):
    return value is None or value is False or value == 0 or value in ("", [], {})


# ----------------------------------------------------------------------------- building dataclasses from mappings
_BAD = object()


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _optional(tp):
    """(inner type, True) for Optional[X], else (tp, False)."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _number(value, tp, path, errors):
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            errors.append(f"{path}: expected a number, got {value!r}")
            return _BAD
    if not _is_number(value):
        errors.append(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        return _BAD
    if not math.isfinite(value):
        errors.append(f"{path}: must be a finite number, got {value!r}")
        return _BAD
    if tp is int:
        if float(value) != int(value):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return _BAD
        return int(value)
    return float(value)


def _coerce(value, tp, path, errors, given, notes=None):
    tp, optional = _optional(tp)
    if value is None:
        if optional or tp is typing.Any:
            return None
        if is_dataclass(tp) or tp in (dict, list) or typing.get_origin(tp) in (list, typing.List):
            return _coerce({} if is_dataclass(tp) or tp is dict else [], tp, path, errors, given, notes)
        what = {bool: "true or false", int: "a number", float: "a number", str: "a string"}.get(tp, "a value")
        errors.append(f"{path}: expected {what}, got null (remove the key to use the default)")
        return _BAD
    if tp is typing.Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return _BAD
        return _build(tp, value, path, errors, given, notes)
    if typing.get_origin(tp) in (list, typing.List):
        (item_tp,) = typing.get_args(tp) or (typing.Any,)
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return _BAD
        items = [_coerce(v, item_tp, f"{path}[{i}]", errors, given, notes) for i, v in enumerate(value)]
        return [v for v in items if v is not _BAD]
    if tp in (list, dict):
        if not isinstance(value, tp):
            errors.append(f"{path}: expected a {'list' if tp is list else 'mapping'}, got {type(value).__name__} "
                          f"{value!r}")
            return _BAD
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path}: expected true or false, got {value!r}")
        return _BAD
    if tp in (int, float):
        return _number(value, tp, path, errors)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return _BAD
    return value


def _rel(path):
    """The field path without the `config.process[0].` prefix (what TrainConfig.given holds)."""
    return path.split("].", 1)[1] if path.startswith("config.process[") else path


def _build(cls, data, path, errors, given, notes=None):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls) if f.name not in _INTERNAL]
    aliases = _ALIASES.get(cls, {})
    waits = _WAITS_FOR.get(cls, {})
    only = _ONLY.get(cls, {})
    inert = _INERT.get(cls, {})
    defaults = {f.name: f.default for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key = str(key)
        where = f"{path}.{key}" if path else key
        name = aliases.get(key, key)
        if name in names:
            if name in kwargs:
                errors.append(f"{where}: given twice (also as an alias)")
            if value is None and defaults[name] is None:   # null for a setting whose default is none
                kwargs[name] = None
                given.add(_rel(f"{path}.{name}" if path else name))
                continue
            v = _coerce(value, hints[name], where, errors, given, notes)
            if v is not _BAD:  # a bad value keeps the default, so it causes no follow-up errors
                kwargs[name] = v
                given.add(_rel(f"{path}.{name}" if path else name))
        elif key in waits:
            if not _asks_for_nothing(value):
                errors.append(f"{where}: not available: {waits[key]}")
        elif key in only:
            if value != only[key][0] and not (only[key][0] == [] and value is None):
                errors.append(f"{where}: only {only[key][0]!r} is accepted: {only[key][1]}")
        elif key in inert:
            if inert[key] is not None and notes is not None and (value or key not in _INERT_WHEN_SET):
                notes.append(f"{where}: not used: {inert[key]}")
        else:
            near = difflib.get_close_matches(key, names + list(aliases), n=1)
            errors.append(f"{where}: unknown field" + (f"; did you mean '{near[0]}'?" if near else
                                                       f"; known: {', '.join(names)}"))
    return cls(**kwargs)


# the model settings ai-toolkit's configs give Hugging Face repo ids in (read from the local cache: hub_cache.py)
_HUB_FIELDS = ("name_or_path", "vae_path", "lora_path", "assistant_lora_path", "inference_lora_path")


def _resolve_hub_ids(cfg, p, errors):
    """Each of model's _HUB_FIELDS that is a repo id (not a path that exists) and that the local Hugging Face cache
    holds becomes that snapshot's folder, said in a warning; a repo id the cache lacks is left for the file checks
    (their errors say how to fetch it)."""
    from ..checkpoint_io import hub_cache
    for name in _HUB_FIELDS:
        value = getattr(cfg.model, name)
        try:
            path = hub_cache.resolve(value)
        except hub_cache.HubCacheError as e:
            errors.append(f"{p}model.{name}: {value}: {e}")
            continue
        if path is not None:
            setattr(cfg.model, name, path)
            cfg.warnings.append(f"{p}model.{name}: {value} read from the Hugging Face cache: {path}")


# ai-toolkit's train.loss_type names of kohya's (loss_types.py): the same per-element errors
AI_TOOLKIT_LOSS_TYPES = {"mse": "l2", "mae": "l1"}


def _clean_optimizer(t, where, errors, notes):
    """train.optimizer by any peer spelling (optimizers.py), its optimizer_params checked against what that
    optimizer takes, and lr_scheduler_params against the schedule; Prodigy's lr as ai-toolkit sets it (said in
    `notes`)."""
    name = _canonical_optimizer(t.optimizer)
    if name is not None:
        t.optimizer = name
        if not isinstance(t.optimizer_params, dict):
            errors.append(f"{where}.optimizer_params: expected a mapping, got {t.optimizer_params!r}")
            t.optimizer_params = {}
        t.optimizer_params = _check_optimizer_params(name, t.optimizer_params, f"{where}.optimizer_params", errors,
                                                     _number)
        if name == "prodigy" and t.text_encoder_lr is not None and t.text_encoder_lr not in (t.lr, 0):
            errors.append(f"{where}.text_encoder_lr: prodigy takes one lr for every parameter group (or 0), got "
                          f"{t.text_encoder_lr} beside lr {t.lr}")
        elif name == "prodigy" and _is_number(t.lr) and 0 < t.lr < PRODIGY_MIN_LR:
            # as ai-toolkit builds it: its UI's default lr (1e-4) with Prodigy would scale every step by 1e-4
            notes.append(f"{where}.lr: {t.lr:g} with prodigy is raised to 1.0, as ai-toolkit does below "
                         f"{PRODIGY_MIN_LR:g}: Prodigy's step is lr x its own estimate of the step size (1.0: the "
                         f"estimate itself)")
            if t.text_encoder_lr == t.lr:
                t.text_encoder_lr = 1.0
            t.lr = 1.0
    params = t.lr_scheduler_params
    if not isinstance(params, dict):
        errors.append(f"{where}.lr_scheduler_params: expected a mapping, got {params!r}")
        t.lr_scheduler_params = {}
        return
    known = SCHEDULER_PARAMS.get(t.lr_scheduler, ())
    out = {}
    for k, v in params.items():
        if k not in known:
            errors.append(f"{where}.lr_scheduler_params.{k}: unknown for lr_scheduler {t.lr_scheduler}"
                          + (f"; supported: {', '.join(known)}" if known else "; it takes none"))
            continue
        x = _number(v, int if k == "num_cycles" else float, f"{where}.lr_scheduler_params.{k}", errors)
        if x is _BAD:
            continue
        if x <= 0 and k != "lr_end" or x < 0:
            errors.append(f"{where}.lr_scheduler_params.{k}: must be {'>= 0' if k == 'lr_end' else '> 0'}, got {x}")
            continue
        out[k] = x
    t.lr_scheduler_params = out


# ----------------------------------------------------------------------------- entry points
def _format(source, errors):
    if len(errors) == 1:
        return f"{source}: {errors[0]}"
    return f"{source}: {len(errors)} problems in the training config:\n  " + "\n  ".join(errors)


def config_from_dict(data, source="<dict>", check_files=True):
    """A validated TrainConfig from an ai-toolkit-style mapping (or a bare process mapping). check_files: also read
    the model's and the datasets' headers (nothing else is read)."""
    from .validation import validate
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    errors, given = [], set()
    meta = None
    if "config" in data:
        for k in data:
            if k not in ("job", "config", "meta"):
                errors.append(f"{k}: unknown top-level field (expected job, config, meta)")
        if data.get("job") is not None and data.get("job") not in JOB_TYPES:
            errors.append(f"job: {data.get('job')!r} is not a training job (expected {' or '.join(JOB_TYPES)})")
        meta = data.get("meta")
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
        if meta is not None:
            if "meta" in proc:
                errors.append("meta: given both at the top level and in config.process[0]")
            proc["meta"] = meta
        prefix = "config.process[0]"
    else:
        proc, prefix = data, ""
    notes = []
    if isinstance(proc.get("sample"), dict) and "samples" in proc["sample"]:
        proc = {**proc, "sample": _samples_as_prompts(proc["sample"], f"{prefix + '.' if prefix else ''}sample",
                                                      errors)}
    cfg = _build(TrainConfig, proc, prefix, errors, given, notes)
    cfg.given = frozenset(given)
    cfg.warnings += notes
    if prefix and "network" not in proc:   # an ai-toolkit job file: there no network section means full fine-tuning
        cfg.warnings.append("no network section: FLAME trains its default adapter (LoRA r16 on the family's default "
                            "target); ai-toolkit would fine-tune the whole model here -- add `network: {type: full}` "
                            "for that")
    p = prefix + "." if prefix else ""
    _resolve_hub_ids(cfg, p, errors)
    _resolve_family(cfg, p, errors)
    _clean_optimizer(cfg.train, f"{p}train", errors, cfg.warnings)
    if isinstance(cfg.train.loss_type, str) and cfg.train.loss_type in AI_TOOLKIT_LOSS_TYPES:   # ai-toolkit's names
        cfg.train.loss_type = AI_TOOLKIT_LOSS_TYPES[cfg.train.loss_type]
    _clean_quantize(cfg, p, errors)
    _clean_network_kwargs(cfg, p, errors)
    if cfg.train.max_grad_value is not None and "train.max_grad_norm" not in given:
        cfg.train.max_grad_norm = 0.0   # clipping by value: not by the (default) norm too unless asked
    if isinstance(cfg.logging.log_every, int) and "logging.log_every" in given:  # ai-toolkit's place for it
        if "log_every" in given and cfg.log_every != cfg.logging.log_every:
            errors.append(f"{p}logging.log_every: {cfg.logging.log_every} differs from {p}log_every "
                          f"{cfg.log_every}; give one")
        cfg.log_every = cfg.logging.log_every
    errors += validate(cfg, p, check_files)  # a mistyped value kept its default: no follow-up errors
    if cfg.type == "ui_trainer":
        errors = _ui_defaults_as_warnings(cfg, errors)
    if errors:
        raise ConfigError(_format(source, errors))
    return cfg


FP8_NAMES = ("fp8", "float8", "qfloat8", "float8_e4m3fn", "e4m3")

# ai-toolkit's sample items (its UI writes `samples: [{prompt: ...}]` for `prompts`): each field as its prompt flag
_SAMPLE_FLAGS = {"width": "--w", "height": "--h", "seed": "--seed", "neg": "--n", "guidance_scale": "--cfg",
                 "sample_steps": "--s", "network_multiplier": "--m", "ctrl_img": "--ctrl_img"}


def _samples_as_prompts(sample, where, errors):
    """ai-toolkit's `sample.samples` ([{prompt, width, height, seed, neg, ...}]) as `sample.prompts` strings with the
    prompt flags that say the same (prompt_options.py); an item field without one is an error naming it."""
    items, out = sample["samples"], dict(sample)
    del out["samples"]
    if "prompts" in sample:
        errors.append(f"{where}.samples: given together with {where}.prompts; use one")
        return out
    if not isinstance(items, list):
        errors.append(f"{where}.samples: expected a list of {{prompt: ...}} items, got {items!r}")
        return out
    prompts = []
    for i, item in enumerate(items):
        at = f"{where}.samples[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            errors.append(f"{at}: expected a mapping with a prompt string, got {item!r}")
            continue
        text = item["prompt"]
        for k, v in item.items():
            if k in ("prompt", "fps") or v is None or v == "" or (k, v) in (("num_frames", 1), ("ctrl_idx", 0)):
                continue   # (a video's rate; an image's frame count; control image 0: the only one)
            if k not in _SAMPLE_FLAGS:
                errors.append(f"{at}.{k}: not available in a sample item (FLAME's prompt flags take "
                              f"{', '.join(_SAMPLE_FLAGS)})")
                continue
            text += f" {_SAMPLE_FLAGS[k]} {v}"
        prompts.append(text)
    out["prompts"] = prompts
    return out


# what ai-toolkit's UI writes into every job although it does nothing there for this model or network: with
# type ui_trainer these are warnings, not errors ((field, the start of validation's message))
_UI_DEFAULTS = (("network.lokr_factor", "only used by network type"),
                ("network.lokr_full_rank", "only used by network type"),
                ("network.conv", "model has no convolutions to adapt"),   # (LoCon's rank on a transformer)
                ("save.save_format", "diffusers writes a full fine-tune's model"),
                ("train.timestep_type", "not available: SDXL trains"),   # (its section hidden for SDXL)
                (".mask_min_value", "but the dataset has no masks"),     # (any dataset's)
                ("train.diff_output_preservation_multiplier", "only used with train.diff_output_preservation"),
                ("train.diff_output_preservation_class", "only used with train.diff_output_preservation"))


def _ui_defaults_as_warnings(cfg, errors):
    """`errors` without those about ai-toolkit UI defaults that do nothing here (_UI_DEFAULTS), which go to
    cfg.warnings; each such setting is put back to its default (what the run then does, and what later checks of
    the same setting -- the datasets' when they are built -- see)."""
    keep = []
    for e in errors:
        field, _, msg = e.partition(": ")
        if any(field.endswith(f) and words in msg for f, words in _UI_DEFAULTS):
            cfg.warnings.append(f"{field}: not used (ai-toolkit's UI writes it into every job): {msg}")
            _reset(cfg, _rel(field))
        else:
            keep.append(e)
    return keep


def _reset(cfg, dotted):
    """The field at `dotted` ("network.conv", "datasets[0].mask_min_value") set back to its dataclass default."""
    *parents, last = dotted.split(".")
    obj = cfg
    for part in parents:
        name, _, index = part.partition("[")
        obj = getattr(obj, name)
        if index:
            obj = obj[int(index.rstrip("]"))]
    default = next(f for f in fields(obj) if f.name == last)
    setattr(obj, last, default.default if default.default is not MISSING else default.default_factory())
# the adapters' settings network_kwargs may carry (ai-toolkit passes them there; kohya's network_args names)
_NETWORK_KWARGS_FIELDS = ("rank_dropout", "module_dropout")


def _clean_network_kwargs(cfg, p, errors):
    """network.network_kwargs' rank_dropout / module_dropout moved into network's own fields (given in both places
    with different values: an error)."""
    n = cfg.network
    if not isinstance(n.network_kwargs, dict):
        return
    for k in _NETWORK_KWARGS_FIELDS:
        if k not in n.network_kwargs:
            continue
        v = n.network_kwargs.pop(k)
        if f"network.{k}" in cfg.given and getattr(n, k) != v:
            errors.append(f"{p}network.network_kwargs.{k}: {v!r} differs from {p}network.{k} {getattr(n, k)!r}; "
                          f"give one")
        elif not _is_number(v):
            errors.append(f"{p}network.network_kwargs.{k}: a number in [0, 1), got {v!r}")
        else:
            setattr(n, k, float(v))
            cfg.given = cfg.given | {f"network.{k}"}


def _clean_quantize(cfg, p, errors):
    """model.quantize to a bool: true / false, or a name of fp8 storage (ai-toolkit writes quantize: true with
    qtype: qfloat8; 'fp8' says the same in one key); train.fp8_compute needs it."""
    q = cfg.model.quantize
    if isinstance(q, str) and q.lower() in FP8_NAMES:
        cfg.model.quantize = True
    elif not isinstance(q, bool):
        errors.append(f"{p}model.quantize: true, false or 'fp8' (FLAME stores frozen weights in fp8 e4m3), got {q!r}")
        cfg.model.quantize = False
    for key in ("qtype", "qtype_te"):
        qt = getattr(cfg.model, key)
        if qt is not None and (not isinstance(qt, str) or qt.lower() not in FP8_NAMES):
            errors.append(f"{p}model.{key}: FLAME quantises the frozen weights to fp8 (e4m3) only: qfloat8, float8 or "
                          f"fp8, got {qt!r}")
    if cfg.train.fp8_compute and not cfg.model.quantize:
        errors.append(f"{p}train.fp8_compute: computes with the fp8 weights of model.quantize; set model.quantize: "
                      f"fp8 too")
    from .quantize_kwargs import config_problems
    errors += config_problems(cfg, p)
    cs = cfg.train.checkpoint_save
    if cs not in ("none", "attention"):
        errors.append(f"{p}train.checkpoint_save: 'none' or 'attention', got {cs!r}")
    elif cs != "none" and not cfg.train.gradient_checkpointing:
        errors.append(f"{p}train.checkpoint_save: {cs!r} is what checkpointed blocks keep; set "
                      f"train.gradient_checkpointing: true too (or checkpoint_save: none)")
    sc = cfg.train.fp8_scaling
    if sc not in ("current", "delayed"):
        errors.append(f"{p}train.fp8_scaling: 'current' or 'delayed', got {sc!r}")
    elif sc == "delayed" and not cfg.train.fp8_compute:
        errors.append(f"{p}train.fp8_scaling: 'delayed' scales the activations of fp8 compute; set "
                      f"train.fp8_compute: true (and model.quantize: fp8) too")
    ct = cfg.train.fp8_cache_transposes
    if isinstance(ct, str) and ct.lower() in ("auto", "true", "false"):
        ct = cfg.train.fp8_cache_transposes = {"auto": "auto", "true": True, "false": False}[ct.lower()]
    if ct != "auto" and not isinstance(ct, bool):
        errors.append(f"{p}train.fp8_cache_transposes: 'auto', true or false, got {ct!r}")
    elif ct is True and not cfg.train.fp8_compute:
        errors.append(f"{p}train.fp8_cache_transposes: true keeps the transposed fp8 weights of fp8 compute; set "
                      f"train.fp8_compute: true (and model.quantize: fp8) too")


def fp8_cache_transposes_on(train, budget):
    """Whether the trainer keeps the fp8-compute weights' transposes resident (train.fp8_cache_transposes): true
    or false as given; auto: with fp8 compute and no max_gpu_memory (`budget` None: no block is streamed, and no
    budget has to hold the weights' size again) -- and on a GPU the trainer then also asks that they take at most
    half of the device's free memory."""
    ct = train.fp8_cache_transposes
    if ct == "auto":
        return bool(train.fp8_compute) and budget is None
    return bool(ct) and bool(train.fp8_compute)


def _resolve_family(cfg, p, errors):
    """ai-toolkit's family flags and v-prediction flag, then the family's defaults for the fields the input left
    out (family.ModelFamily.apply_defaults)."""
    from .. import registry
    from .family import get_family
    arch_flags = registry.toolkit_flags()  # {"is_flux": "flux", "is_v3": "sd3", "is_xl": "sdxl"}
    m, given = cfg.model, cfg.given
    flags = {k: getattr(m, k, None) for k in arch_flags if getattr(m, k, None) is not None}
    if "model.arch" not in given:
        chosen = [arch_flags[k] for k, v in flags.items() if v]
        if len(chosen) > 1:
            errors.append(f"{p}model: {' and '.join(k for k, v in flags.items() if v)} are all true; one model "
                          f"family (or give model.arch)")
        elif chosen:
            m.arch = chosen[0]
    for k, v in flags.items():
        family = arch_flags[k]
        # a family refining the flag's (flux_kontext, chroma: Flux-derived) takes it either way, as ai-toolkit does
        # with arch given (a Flux config's is_flux: true beside arch: flux_kontext)
        derived = m.arch in registry.FAMILIES and registry.about(m.arch).refines == family
        if not derived and v != (m.arch == family):
            errors.append(f"{p}model.{k}: {str(v).lower()} contradicts model.arch {m.arch!r}")
    if m.is_v_pred is not None:
        want = "v_prediction" if m.is_v_pred else "epsilon"
        if "train.prediction_type" not in given:
            cfg.train.prediction_type = want
        elif cfg.train.prediction_type != want:
            errors.append(f"{p}model.is_v_pred: {str(m.is_v_pred).lower()} contradicts train.prediction_type "
                          f"{cfg.train.prediction_type!r}")
    try:
        family = get_family(m.arch)
    except ValueError:
        return  # validate names the arch
    family.apply_defaults(cfg)


def load_config(path, check_files=True):
    """Read and validate a YAML training config."""
    return config_from_dict(read_yaml(path), path, check_files)


def read_yaml(path):
    """The mapping of a YAML file, or a ConfigError naming the file."""
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
    return data


def config_dict(cfg):
    """The config as plain data (what config.json and checkpoints hold): no notes, no bookkeeping."""
    from dataclasses import asdict
    d = asdict(cfg)
    for k in _INTERNAL:
        d.pop(k, None)
    return d


def dtype_name(name):
    """'bf16' -> 'bfloat16' etc. (a flame dtype name)."""
    return DTYPES[name]
