"""ai-toolkit's output preservation: with `train.diff_output_preservation` the adapters learn the trigger word without
changing what the model makes of the class it stands for; with `train.blank_prompt_preservation`, without changing
what it makes of the empty prompt.

Each sample also carries its preservation prompt (data.captions.PreservationPrompt; data.loader's PRESERVATION keys,
encoded and cached with the captions): the caption it draws with its dataset's trigger word replaced by
`train.diff_output_preservation_class` ("photo of ohwx, smiling" -> "photo of person, smiling"), or the empty
prompt. Per micro-batch, on the same noisy latents and timesteps:

    prior = model(x_t, t, preservation prompt), the adapters switched off, without gradients
    loss  = the run's loss of model(x_t, t, caption)
          + multiplier · mean((model(x_t, t, preservation prompt) − prior)²)    (the kind's multiplier)

as ai-toolkit's SDTrainer computes it: the preservation term is a plain MSE over every element, whatever the loss
type, timestep weighting, masks or regularisation weights of the main term. The two terms' backward passes run one
after the other (their gradients add up), so one forward's activations are held at a time. Inside the step's CUDA
graph the adapters' switch is a decision made at capture, like every other; under max_gpu_memory the steps run
eagerly (the prior forward's streaming schedule is an inference one, which a graph cannot replay).
"""
from contextlib import contextmanager

import flame_nn.functional as F
from flame_nn import adapters as A

from ..data.loader import PRESERVATION


def enabled(train):
    """Whether the run (its train section) preserves outputs: differential or blank prompt preservation."""
    return bool(train.diff_output_preservation or train.blank_prompt_preservation)


def multiplier(train):
    """The preservation term's weight: the multiplier of the kind the run uses."""
    return (train.diff_output_preservation_multiplier if train.diff_output_preservation
            else train.blank_prompt_preservation_multiplier)


def without(batch):
    """`batch` without its preservation prompts' arrays."""
    return {k: v for k, v in batch.items() if not k.startswith(PRESERVATION)}


def prompt_batch(batch):
    """The preservation prompts' batch: `batch` with its caption embeddings replaced by theirs, or None when the
    batch carries none."""
    kept = {k[len(PRESERVATION):]: v for k, v in batch.items() if k.startswith(PRESERVATION)}
    if not kept:
        return None
    return {**without(batch), **kept}


def split(cond):
    """(the step's conditioning, the preservation prompts' conditioning or None), from one dict whose preservation
    entries carry the PRESERVATION prefix (how the step's captured arguments hold both)."""
    kept = {k[len(PRESERVATION):]: v for k, v in cond.items() if k.startswith(PRESERVATION)}
    return without(cond), (kept or None)


def tagged(cond):
    """`cond` (the preservation prompts' conditioning) under the PRESERVATION prefix."""
    return {PRESERVATION + k: v for k, v in cond.items()}


@contextmanager
def adapters_off(model):
    """`model` with its adapters switched off (the base model's prediction), on again after."""
    A.disable_adapters(model)
    try:
        yield model
    finally:
        A.enable_adapters(model)


def loss(pred, prior, multiplier):
    """multiplier · mean((pred − prior)²), in float32."""
    return F.mse_loss(pred.float(), prior.float()) * multiplier
