"""Flux Kontext as a trainer family: Flux's (flame_models.bfl.family.FluxFamily) with each sample's control image
-- encoded beside its target, "control_latents" -- appended as reference tokens with ids (1, r, c); the loss sees
the target tokens' prediction only. Samples without control latents train as plain FLUX.1-dev."""
import os

import flame_core as flame

from .. import registry
from ..bfl.family import FluxFamily
from ..bfl.sampling import get_noise, image_ids, pack, text_ids, unpack
from ..samplers.flow import STOCHASTIC, step_noise
from ..training.family import ModelFileError
from .reference import reference_ids, target_velocity, with_reference
from .sampling import denoise_with_reference


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    label = "Flux Kontext"
    model_words = "a Flux Kontext transformer"
    default_size = "flux-tiny"
    control_images = True
    config_defaults = {**FluxFamily.config_defaults, "name": "flux_kontext_lora"}

    def check_model_file(self, path):
        """Flux's check (a Flux transformer's files), and a diffusers pipeline folder must be Kontext's: a FluxPipeline
        folder holds FLUX.1-dev (the same tensors), which `generate --arch flux_kontext` refuses too. A single file
        cannot tell them apart: model.arch says which."""
        super().check_model_file(path)
        if os.path.isfile(os.path.join(path, "model_index.json")):
            family, words = registry.detect_family(path, error=ModelFileError, default="other")
            if family != self.name:
                raise ModelFileError(f"{path} is not {self.model_words}: it looks like {words}"
                                     + (f" (model.arch: {family} trains it)" if family in registry.names() else ""))

    def training_inputs(self, model, batch, device, train_cfg):
        x0, cond = super().training_inputs(model, batch, device, train_cfg)
        control = batch.get("control_latents")
        if control is not None:
            ref = pack(flame.tensor(control, dtype=flame.float32, device=device))
            f = self.vae_scale_factor
            cond["ref"] = ref
            cond["ref_ids"] = reference_ids(control.shape[2] * f, control.shape[3] * f, ref.shape[0], device=device)
        return x0, cond

    def forward(self, model, x_t, t, cond):
        if "ref" not in cond:
            return super().forward(model, x_t, t, cond)
        x, ids = with_reference(x_t, cond["img_ids"], cond["ref"], cond["ref_ids"])
        v = model(img=x, img_ids=ids, txt=cond["txt"], txt_ids=cond["txt_ids"], timesteps=t, y=cond["y"],
                  guidance=cond.get("guidance"), bypass_guidance="guidance" not in cond)
        return target_velocity(v, x_t.shape[1])

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, sampler="euler",
               scheduler="simple", true_cfg=1.0, true_cfg_start=0):
        """A preview: with cond's "control_latents" (a dataset caption's control image) as the reference, else
        Flux's text-to-image; Euler or Heun (sampler); true CFG as Flux's (with the same reference)."""
        control = cond.get("control_latents")
        if control is None:
            return super().sample(model, cond, height=height, width=width, steps=steps, guidance=guidance,
                                  seed=seed, device=device, callback=callback, sampler=sampler, scheduler=scheduler,
                                  true_cfg=true_cfg, true_cfg_start=true_cfg_start)
        dtype = model.img_in.weight.dtype
        txt = flame.tensor(cond["prompt_embeds"][None], device=device).to(dtype)
        y = flame.tensor(cond["pooled_prompt_embeds"][None], device=device).to(dtype)
        ref = pack(flame.tensor(control[None], dtype=flame.float32, device=device)).to(dtype)
        f = self.vae_scale_factor
        ref_ids = reference_ids(control.shape[1] * f, control.shape[2] * f, 1, device=device)
        x = pack(get_noise(1, height, width, seed=seed, device=device))
        net = self.guided(model, cond, txt, true_cfg, device)
        out = denoise_with_reference(net, x, image_ids(height, width, 1, device=device), ref, ref_ids, txt,
                                     text_ids(txt.shape[1], 1, device=device), y, steps, guidance,
                                     callback=callback, sampler=sampler, scheduler=scheduler,
                                     step_noise=step_noise([seed], device) if sampler in STOCHASTIC else None,
                                     unguided=model if net is not model else None, cfg_start=true_cfg_start)
        return unpack(out, height, width)

    def lora_metadata(self, cfg, model):
        return {**super().lora_metadata(cfg, model), "modelspec.architecture": "flux-1-kontext-dev/lora"}
