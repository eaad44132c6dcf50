"""What the built-in families (flux/family.py, sd3/family.py, sdxl/family.py) share, written once: each family
states what differs in class attributes (the model's class and words for it, its parts and pipeline modules, the
spec's conditioning widths, the accepted noise schedulers and samplers) and a few small methods (the size preset,
reading a file's spec, loading the model), and overrides a member only where its model really works otherwise.

DiffusionFamily: the config's noise scheduler and size preset, the model file's kind and spec, sample shapes, the
frozen model (loaded, or random: drawn on the GPU, its streamed blocks left empty for block_initializer), spec_of,
and the VAE / text-encoder stages through `parts` (a module with problems, vae_id, load_vae, text_id, describe,
load_text_encoders_for) and `pipeline` (encode_images, decode_latents).
FlowMatchingFamily: rectified flow (Flux, SD3): the FlowMatching objective, its timestep types and the flow-matching
Euler sampler for previews.
"""
import os

import numpy as np

import flame_core as flame
import flame_nn

from .. import registry
from ..conditioning.files import ModelFilesError
from ..samplers.flow_schedules import FLOW_SCHEDULERS
from ..text_encoders import is_structure_only
from . import base_loras
from .family import ModelFamily, ModelFileError
from .family_parts import RANDOM_SEED
from .loss_types import ElementLoss
from .objective import FlowMatching
from .random_init import init_random_
from .timesteps import TIMESTEP_TYPES
from .validation import choice


class DiffusionFamily(ModelFamily):
    """A family of a diffusion model with a VAE and text encoders (see the module docstring)."""
    label = None                   # the model's name in messages ("SD3")
    model_words = None             # what a file of the model is ("an SD3 / SD3.5 MMDiT")
    model_class = None             # the trained model's class (spec_of)
    spec_attr = "params"           # the model's attribute holding its spec
    model_noun = "model"           # check_sample's "for this <noun>"
    # the spec's widths of prompt_embeds and pooled_prompt_embeds (pooled None where sample_keys end in prompt_mask:
    # a masked-text family, Chroma and Qwen-Image)
    cond_dims = ("context_in_dim", "pooled_in_dim")
    scheduler_words = None         # config_problems' "<label> trains with <scheduler_words>"
    parts = None                   # the module of the VAE and text encoders (sd3/family_parts.py)
    pipeline = None                # the module with encode_images / decode_latents (flame_models.sd3.pipeline)
    vae_scale_factor = 8
    sample_keys = ("latents", "prompt_embeds", "pooled_prompt_embeds")
    default_target = "attention"

    # ------------------------------------------------------------------ what each family states
    def preset(self, size):
        """The spec of a size preset (model.size)."""
        raise NotImplementedError

    def read_spec(self, path):
        """The spec from a model file's headers (it is this family's model)."""
        raise NotImplementedError

    spec_errors = (KeyError, ValueError, OSError)  # what read_spec raises for a file it cannot describe

    def load_model(self, path, spec, dtype, device):
        """The frozen model loaded key by key from `path`."""
        raise NotImplementedError

    def _config_problems(self, cfg, prefix):
        """The family's own config checks, between the noise scheduler's and the size preset's."""
        return []

    # ------------------------------------------------------------------ before anything is loaded
    def config_problems(self, cfg, prefix=""):
        e, t, p = [], cfg.train, prefix
        if t.noise_scheduler not in self.noise_schedulers:
            e.append(f"{p}train.noise_scheduler: {self.label} trains with {self.scheduler_words}, got "
                     f"{t.noise_scheduler!r}")
        e += self._config_problems(cfg, prefix)
        if cfg.model.name_or_path is None and cfg.model.size is not None:
            choice(e, f"{p}model.size", cfg.model.size, self.model_sizes)
        return e

    def describe_model(self, model_cfg):
        """The spec from the checkpoint's headers (or the size preset); ModelFileError when the file or folder is not
        this family's model, saying what it looks like."""
        path = model_cfg.name_or_path
        if path is None:
            return self.preset(model_cfg.size or self.default_size)
        self.check_model_file(path)
        try:
            return self.read_spec(path)
        except self.spec_errors as e:
            raise ModelFileError(f"{path}: {first_line(e)}") from None

    def check_model_file(self, path):
        """ModelFileError with one line when `path` is not this family's model (what its files look like, and the
        model.arch that trains them)."""
        try:
            family, words = registry.detect_family(path, error=ModelFileError, default="other")
        except ModelFilesError as e:
            raise ModelFileError(first_line(e)) from None
        if family != self.name:
            raise ModelFileError(f"{path} is not {self.model_words}: it looks like {words}"
                                 + (f" (model.arch: {family} trains it)" if family in registry.names() else ""))

    def latent_multiple(self, spec):
        """What the latents' sides must be multiples of (2: 2x2 patches or packing)."""
        return 2

    def check_sample(self, shapes, spec):
        """None, or what is wrong with one sample's tensor shapes (keys absent from `shapes` are not checked)."""
        f = self.latent_multiple(spec)
        ctx_name, pooled_name = self.cond_dims
        ctx = getattr(spec, ctx_name) if spec is not None else None
        lat, txt, third = (shapes.get(k) for k in self.sample_keys)
        if lat is not None and (len(lat) != 3 or lat[0] != self.latent_channels or lat[1] % f or lat[2] % f):
            sides = "even h and w" if f == 2 else f"h and w multiples of {f}"
            return f"latents {lat}: expected ({self.latent_channels}, h, w) with {sides}"
        if txt is not None and (len(txt) != 2 or (ctx is not None and txt[1] != ctx)):
            return f"prompt_embeds {txt}: expected (L, {ctx or ctx_name}) for this {self.model_noun}"
        if self.sample_keys[2] == "prompt_mask":  # a masked-text family (Chroma, Qwen-Image): no pooled vector
            if third is not None and (len(third) != 1 or (txt is not None and third[0] != txt[0])):
                return f"prompt_mask {third}: expected (L,), one entry per prompt_embeds token"
            return None
        pooled, pooled_dim = third, getattr(spec, pooled_name) if spec is not None else None
        if pooled is not None and (len(pooled) != 1 or (pooled_dim is not None and pooled[0] != pooled_dim)):
            return f"pooled_prompt_embeds {pooled}: expected ({pooled_dim or pooled_name},) for this {self.model_noun}"
        return None

    def attended_text_length(self, prompt_mask):
        """How many leading text tokens of one caption some attention sees -- exactly those, every later one masked
        from every query -- from its cached prompt_mask (L,); None: this family attends all of its text (no cut,
        see flame_models/data/text_trim.py)."""
        return None

    def synthetic_conditioning(self, spec, text_length):
        ctx_name, pooled_name = self.cond_dims
        if self.sample_keys[2] == "prompt_mask":
            return {"prompt_embeds": (text_length, getattr(spec, ctx_name)), "prompt_mask": (text_length,)}
        return {"prompt_embeds": (text_length, getattr(spec, ctx_name)),
                "pooled_prompt_embeds": (getattr(spec, pooled_name),)}

    # ------------------------------------------------------------------ building
    def build_model(self, model_cfg, spec, dtype, device, stream=False):
        """The frozen model: loaded key by key (into host memory when its blocks will stream), or random. A random
        model larger than the tiny preset on a GPU is drawn there (random_init); with `stream`, its block stacks
        stay empty until block_initializer fills each block as the streamer packs it, so it is never whole on the
        GPU."""
        if model_cfg.name_or_path:
            return self.load_model(model_cfg.name_or_path, spec, dtype, "cpu" if stream else device)
        if flame.device(device).type != "cuda" or (model_cfg.size or self.default_size) == self.default_size:
            model = self.model_class(spec, dtype=dtype, device=device)
        else:
            model = self.empty_model(spec, dtype, device)
            g = flame.Generator(device).manual_seed(RANDOM_SEED)
            for name, child in model.named_children():
                if not stream or name not in self.block_stacks(model):
                    init_random_(child, g)
        model.requires_grad_(False)
        return model.eval()

    def empty_model(self, spec, dtype, device):
        """The model without weights (flame_nn.empty_init) that build_model draws."""
        with flame_nn.empty_init(device=device, dtype=dtype):
            return self.model_class(spec)

    def block_initializer(self, model):
        """For block streaming: None, or prepare(block) filling a block left empty by build_model(stream=True),
        drawn on the device of the model's other parts."""
        stacks = self.block_stacks(model)
        if not any(p.is_meta for s in stacks for p in model.get_submodule(s).parameters()):
            return None
        device = next(p.device for name, child in model.named_children() if name not in stacks
                      for p in child.parameters())
        g = flame.Generator(device).manual_seed(RANDOM_SEED + 1)
        return lambda block: init_random_(block, g)

    def spec_of(self, model):
        cls = self.model_class
        if not isinstance(model, cls):
            package = cls.__module__.rpartition(".")[0]  # where the class is exported (flame_models.sd3)
            raise TypeError(f"the {self.name} family trains a {package}.{cls.__name__}, got {type(model).__name__}")
        return getattr(model, self.spec_attr)

    def base_model_name(self, cfg):
        """The LoRA file's flame.base_model: the model file's or folder's name, or the size preset."""
        m = cfg.model
        return os.path.basename(m.name_or_path.rstrip("/\\")) if m.name_or_path else m.size or self.default_size

    # ------------------------------------------------------------------ image folders and text prompts
    def parts_problems(self, cfg, *, vae, text, prefix=""):
        return self.parts.problems(cfg, vae=vae, text=text, prefix=prefix)

    def vae_id(self, model_cfg, device):
        return self.parts.vae_id(model_cfg, device)

    def load_vae(self, model_cfg, device):
        return self.parts.load_vae(model_cfg, device)

    def encode_images(self, vae, pixels):
        x = flame.tensor(np.ascontiguousarray(pixels, dtype=np.float32), device=vae.device)
        return self.pipeline.encode_images(vae, x).numpy()

    def decode(self, vae, latents):
        x = flame.tensor(np.ascontiguousarray(latents, dtype=np.float32), device=vae.device)
        return self.pipeline.decode_latents(vae, x).float().numpy()

    def text_encoder_id(self, model_cfg, device, budget=None):
        # model.lora_path's text-encoder part changes what the encoders produce: its file is part of the key
        return self.parts.text_id(model_cfg, device, budget) + base_loras.text_identity(model_cfg)

    def describe_text_encoders(self, model_cfg, device, budget=None):
        return self.parts.describe(model_cfg, device, budget) + base_loras.text_description(model_cfg)

    def load_text_encoders(self, model_cfg, device, budget=None):
        """The family's encoders (parts.load_text_encoders_for), with model.lora_path's text-encoder part merged
        into them (kept as adapters beside fp8 storage: pipeline.apply_text_encoder_loras); base_loras.read checked
        it against them before anything was loaded."""
        enc = self.parts.load_text_encoders_for(model_cfg, device, budget)
        loras = base_loras.text_loras(model_cfg)
        if loras and not is_structure_only():
            from ..pipeline import apply_text_encoder_loras
            try:
                apply_text_encoder_loras(loras, self.text_lora_parts(enc), base_loras.ConfigError)
            except BaseException:
                enc.free()
                raise
        return enc

    def encode_prompts(self, encoders, prompts):
        out = encoders.encode(list(prompts))
        return {k: v.float().numpy() for k, v in out.items()}


class FlowMatchingFamily(DiffusionFamily):
    """Rectified flow (Flux, SD3): the FlowMatching objective and the flow-matching Euler sampler."""
    latent_channels = 16
    pixel_multiple = 16                  # 8 px per latent, 2x2 latents per token
    noise_schedulers = ("flowmatch", "flow_match")
    samplers = ("flowmatch", "flow_match", "euler")
    scheduler_words = "'flowmatch'"
    sampler_words = "the flow-matching Euler sampler ('flowmatch')"  # "<label> previews use <sampler_words>"

    def _config_problems(self, cfg, prefix):
        e, p = [], prefix
        choice(e, f"{p}train.timestep_type", cfg.train.timestep_type, TIMESTEP_TYPES)
        if cfg.train.huber_schedule == "snr":
            e.append(f"{p}train.huber_schedule: snr is the DDPM families' (SDXL: from ᾱ_t); {self.label} takes "
                     f"constant or exponential")
        if cfg.sample.sampler is not None and cfg.sample.sampler not in self.samplers:
            e.append(f"{p}sample.sampler: {self.label} previews use {self.sampler_words}, got {cfg.sample.sampler!r}")
        return e

    def objective(self, train_cfg):
        t = train_cfg
        return FlowMatching(t.timestep_type, shift=t.shift, sigmoid_scale=t.sigmoid_scale, logit_mean=t.logit_mean,
                            logit_std=t.logit_std, mode_scale=t.mode_scale, weighting_scheme=t.weighting_scheme,
                            noise_offset=t.noise_offset, element=element_loss(t, "constant"),
                            bias=t.content_or_style)


def element_loss(train_cfg, default_schedule):
    """The config's loss type (train.loss_type, huber_c / huber_schedule / huber_scale) as a loss_types.ElementLoss;
    huber_schedule None takes the family's default."""
    t = train_cfg
    return ElementLoss(t.loss_type, huber_c=t.huber_c, huber_schedule=t.huber_schedule or default_schedule,
                       huber_scale=t.huber_scale)


def first_line(e):
    """An exception's message in one line (a KeyError's key without its quotes; the type's name when empty)."""
    s = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return s.splitlines()[0] if s else type(e).__name__


class FlowSamplerPreviews:
    """Mixed into a flow-matching family whose sample() takes sampler="euler" | "heun" | "dpmpp_2m" | "dpmpp_2m_sde"
    | "unipc" (samplers/flow.py) and scheduler= (samplers/flow_schedules.py): previews with sample.sampler 'heun' use
    Heun, 'dpmpp_2m' DPM++ 2M, 'dpmpp_2m_sde' DPM++ 2M SDE (its step noise from the preview's seed), 'unipc' UniPC,
    the others Euler; sample.scheduler respaces the family's sigmas (default 'simple')."""
    samplers = FlowMatchingFamily.samplers + ("heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc")
    sampler_words = ("its flow-matching Euler ('flowmatch', 'euler'), Heun ('heun'), DPM++ 2M ('dpmpp_2m'), DPM++ 2M "
                     "SDE ('dpmpp_2m_sde') or UniPC ('unipc') sampler")

    def _config_problems(self, cfg, prefix):
        e = super()._config_problems(cfg, prefix)
        scheduler = cfg.sample.scheduler
        if scheduler is not None and scheduler not in FLOW_SCHEDULERS:
            e.append(f"{prefix}sample.scheduler: {self.label} previews space their sigmas as "
                     f"{', '.join(FLOW_SCHEDULERS)}, got {scheduler!r}")
        return e

    def sample_options(self, cfg):
        s = cfg.sample.sampler
        return {"sampler": s if s in ("heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc") else "euler",
                "scheduler": cfg.sample.scheduler or "simple"}

