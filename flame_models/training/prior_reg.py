"""Datasets with `prior_reg: true` (ai-toolkit's name; SimpleTuner's is_regularisation_data): their samples train
toward the prediction the model makes without its adapters -- the same noisy latents, timestep and caption --
instead of toward the data, as ai-toolkit's SDTrainer does (its target becomes the prior prediction) : the adapters
learn the other images while leaving these as the base model draws them.

A batch that holds such samples carries a (B,) mask (1 for them) under KEY in the step's conditioning; one without
carries None there, so the step's CUDA graphs are keyed by it (a graph with the prior forward, one without) and a
batch without them pays nothing. The prior forward runs without gradients and with the adapters off, before the
step's own forward (preservation.adapters_off); the target of the masked samples is replaced by it.
"""
import numpy as np

import flame_core as flame

KEY = "prior_reg_mask"


def batch_mask(batch, device):
    """The batch's (B,) float32 mask of prior_reg samples on `device`, or None when it holds none."""
    flags = batch.get("prior_reg")
    if flags is None or not np.any(flags):
        return None
    return flame.tensor(np.asarray(flags, dtype=np.float32), device=device)


def blend(prior, target, mask):
    """`target` with the masked samples' rows replaced by `prior` (the adapter-free prediction, detached), in the
    target's dtype: mask·prior + (1 − mask)·target, the mask broadcast over each sample's elements."""
    m = mask.reshape((-1,) + (1,) * (target.ndim - 1)).to(target.dtype)
    return target + m * (prior.detach().to(target.dtype) - target)
