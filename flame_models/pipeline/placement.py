"""A model loaded for sampling: frozen, LoRAs applied, on the device as a whole, in fp8 storage or with its blocks
streamed from pinned host memory; and released again."""
import gc

import flame_core as flame
from flame_core import memory
from flame_nn import adapters as A
from flame_nn.offload import BlockStreamer, OffloadError, quantize_linear_weights_
from flame_nn.offload import fp8 as _fp8

from .. import checkpoint_io as CIO
from ..conditioning.files import ModelFilesError
from .loras import apply_loras


def load_for_sampling(load, path, loras, stacks, device=None, *, fp8=False, stream=False, slots=2,
                      error=ModelFilesError):
    """The model `load(device)` reads from `path`, frozen, in eval mode, with the checked `loras` (check_loras)
    applied -- merged into the weights unless fp8 or stream keep them as adapters -- and placed on `device` for
    sampling (place_for_inference). With fp8 or stream the model is read into host memory and moved block by block,
    so that it is never whole on the device in its dtype; with fp8 its blocks' Linear weights are read onto
    `device` one at a time and stored in fp8 there, or with stream in host memory for the streamer to pack
    (checkpoint_io.fp8_on_read: a file's fp8 bytes as they are; neither the host nor the device holds them whole in
    the model's dtype). A placement that cannot be done is `error` naming `path`."""
    dev = flame.device(device) if device is not None else flame.default_device()
    if fp8:  # the blocks' Linear weights go to fp8 storage as they are read, quantised on `dev` (streamed: then
        # kept in host memory for the streamer to pack, one weight at a time on the device)
        with CIO.fp8_on_read(stacks, per_tensor=fp8 == "compute", device=dev, keep="cpu" if stream else None):
            model = load("cpu")
    else:
        model = load("cpu" if stream else dev)
    model.requires_grad_(False)
    model.eval()
    apply_loras(model, loras, merge=not (fp8 or stream), error=error)
    try:
        place_for_inference(model, stacks, dev, fp8=fp8, stream=stream, slots=slots)
    except OffloadError as e:
        raise error(f"{path}: {str(e).splitlines()[0]}") from None
    return model


def place_for_inference(model, stacks, device, *, fp8=False, stream=False, slots=2):
    """Put a model read into host memory (for fp8 or streaming) on `device`: stream: the blocks of the ModuleLists
    `stacks` in pinned host memory through `slots` device buffers (`model.streamer`, in fp8 with fp8); fp8 alone:
    each block moved and its Linear weights quantised in turn (the whole model is never on the device in its
    dtype); adapters follow. Neither: nothing to do (the model was loaded on the device). fp8="compute": fp8
    storage with one scale per weight tensor and the blocks' matmuls on the e4m3 tensor cores (flame_nn.offload)."""
    compute = "fp8" if fp8 == "compute" else None
    if stream:
        model.streamer = BlockStreamer.for_model(model, stacks, device=device, quantize="fp8" if fp8 else None,
                                                 fp8_compute=compute is not None,
                                                 slots=slots)
    elif fp8:
        dev = flame.device(device)
        for t in (*model.parameters(recurse=False), *model.buffers(recurse=False)):  # the model's own (SD3's
            if t.device != dev:                                                       # position table)
                t.data = t.data.to(dev)
        for name, child in model.named_children():
            if name not in stacks:
                child.to(device)
        for s in stacks:
            for block in model.get_submodule(s):
                block.to(device)
                quantize_linear_weights_(block, compute=compute)
        for name in A.adapter_names(model):  # adapters sit beside the module tree
            for _, _, ad in A.adapter_modules(model, name):
                ad.to(device)
    return model


def free_model(model, device=None):
    """Release a model now (its streamer too): device pool and pinned host buffers, and the fp8 dequantisation
    scratch beyond what the fp8 Linears still alive need."""
    streamer = getattr(model, "streamer", None)
    if streamer is not None:
        streamer.synchronize()
        model.streamer = None
    del streamer, model
    gc.collect()
    _fp8.trim_scratch()
    memory.empty_cache(device)
    memory.empty_pinned_cache()
