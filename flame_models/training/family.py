"""Model families: everything the trainer needs to know about one kind of diffusion model, and their registry.

The training loop (trainer.py), its checkpoints, exact resume, samples, logging and progress know no architecture.
A `ModelFamily` supplies what differs between models; `get_family(cfg.model.arch)` finds it. Flux is the first
family (flame_models/flux/family.py); SD3 / SD3.5 (sd3/family.py) and SDXL (sdxl/family.py) plug in the same way,
each named by flame_models/registry.py.

What the loop calls, and when
-----------------------------
While the config is read (config.config_from_dict, before any check):
    apply_defaults(cfg)                 the family's defaults (`config_defaults`, e.g. {"train.timestep_type":
                                        "logit_normal"}) for the fields the input left out (cfg.given)
Before anything is loaded (config.validate: every problem is reported together, with its field path):
    fields                              which of FAMILY_FIELDS (objective, preview and part settings that only some
                                        families read) this one reads; another one given with a value that asks
                                        for something is an error ("not available: " + field_notes.get(field))
    config_problems(cfg, prefix)        family-specific config checks (noise scheduler, timestep type, sampler,
                                        size preset); returns a list of messages
    describe_model(model_cfg)           the model's spec (family-defined; Flux: FluxParams) read from the file's
                                        headers or the size preset, without reading a weight. A file that is not
                                        this family's model raises ModelFileError with one line saying what the
                                        file looks like (model_files.describe_file)
    spec_problems(cfg, spec, prefix)    checks that need the spec (e.g. guidance given for a model without it; the
                                        adapter targets against the model's module names: target_problems)
    sample_keys                         the arrays of one precomputed sample: "latents" first, then the
                                        conditioning the model needs (Flux: prompt_embeds, pooled_prompt_embeds)
    check_sample(shapes, spec)          None, or what is wrong with one sample file's tensor shapes
    synthetic_conditioning(spec, text_length)  {key: shape} the synthetic dataset makes per sample
    parts_problems(cfg, vae=, text=, prefix=)   (check_files) what is wrong with the other parts the run needs --
                                        the VAE (vae) and the text encoders and tokenizers (text) -- from headers
                                        and tokenizer files only; a list of messages
Image folders and text prompts (Trainer.setup, after every image and caption was checked; image_data.py), each
stage loading its model, running it and freeing it before the next:
    vae_id(model_cfg, device)           a string naming what the VAE produces (files, sizes, mtimes, dtype): the
                                        latent cache's key, so a changed VAE re-encodes
    load_vae(model_cfg, device)         the VAE (an AutoencoderKL: .to(), enable_tiling(), parameters())
    encode_images(vae, pixels)          (B, 3, H, W) float32 in [-1, 1] -> (B, latent_channels, H/f, W/f) float32
                                        latents as the model trains on them (scale and shift applied)
    decode(vae, latents)                the inverse for previews: latents -> (B, 3, H, W) float32 in [-1, 1]
    text_encoder_id(model_cfg, device, budget)   as vae_id, for the text-embedding cache
    describe_text_encoders(model_cfg, device, budget)   one line for the log (e.g. how T5 is stored)
    load_text_encoders(model_cfg, device, budget)   an object with .free(); budget: max_gpu_memory in bytes or None
                                        (Flux: T5 in fp8 and/or streamed when it asks for that)
    encode_prompts(encoders, prompts)   {key: (B, ...) float32} for sample_keys[1:] (padded to one length)
    attended_text_length(prompt_mask)   the leading text tokens of one cached caption some attention sees (the rest
                                        masked from every query), or None; the run's batches are cut to the longest
                                        (data/text_trim.py: Chroma's T5, Qwen-Image's padding)
    negative_prompt(cfg)                the text encoded as the previews' negative prompt (CFG), or None (none, or
                                        the family's own unconditional input); its arrays join each preview
                                        prompt's conditioning as "negative_<key>"
Building (Trainer.setup, after the data has been checked and cached):
    build_model(model_cfg, spec, dtype, device, stream=False)   the frozen model (loaded key by key, or a random
                                        preset); stream: its blocks will stream from host memory (load it there;
                                        a random model may leave its blocks empty for block_initializer)
    block_initializer(model)            None, or prepare(block) that fills a block left empty (BlockStreamer)
    spec_of(model)                      the spec of a model handed to the Trainer ready-made
    block_stacks(model)                 names of the ModuleLists of blocks (block streaming, fp8 storage)
    target_presets / default_target     adapter target presets (network.target)
    conv_targets / conv_linear_targets  network.conv (LoCon): the convolutions that get the conv rank, and what else
                                        comes with them at the linear rank; None: the model has no convolutions
    lora_name_map(model)                flame_nn.adapters NameMap: the model's Linear names <-> diffusers names
    lora_metadata(cfg, model)           safetensors metadata of the written LoRA file (architecture, base model)
Trained text encoders (train.train_text_encoder; sdxl/family.py; text_training.py holds them for the trainer):
    text_encoder_targets                the patterns of the text encoders' Linears that get adapters (kohya's
                                        CLIPAttention / CLIPMLP set); None: the family cannot train them
    trainable_text_encoders(encoders)   [(component, encoder)] of load_text_encoders' object: 'te1' / 'te2', the
                                        LoRA files' names for them (flame_nn.adapters.formats.load's component)
    takes_text_loras                    whether a LoRA file's text-encoder part applies to its encoders
                                        (model.lora_path's: base_loras.py); then:
    text_lora_parts(encoders)           [(component or tuple of components, encoder)] of load_text_encoders' object
                                        that the part applies to ('te1', 'te2', 'te3'; Flux's T5 is kohya's te3 and
                                        diffusers' te2)
    streamed_text_components(model_cfg, device, budget)   the components whose encoder streams from host memory
                                        under the budget (Flux's and SD3's T5): a LoRA part for it is refused
    caption_tokens(encoders, captions)  {key: (N, ...) int64} token ids per caption (tokenised once, kept per
                                        sample; training_inputs then finds them in the batch instead of embeddings)
    encode_training_text(encoders, cond)   cond with the token-id entries replaced by the conditioning the model
                                        takes, encoded with autograd; inside the captured region
Each micro-batch:
    objective(train_cfg)                (once) the Objective (objective.py: flow matching; ddpm_objective.py: ε / v
                                        prediction): sample_timesteps and sample_noise (outside the captured
                                        region), noisy, target, loss(pred, target, t) (weights may depend on t)
    training_inputs(model, batch, device, train_cfg) -> (x0, cond)
                                        outside any CUDA-graph capture: host arrays copied in. x0: the clean latents
                                        in the layout the model predicts in (the noise is drawn in that shape);
                                        cond: a dict of tensors (ordered, fixed shapes for a fixed batch shape).
                                        `batch` holds the sample_keys arrays (B, ...) and, from image folders, each
                                        sample's "original_size" (h, w), "crop_coords" (top, left) and
                                        "target_size" (h, w) as (B, 2) int64 (SDXL's size conditioning), and
                                        "control_latents" (B, C, h, w) when the datasets have control_path
                                        images (only families with control_images = True: Flux Kontext)
    image_seq_len(x0)                   tokens per sample, for resolution-dependent timestep shifts
    loss_mask(mask, x0)                 a batch's loss masks (B, 1, h, w) float32 on the latent grid (datasets'
                                        mask_path) as a tensor that broadcasts against x0 in its layout (default:
                                        as is, for (B, C, h, w) latents; Flux, Chroma, Qwen-Image pack it as theirs)
    forward(model, x_t, t, cond)        the prediction, in x0's layout. Runs inside the captured region: no host
                                        synchronisation and no random draws
Previews (sample_every steps, the progress clock paused):
    sample(model, cond, height=, width=, steps=, guidance=, seed=, device=, callback=)
                                        latents (B, latent_channels, h, w) in the normalised latent space the model
                                        trains on; callback(i, n) after each denoising step (the progress bar);
                                        cond: the sample_keys[1:] arrays of one prompt, and "negative_<key>" ones
                                        when negative_prompt gave a text
    sample_options(cfg)                 (once per preview step) extra keyword arguments for sample from the config
                                        (SD3: skip-layer guidance; SDXL: the sampler, the prediction type)

Attributes: name (= model.arch), latent_channels, vae_scale_factor (pixels per latent), pixel_multiple (image
sides must be multiples of it), latent_scale / latent_shift (x0 = (z - shift) * scale for a VAE posterior z),
noise_schedulers (accepted train.noise_scheduler values), samplers (accepted sample.sampler values), default_size
and model_sizes (random-init presets).

The families
------------
The three below share one implementation (family_base.py: DiffusionFamily, and FlowMatchingFamily for Flux and SD3):
each states what differs -- its model class and words for it, its parts and pipeline modules, its spec's
conditioning widths, its noise schedulers and samplers -- and overrides only what its model does otherwise.
Flux (flux/family.py): rectified flow on 2x2-packed 16-channel latents, T5 states + CLIP-L pooled, a guidance
    embedding for flux-dev.
SD3 / SD3.5 (sd3/family.py): the same FlowMatching objective (logit_normal timesteps by default, SD3's loss
    weightings), 16 unpacked latent channels, latent_scale 1.5305 / shift 0.0609; cond = context (CLIP-L + CLIP-G
    penultimate states ++ T5) and y (pooled, 2048); forward passes timestep = 1000·σ; previews with CFG.
SDXL (sdxl/family.py): the DDPM objective (ε or v, zero-terminal SNR, min-SNR-γ, a timestep range), 4 latent
    channels, latent_scale 0.13025; cond = context (77 × 2048) and y (CLIP-G pooled ‖ the size embeddings of the
    batch's original_size, crop_coords, target_size); previews with its samplers and CFG.
A family without a VAE or text encoders leaves those methods out and trains from precomputed samples only
(parts_problems then says so).
"""
import importlib

from flame_core.errors import FlameError

from .objective import DENSITY_SCHEMES

# settings that only some families read (the others refuse them when given: ModelFamily.fields)
FLOW_FIELDS = ("train.timestep_type", "train.shift", "train.sigmoid_scale", "train.logit_mean", "train.logit_std",
               "train.mode_scale", "train.weighting_scheme")
DDPM_FIELDS = ("train.prediction_type", "train.zero_terminal_snr", "train.min_snr_gamma", "train.min_timestep",
               "train.max_timestep", "model.is_v_pred")
FAMILY_FIELDS = FLOW_FIELDS + DDPM_FIELDS + (
    "train.guidance", "sample.neg", "sample.slg_scale", "sample.slg_layers", "model.clip_g_path", "model.t5_path",
    "model.t5_max_length", "model.quantize_te", "model.use_t5", "sample.true_cfg", "sample.true_cfg_start",
    "sample.guidance_rescale", "train.guidance_range")


class ModelFileError(FlameError, ValueError):
    """A model file or folder that is not the family's model (the message says what it looks like)."""


class ModelFamily:
    """The base of every family: see the module docstring for what each member means and when it is called."""
    name = None
    latent_channels = None
    vae_scale_factor = 8
    pixel_multiple = 16
    latent_scale, latent_shift = 1.0, 0.0
    noise_schedulers = ()
    samplers = ()
    default_size = None
    model_sizes = ()
    sample_keys = ("latents",)
    target_presets = {}
    default_target = None
    conv_targets = None
    conv_linear_targets = ()
    text_encoder_targets = None
    takes_text_loras = False
    control_images = False        # whether it trains on datasets' control_path images ("control_latents")
    takes_negative_prompt = False  # whether its previews run CFG against a negative prompt (negative_prompt; a
                                   # sample prompt's --n)
    true_cfg = False  # whether a guidance-distilled family's previews may run true CFG against one instead
                      # (sample.true_cfg, a prompt's --l beside --g: Flux)
    config_defaults = {}
    fields = ()
    field_notes = {}

    def apply_defaults(self, cfg):
        """Set `config_defaults` for the fields the input left out; a weighting scheme that names a timestep
        density (diffusers' and kohya's logit_normal / mode) makes train.timestep_type the same when that is not
        given either."""
        for path, value in self.config_defaults.items():
            if path not in cfg.given:
                section, _, name = path.rpartition(".")
                setattr(getattr(cfg, section) if section else cfg, name, value)
        t = cfg.train
        if "train.timestep_type" in self.fields and "train.timestep_type" not in cfg.given \
                and t.weighting_scheme in DENSITY_SCHEMES:
            t.timestep_type = t.weighting_scheme

    def config_problems(self, cfg, prefix=""):
        return []

    def spec_problems(self, cfg, spec, prefix=""):
        return []

    def loss_mask(self, mask, x0):
        import numpy as np

        import flame_core as flame
        return flame.tensor(np.ascontiguousarray(mask, dtype=np.float32), device=x0.device)

    def image_size_limit(self, spec):
        """(the largest image side in pixels the model of `spec` takes, what sets it), or None: no limit."""

    def parts_problems(self, cfg, *, vae, text, prefix=""):
        return [f"{prefix}datasets: the {self.name} family trains from precomputed samples only (it has no VAE or "
                f"text encoders to cache image folders or encode prompts)"]

    def negative_prompt(self, cfg):
        return None

    def text_lora_parts(self, encoders):
        return None

    def streamed_text_components(self, model_cfg, device, budget):
        return ()

    def sample_options(self, cfg):
        return {}

    # save_model(model, path, dtype, metadata=None, base=None, layout="native", tokenizer=None): what a full
    # fine-tune (network.type full) writes -- the denoiser in the family's native checkpoint layout, its floating
    # weights in `dtype`, `metadata` among the file's; `base` the run's model.name_or_path (SDXL copies an SAI file's
    # other parts beside its UNet; the other families write the denoiser alone: their released files hold it alone,
    # or FLAME does not write their other parts yet). layout "diffusers" (save.save_format): `path` is a folder, the
    # denoiser in its diffusers subfolder, with a diffusers base's other components (checkpoint_io.
    # write_pipeline_folder; SDXL converts an SAI file's, with the tokenizers of `tokenizer`, the run's
    # model.tokenizer_path). None: the family cannot write its model (full fine-tuning is refused)
    save_model = None

    def block_initializer(self, model):
        return None

    def target_problems(self, probe, cfg, name_map=None, prefix=""):
        """What is wrong with network.target for the model `probe` (built under flame_nn.empty_init: names and
        shapes, no weights): each pattern that selects no Linear or Conv2d, convolutions selected for DoRA / LoKr /
        LoHa (a convolution takes LoRA only), and row ranges of fused Linears (diffusers' to_q in a fused qkv) for
        LoKr / LoHa, which adapt whole Linears only."""
        import flame_nn
        from flame_nn.adapters import find_targets
        n = cfg.network
        targets = self.target_presets.get(n.target, n.target) if isinstance(n.target, str) else n.target
        if targets is None:
            return []
        kw = n.network_kwargs
        e, split = [], []
        for pattern in [targets] if isinstance(targets, str) else list(targets):
            found = find_targets(probe, [pattern], name_map, kw.get("only_if_contains"), kw.get("ignore_if_contains"))
            split += [(pattern, name) for name, _, rows in found if rows is not None][:1]
            convs = [name for name, m, _ in found if isinstance(m, flame_nn.Conv2d)]
            if convs and n.type not in ("lora", "locon"):
                e.append(f"{prefix}network.target: {pattern!r} selects convolutions ({', '.join(convs[:3])}"
                         f"{', ...' if len(convs) > 3 else ''}), which {n.type} cannot adapt (convolutions take "
                         f"LoRA / LoCon only)")
            if not found:
                e.append(f"{prefix}network.target: {pattern!r} selects no Linear or Conv2d of this {self.name} model"
                         + (" with network.network_kwargs' filters" if kw else ""))
        if split and n.type in ("lokr", "loha"):
            what = repr(n.target) if isinstance(n.target, str) else ", ".join(repr(p) for p, _ in split)
            e.append(f"{prefix}network.target: {what} selects row ranges of fused Linears (e.g. {split[0][1]}), which "
                     f"{n.type} cannot adapt (its ΔW does not split by rows); target whole Linears (e.g. the "
                     f"all_linear preset) or use lora / dora")
        return e

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


# families registered here (register_family: a toy model in a test, a family outside flame_models), over the
# registry's (flame_models/registry.py); each imported when first asked for
_REGISTERED = {}
_LOADED = {}


def register_family(arch, family):
    """Make `family` (a ModelFamily instance, or "module:Class") the one `get_family(arch)` returns."""
    _REGISTERED[arch] = family
    _LOADED.pop(arch, None)


def available_families():
    from .. import registry
    return sorted({*registry.names(), *_REGISTERED})


def get_family(arch):
    """The ModelFamily for a `model.arch` value ('flux', 'sd3', 'sdxl', or one registered here); a ValueError
    naming the known ones otherwise."""
    from .. import registry
    if arch in _LOADED:
        return _LOADED[arch]
    entry = _REGISTERED.get(arch)
    if entry is None and arch in registry.names():
        entry = registry.trainer_class(arch)()
    if entry is None:
        raise ValueError(f"unknown model arch {arch!r}; available: {', '.join(available_families())}")
    if isinstance(entry, str):
        module, cls = entry.split(":")
        entry = getattr(importlib.import_module(module), cls)()
    _LOADED[arch] = entry
    return entry
