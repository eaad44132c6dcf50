"""Chroma's part of `python -m flame_models.bake`: LoRAs of any layout merged into a BFL- or diffusers-layout Chroma
transformer file (flame_models/pipeline/bake.py)."""
from ..pipeline.bake import bake_checkpoint
from .loading import _Checkpoint, infer_params
from .model import Chroma
from .pipeline import STACKS


def bake(base, loras, dst, **kw):
    return bake_checkpoint(base, loras, dst, checkpoint_class=_Checkpoint, infer_params=infer_params,
                           model_class=Chroma, stacks=STACKS, **kw)
