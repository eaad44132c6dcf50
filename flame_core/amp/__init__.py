"""Mixed precision: `autocast` regions, `GradScaler` loss scaling, fp32 master weights for bf16 training.

See README.md beside this file for the op policy (which ops run in which dtype) and the recipes.
"""
from .autocast_mode import (
                            FP32_OPS,
                            LOWER_PRECISION_OPS,
                            NATIVE_OPS,
                            PROMOTE_OPS,
                            autocast,
                            cast_inputs,
                            category_of,
                            clear_autocast_cache,
                            custom_bwd,
                            custom_fwd,
                            get_autocast_dtype,
                            get_autocast_state,
                            is_autocast_cache_enabled,
                            is_autocast_enabled,
                            restore_autocast_state,
)
from .grad_scaler import GradScaler
from .master_weights import MasterWeightOptimizer

__all__ = ["autocast", "cast_inputs", "category_of", "is_autocast_enabled", "get_autocast_dtype",
           "is_autocast_cache_enabled", "clear_autocast_cache", "get_autocast_state", "restore_autocast_state",
           "custom_fwd", "custom_bwd", "LOWER_PRECISION_OPS", "FP32_OPS", "PROMOTE_OPS", "NATIVE_OPS", "GradScaler",
           "MasterWeightOptimizer"]
