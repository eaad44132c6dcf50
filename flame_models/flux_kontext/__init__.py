"""FLUX.1 Kontext [dev] (image editing): FLUX.1-dev's transformer (flame_models.bfl, the same tensors) fed the tokens of
a reference image after the noisy image tokens, their position ids (1, r, c) where the target's are (0, r, c); only
the target tokens' velocity is kept. Kontext's resolution list for the reference, sampling with it, the trainer
plug-in (pairs: `control_path` images beside their targets) and the `generate --image` part."""
from .reference import PREFERRED_KONTEXT_RESOLUTIONS, kontext_size, reference_ids, target_velocity, with_reference

__all__ = ["PREFERRED_KONTEXT_RESOLUTIONS", "kontext_size", "reference_ids", "with_reference", "target_velocity"]
