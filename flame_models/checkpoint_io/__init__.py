"""Checkpoint I/O shared by the model families (flux, sd3, sdxl, vae, text_encoders): finding a checkpoint's
safetensors files, reading them one tensor at a time, naming every missing / unexpected / misshaped tensor before
any is read, filling a model built under `flame_nn.empty_init`, and atomic, optionally sharded saving. What differs
between models -- key names, layouts, configs -- stays in each family's package.

    class FluxCheckpoint(SafetensorsCheckpoint):          # a family's view of its files
        error = FluxCheckpointError
        def scan_keys(self):                               # its prefix and layout, from the key names
            self.prefix, self.layout = ...

    files = safetensors_files(path, what="Flux", error=FluxCheckpointError, subfolder="transformer")
    with FluxCheckpoint(files, label=path) as ckpt:
        load_planned_(model, ckpt, plan, dict(model.named_parameters()), combine, what="Flux")
    save_weights(state.items(), "out/transformer", stem="diffusion_pytorch_model", metadata=meta,
                 max_shard_size=5 << 30, folder_config=diffusers_config)
"""
from .errors import CheckpointError
from .finding import (
                      INDEX_SUFFIX,
                      PICKLE_SUFFIXES,
                      check_not_pickle,
                      folder_weights,
                      index_files,
                      pipeline_subfolder,
                      read_config_json,
                      read_json,
                      safetensors_files,
)
from .loading import (
                      COMPUTE_DTYPES,
                      PROGRESS_BYTES,
                      check_mismatch,
                      compute_dtype,
                      config_argument,
                      empty_model,
                      fill_,
                      fp8_on_read,
                      layout_plan,
                      listing,
                      load_planned_,
                      merge_on_read,
                      mismatch_message,
                      planned_mismatches,
                      planned_reader,
                      preset,
                      stored_fp8_reader,
)
from .pipeline_folder import pipeline_components, write_pipeline_folder
from .reading import SafetensorsCheckpoint, block_indices, count_indices, describe_keys, key_kinds, keys_under
from .saving import cast_item, check_saveable, other_tensors, save_shards, save_weights, shard_groups, write_json

__all__ = [
    "CheckpointError",
    # finding the files
    "INDEX_SUFFIX", "PICKLE_SUFFIXES", "check_not_pickle", "folder_weights", "index_files", "pipeline_subfolder",
    "read_config_json", "read_json", "safetensors_files",
    # reading
    "SafetensorsCheckpoint", "block_indices", "count_indices", "describe_keys", "key_kinds", "keys_under",
    # loading into a model
    "COMPUTE_DTYPES", "PROGRESS_BYTES", "check_mismatch", "compute_dtype", "config_argument", "empty_model", "fill_",
    "fp8_on_read", "layout_plan", "listing", "load_planned_", "merge_on_read", "mismatch_message",
    "planned_mismatches", "planned_reader", "preset", "stored_fp8_reader",
    # saving
    "cast_item", "check_saveable", "save_shards", "save_weights", "shard_groups", "write_json",
    "pipeline_components", "write_pipeline_folder",
]
