"""SDXL's part of `python -m flame_models.bake`: LoRAs of any layout (kohya with SAI or diffusers module names, PEFT /
diffusers names; LoRA, LoCon convolutions, DoRA, LoKr, LoHa) merged into an SAI single file -- its text encoders and
VAE kept as they are -- or a diffusers-named UNet file (flame_models/pipeline/bake.py: the UNet's modules carry SAI
names, unet_name_map gives each one's diffusers name)."""
from ..pipeline.bake import bake_checkpoint
from .loading import UNetCheckpoint, infer_config
from .model import SDXLUNet
from .pipeline import STACKS


def bake(base, loras, dst, **kw):
    return bake_checkpoint(base, loras, dst, checkpoint_class=UNetCheckpoint, infer_params=infer_config,
                           model_class=SDXLUNet, stacks=STACKS, **kw)
