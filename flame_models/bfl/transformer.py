"""A Flux transformer made ready for sampling from a model's files (the Flux and Kontext pipelines share it): its
LoRA files checked against it before anything big loads, then the model loaded with them applied -- merged, or kept
as adapters beside fp8 blocks or blocks streamed from host memory (flame_models.pipeline.load_for_sampling)."""
import flame_core as flame

from ..pipeline import check_loras as _check_loras
from ..pipeline import load_for_sampling
from .components import FluxFiles, FluxFilesError, find_flux_files
from .loading import load_flux

STACKS = ("double_blocks", "single_blocks")


def check_loras(loras, params):
    """Read each "path[:weight]" LoRA file and check it against a Flux of `params` (names, shapes, kinds) before
    anything big is loaded: [(path, weight)]; FluxFilesError names the file (flame_models.pipeline.check_loras).
    Text-encoder parts (CLIP-L: kohya lora_te1_, diffusers text_encoder.; T5: kohya lora_te3_, diffusers
    text_encoder_2.) are accepted here and checked against the encoders when they load
    (conditioning.load_text_encoders, which a generator runs before the transformer)."""
    from .model import Flux
    return _check_loras(loras, params, model_class=Flux, error=FluxFilesError,
                        text_encoders={"te1": None, "te2": None, "te3": None})


def load_transformer(files, *, dtype=flame.bfloat16, device=None, loras=(), fp8=False, stream=False, slots=2):
    """The Flux transformer of `files` (FluxFiles or a path) with LoRAs applied, ready for sampling.

    fp8: the blocks' Linear weights in fp8 storage (e4m3, a scale per row), LoRAs kept as adapters beside them.
    stream: the blocks' weights in pinned host memory, streamed through `slots` device buffers
    (flame_nn.offload.BlockStreamer, `model.streamer`; choose resident blocks with the pipeline's fit_transformer);
    the model is read into host memory first. Without either, LoRAs are merged into the weights."""
    files = files if isinstance(files, FluxFiles) else find_flux_files(files)
    loras = check_loras(loras, files.params)
    return load_for_sampling(lambda dev: load_flux(files.transformer, dtype=dtype, device=dev), files.transformer,
                             loras, STACKS, device, fp8=fp8, stream=stream, slots=slots, error=FluxFilesError)
