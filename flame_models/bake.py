"""`python -m flame_models.bake`: LoRAs baked into a model checkpoint (kohya's merge_lora / flux_merge_lora),
written as a new .safetensors file with every other tensor as it was.

Flux, Flux Kontext and Chroma transformers (BFL or diffusers layout), SD3 MMDiTs and SDXL UNets (SAI or diffusers
layout): a LoRA of any layout FLAME reads (kohya / ComfyUI native names, PEFT / diffusers / ai-toolkit names; LoRA,
LoCon, DoRA, LoKr, LoHa), merged as `generate --lora` merges it (the family's bake.py over
flame_models/pipeline/bake.py). Every other model (Qwen-Image): a LoRA of the checkpoint's own layout
(flame_nn/adapters/bake.py).

    python -m flame_models.bake --model flux1-dev.safetensors --lora style.safetensors:0.8 --lora subject.safetensors \\
        --output flux1-dev-baked.safetensors

--fp8 (those families) writes the block stacks' Linear weights -- what FLAME's fp8 storage quantises -- as ComfyUI's
scaled fp8 (float8_e4m3fn, a float32 scale_weight per weight, the scaled_fp8 marker; checkpoint_io/scaled_fp8.py),
quantised from the merged value; with no --lora it converts the checkpoint alone. ComfyUI and FLAME read the result.
"""
import argparse
import os
import sys

from flame_nn.adapters import formats as AF
from flame_nn.adapters.bake import bake_file
from flame_nn.adapters.resize import ResizeError, check_weights

from . import registry
from .pipeline.loras import parse_lora

FAMILIES = ("flux", "flux_kontext", "chroma", "sd3", "sdxl")   # the families with a bake.py: any LoRA layout


class BakeError(AF.AdapterFormatError):
    """A bad argument, checkpoint or LoRA bake cannot take (the message names the file and key)."""


def bake(model, loras, output, *, arch=None, skip_text_encoders=False, fp8=False, progress=False):
    """Write `model` (a .safetensors checkpoint) with `loras` (["path", "path:weight", (path, weight)]) baked in to
    `output`; fp8: the blocks' Linear weights written as ComfyUI's scaled fp8 (no LoRA needed then). Returns the
    sorted keys of the tensors changed."""
    loras = [parse_lora(s) for s in loras]
    if not loras and not fp8:
        raise BakeError("no LoRA to bake: pass --lora (repeatable), or --fp8 to convert the checkpoint alone")
    check_weights(loras)
    for path, _ in loras:
        if not os.path.isfile(path):
            raise BakeError(f"--lora {path}: not a file")
    if not os.fspath(output).endswith(".safetensors"):
        raise BakeError(f"--output {output}: a .safetensors file")
    family = registry.detect_family(model, arch, error=BakeError, default="other")[0]
    if family in FAMILIES:
        return registry.module(family, "bake").bake(model, loras, output, skip_text_encoders=skip_text_encoders,
                                                    fp8=fp8, progress=progress)
    if fp8:
        raise BakeError(f"--fp8: writes Flux, Flux Kontext, Chroma, SD3 and SDXL checkpoints; {model} is "
                        f"{registry.about(family).label if family in registry.names() else 'another model'}")
    return sorted(bake_file(model, loras, output, skip_text_encoders=skip_text_encoders, progress=progress))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flame_models.bake", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the checkpoint (.safetensors)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:WEIGHT]", help="a LoRA file (repeatable)")
    p.add_argument("--output", required=True, help="the checkpoint to write (.safetensors)")
    p.add_argument("--arch", choices=registry.names(), help="the model's family when its files do not say")
    p.add_argument("--skip-text-encoders", action="store_true",
                   help="bake the denoiser's adapters; leave a file's text-encoder ones out")
    p.add_argument("--fp8", action="store_true",
                   help="write the blocks' Linear weights as ComfyUI's scaled fp8 (float8_e4m3fn with a scale per "
                        "weight); with no --lora: convert the checkpoint alone")
    args = p.parse_args(argv)
    try:
        changed = bake(args.model, args.lora, args.output, arch=args.arch, skip_text_encoders=args.skip_text_encoders,
                       fp8=args.fp8, progress=True)
    except (AF.AdapterFormatError, ResizeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(changed)} tensors changed; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
