"""Model families: everything the trainer needs to know about one kind of diffusion model, and their registry.

The training loop (trainer.py), its checkpoints, exact resume, samples, logging and progress know no architecture.
A `ModelFamily` supplies what differs between models; `get_family(cfg.model.arch)` finds it. Flux is the first
family (families/flux.py); SD3.5 and SDXL plug in by subclassing and registering, without touching the loop.

What the loop calls, and when
-----------------------------
Before anything is loaded (config.validate: every problem is reported together, with its field path):
    config_problems(cfg, prefix)        family-specific config checks (noise scheduler, timestep type, sampler,
                                        size preset); returns a list of messages
    describe_model(model_cfg)           the model's spec (family-defined; Flux: FluxParams) read from the file's
                                        headers or the size preset, without reading a weight. A file that is not
                                        this family's model raises ModelFileError with one line saying what the
                                        file looks like (model_files.describe_file)
    spec_problems(cfg, spec, prefix)    checks that need the spec (e.g. guidance given for a model without it)
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
Building (Trainer.setup, after the data has been checked and cached):
    build_model(model_cfg, spec, dtype, device, stream=False)   the frozen model (loaded key by key, or a random
                                        preset); stream: its blocks will stream from host memory (load it there;
                                        a random model may leave its blocks empty for block_initializer)
    block_initializer(model)            None, or prepare(block) that fills a block left empty (BlockStreamer)
    spec_of(model)                      the spec of a model handed to the Trainer ready-made
    block_stacks(model)                 names of the ModuleLists of blocks (block streaming, fp8 storage)
    target_presets / default_target     adapter target presets (network.target)
    lora_name_map(model)                flame_nn.adapters NameMap: the model's Linear names <-> diffusers names
    lora_metadata(cfg, model)           safetensors metadata of the written LoRA file (architecture, base model)
Each micro-batch:
    objective(train_cfg)                (once) the Objective (objective.py): timestep sampling, noising, target, loss
    training_inputs(model, batch, device, train_cfg) -> (x0, cond)
                                        outside any CUDA-graph capture: host arrays copied in. x0: the clean latents
                                        in the layout the model predicts in (the noise is drawn in that shape);
                                        cond: a dict of tensors (ordered, fixed shapes for a fixed batch shape)
    image_seq_len(x0)                   tokens per sample, for resolution-dependent timestep shifts
    forward(model, x_t, t, cond)        the prediction, in x0's layout. Runs inside the captured region: no host
                                        synchronisation and no random draws
Previews (sample_every steps, the progress clock paused):
    sample(model, cond, height=, width=, steps=, guidance=, seed=, device=, callback=)
                                        latents (B, latent_channels, h, w) in the normalised latent space the model
                                        trains on; callback(i, n) after each denoising step (the progress bar)

Attributes: name (= model.arch), latent_channels, vae_scale_factor (pixels per latent), pixel_multiple (image
sides must be multiples of it), latent_scale / latent_shift (x0 = (z - shift) * scale for a VAE posterior z),
noise_schedulers (accepted train.noise_scheduler values), samplers (accepted sample.sampler values), default_size
and model_sizes (random-init presets).

How the next families fit
-------------------------
SD3.5 (MMDiT, flow matching): the same FlowMatching objective (logit_normal timesteps are SD3's default), 16 latent
    channels, latent_scale 1.5305 / shift 0.0609, no packing: x0 is the (B, 16, h, w) latent itself and
    image_seq_len is (h/2)(w/2) patches; cond = {prompt_embeds (CLIP-L+G penultimate states ++ T5, 333+ tokens),
    pooled_prompt_embeds (2048)}; forward passes timestep = 1000·σ as the model expects.
SDXL (UNet, epsilon or v-prediction): an Objective with a DDPM schedule (scaled-linear betas, 1000 steps) whose
    sample_timesteps returns integer t as floats, noisy = sqrt(ᾱ_t)·x0 + sqrt(1−ᾱ_t)·ε, target ε or
    v = sqrt(ᾱ_t)·ε − sqrt(1−ᾱ_t)·x0 (noise_schedulers ("ddpm",)); 4 latent channels, latent_scale 0.13025;
    sample_keys adds "original_size", "crop_coords", "target_size" (the dataset keeps them), from which
    training_inputs builds the added time ids of cond next to the two text encoders' states and pooled output.

SD3.5 and SDXL add their VAE latent format (flame_models.vae.SD3 / SDXL) in encode_images / decode, and CLIP-L+G
(+T5) in load_text_encoders / encode_prompts; a family without a VAE or text encoders leaves those methods out and
trains from precomputed samples only (parts_problems then says so).
"""
import importlib

from flame_core.errors import FlameError


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

    def config_problems(self, cfg, prefix=""):
        return []

    def spec_problems(self, cfg, spec, prefix=""):
        return []

    def parts_problems(self, cfg, *, vae, text, prefix=""):
        return [f"{prefix}datasets: the {self.name} family trains from precomputed samples only (it has no VAE or "
                f"text encoders to cache image folders or encode prompts)"]

    def block_initializer(self, model):
        return None

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


# arch -> "module:Class", imported when first asked for: the registry itself imports no model code
_REGISTRY = {"flux": "flame_models.training.families.flux:FluxFamily"}
_LOADED = {}


def register_family(arch, family):
    """Make `family` (a ModelFamily instance, or "module:Class") the one `get_family(arch)` returns."""
    _REGISTRY[arch] = family
    _LOADED.pop(arch, None)


def available_families():
    return sorted(_REGISTRY)


def get_family(arch):
    """The ModelFamily for a `model.arch` value ('flux'); a ValueError naming the known ones otherwise."""
    if arch in _LOADED:
        return _LOADED[arch]
    entry = _REGISTRY.get(arch)
    if entry is None:
        raise ValueError(f"unknown model arch {arch!r}; available: {', '.join(available_families())}")
    if isinstance(entry, str):
        module, cls = entry.split(":")
        entry = getattr(importlib.import_module(module), cls)()
    _LOADED[arch] = entry
    return entry
