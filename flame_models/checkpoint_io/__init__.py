"""Checkpoint I/O shared by the model families (flux, sd3, sdxl, vae, text_encoders): finding a checkpoint's
safetensors files, reading them one tensor at a time, reporting missing / unexpected / misshaped tensors before any
is read, filling a model built under `flame_nn.empty_init`, and atomic, optionally sharded saving. What differs
between models -- key names, layouts, configs -- stays in each family's package.

    files = safetensors_files(path, what="Flux", error=FluxCheckpointError, subfolder="transformer")
    with SafetensorsCheckpoint(files, label=path) as ckpt:
        missing, unexpected, misshaped = planned_mismatches(plan, targets, ckpt, what="Flux")
        check_mismatch(FluxCheckpointError, f"cannot load {path}:", missing, unexpected, misshaped)
        fill_(model, planned_reader(ckpt, plan, combine), targets)
    save_weights(state.items(), "out/transformer", stem="diffusion_pytorch_model", metadata=meta,
                 max_shard_size=5 << 30, folder_config=diffusers_config)
"""
from .errors import CheckpointError
from .finding import (INDEX_SUFFIX, PICKLE_SUFFIXES, check_not_pickle, folder_weights, index_files,
                      pipeline_subfolder, read_config_json, read_json, safetensors_files)
from .loading import (COMPUTE_DTYPES, PROGRESS_BYTES, check_mismatch, compute_dtype, config_argument, fill_,
                      listing, mismatch_message, planned_mismatches, planned_reader)
from .reading import SafetensorsCheckpoint, block_indices, count_indices, describe_keys, keys_under
from .saving import atomic_open, save_shards, save_weights, shard_groups, write_json

__all__ = ["CheckpointError", "INDEX_SUFFIX", "PICKLE_SUFFIXES", "check_not_pickle", "folder_weights",
           "index_files", "pipeline_subfolder", "read_config_json", "read_json", "safetensors_files",
           "COMPUTE_DTYPES", "PROGRESS_BYTES", "check_mismatch", "compute_dtype", "config_argument", "fill_", "listing",
           "mismatch_message", "planned_mismatches", "planned_reader", "SafetensorsCheckpoint", "block_indices",
           "count_indices", "describe_keys", "keys_under", "atomic_open", "save_shards", "save_weights", "shard_groups",
           "write_json"]
