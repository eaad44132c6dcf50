"""What the text-to-image pipelines (Flux, SD3, SDXL) share: finding a model's parts from its file headers
(files.py), and the text-encoder side -- a bundle of encoders freed as one, CLIP's penultimate-state and pooled
conditioning, long captions in 77-token chunks (encoders.py)."""
from .encoders import CHUNK, EncoderBundle, check_max_token_length, clip_ids, clip_states, prompt_list, prompt_rows
from .files import (
                    Embedded,
                    Located,
                    ModelFilesError,
                    PartSpec,
                    check_vocabulary,
                    clip_facts,
                    embedded_parts,
                    found_clip_facts,
                    kind_of,
                    locate_parts,
                    part_files,
                    read_headers,
                    report,
                    shown,
                    t5_facts,
                    tokenizer_folder,
                    vae_channel_problems,
                    vae_latent_channels,
)

__all__ = ["ModelFilesError", "Embedded", "part_files", "read_headers", "shown", "kind_of",
           "embedded_parts", "clip_facts", "t5_facts", "vae_latent_channels", "found_clip_facts",
           "vae_channel_problems", "tokenizer_folder", "check_vocabulary",
           "report", "PartSpec", "Located", "locate_parts", "CHUNK", "EncoderBundle", "prompt_list",
           "prompt_rows", "check_max_token_length", "clip_ids", "clip_states"]
