"""Flux Kontext's part of `python -m flame_models.bake`: its transformer is Flux's (the same files, keys and LoRAs)."""
from ..bfl.loading import _Checkpoint, infer_params
from ..bfl.model import Flux
from ..bfl.transformer import STACKS
from ..pipeline.bake import bake_checkpoint


def bake(base, loras, dst, **kw):
    return bake_checkpoint(base, loras, dst, checkpoint_class=_Checkpoint, infer_params=infer_params,
                           model_class=Flux, stacks=STACKS, **kw)
