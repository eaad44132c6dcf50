"""SD3's part of `python -m flame_models.bake`: LoRAs of any layout merged into an SAI- or diffusers-layout SD3 /
SD3.5 MMDiT file -- an SAI file holding the text encoders and the VAE too keeps them as they are
(flame_models/pipeline/bake.py)."""
from ..pipeline.bake import bake_checkpoint
from .loading import _Checkpoint, infer_params
from .model import MMDiT
from .pipeline import STACKS


def bake(base, loras, dst, **kw):
    return bake_checkpoint(base, loras, dst, checkpoint_class=_Checkpoint, infer_params=infer_params,
                           model_class=MMDiT, stacks=STACKS, **kw)
