"""Sampling with a reference image: the Flux Euler sampler (flame_models.bfl.sampling) run through a denoiser that
appends the reference's tokens to the noisy tokens at every step and keeps the target's velocity. The reference is
not noised and the time shift's mu counts the target tokens only (as FluxKontextPipeline)."""
import flame_nn

from ..bfl.sampling import denoise, get_schedule
from ..samplers.flow_schedules import respace
from .reference import target_velocity, with_reference


class WithReference(flame_nn.Module):
    """A Flux model called like one, with `ref` (B or 1, L_ref, 64) tokens and their `ref_ids` appended to every
    call's image tokens; returns the velocity of the image tokens only."""

    def __init__(self, model, ref, ref_ids):
        super().__init__()
        self.model = model
        self.params = model.params
        self.ref, self.ref_ids = ref, ref_ids

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
        x, ids = with_reference(img, img_ids, self.ref, self.ref_ids)
        v = self.model(img=x, img_ids=ids, txt=txt, txt_ids=txt_ids, timesteps=timesteps, y=y, guidance=guidance)
        return target_velocity(v, img.shape[1])


def denoise_with_reference(model, img, img_ids, ref, ref_ids, txt, txt_ids, y, steps, guidance, *,
                           cuda_graph=None, callback=None, sampler="euler", scheduler="simple", step_noise=None,
                           unguided=None, cfg_start=0):
    """Euler (or Heun) steps from the packed noise `img` (B, L, 64) on FLUX.1-dev's shifted schedule for L target
    tokens, each step seeing the reference tokens `ref` with ids `ref_ids`. Returns the packed latents (float32).
    unguided, cfg_start: with `model` a true-CFG wrapper, the steps before cfg_start run `unguided` (bfl/sampling's
    denoise), with the same reference."""
    timesteps = respace(get_schedule(steps, img.shape[1], shift=True), scheduler)
    ref, ref_ids = ref.to(img.device), ref_ids.to(img.device)
    net = WithReference(model, ref, ref_ids)
    plain = None if unguided is None else WithReference(unguided, ref, ref_ids)
    return denoise(net, img, img_ids, txt, txt_ids, y, timesteps, guidance, cuda_graph, callback, sampler,
                   step_noise, unguided=plain, cfg_start=cfg_start)
