"""Streaming execution for models larger than the GPU budget (`from flame_nn import offload`).

    BlockStreamer(stacks, resident=..., slots=2, quantize="fp8")   weights in pinned host memory, a ring of GPU slots,
                                                                   copies on a copy stream overlapping compute
    run_block(stack, i, *args)          what a model's forward calls per block (streamed or plain/checkpointed)
    auto_fit(streamer, "12GiB", step)   measure a step, keep as many blocks resident as the budget allows
    BlockStreamer(..., offload_activations=True)   checkpointed block inputs in pinned host memory until backward
    plan_budget("4GiB", held=..., ...)  what a budget needs (offload, fp8 outside the blocks), on paper
    quantize_linear_weights_(module)    fp8 (e4m3) storage of frozen Linear weights, per-output-channel scales
    quantize_linear_weights_(module, compute="fp8")   ... per-tensor scales, the matmuls on fp8 tensor cores
    use_fp8_compute_(module)            fp8 compute for Linears already in fp8 storage
    set_fp8_scaling_(module, "delayed") fp8 compute's activations scaled from their history (one pass)
    cache_fp8_transposes_(module)       fp8 compute's W^T kept resident for the input gradient (bytes held)
    set_fp8_weight_(linear, q, scales, dtype)   the same storage from weights that are fp8 already (a file's)
    stack_fp8_weights_(linears) -> q, scales    fp8 layers reading one input on one stacked weight (fp8_linear)
    LayerwiseOptimizer(streamer, opt)   full fine-tuning, each block updated inside backward by any per-parameter
                                        optimizer (Adafactor: Flux-dev on a 24 GB card; kohya's fused backward pass)
    LayerwiseAdamW(streamer, lr=...)    the same for AdamW, its state in pinned host memory
    safetensors_views(files)            memory-mapped tensors of safetensors files (inference: `sources=`)
"""
from .activations import ActivationOffload
from .autofit import FitReport, MemoryBudgetError, OutsideGrowth, auto_fit, demote, fit_outside_growth
from .fp8 import (
                  Float8LinearMixin,
                  fp8_linear,
                  is_fp8_linear,
                  quantize_linear_weights_,
                  set_fp8_scaling_,
                  set_fp8_weight_,
                  stack_fp8_weights_,
                  use_fp8_compute_,
)
from .fp8_transposes import cache_fp8_transposes_
from .host import OffloadError, safetensors_views
from .layerwise import LayerwiseAdamW
from .layerwise_optimizer import LayerwiseOptimizer
from .plan import BudgetPlan, plan_budget
from .streamer import BlockStreamer, is_streamed, run_block, streamer_of

__all__ = ["BlockStreamer", "is_streamed", "run_block", "streamer_of", "auto_fit", "demote", "fit_outside_growth",
           "OutsideGrowth",
           "FitReport", "MemoryBudgetError",
           "quantize_linear_weights_", "set_fp8_weight_", "use_fp8_compute_", "set_fp8_scaling_",
           "cache_fp8_transposes_", "Float8LinearMixin", "is_fp8_linear", "stack_fp8_weights_", "fp8_linear",
           "LayerwiseAdamW", "LayerwiseOptimizer", "safetensors_views", "OffloadError", "ActivationOffload",
           "BudgetPlan", "plan_budget"]
