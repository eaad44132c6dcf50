"""Adapters for fine-tuning frozen Linears: LoRA (rsLoRA), DoRA, LoKr, LoHa; and Conv2ds: LoRA (LoCon, locon.py);
several per layer with weights; merge/unmerge, enable/disable; kohya (ComfyUI) and PEFT (diffusers) files. See inject.py
for the model-level API."""
from .conv_layer import AdaptedConv2dMixin
from .dora import DoRA
from .formats import AdapterFormatError, AdapterPart, NameMap
from .inject import (
                     adapted_modules,
                     adapter_modules,
                     adapter_names,
                     adapter_parameters,
                     adapter_state,
                     disable_adapters,
                     enable_adapters,
                     find_targets,
                     has_adapter,
                     inject_adapters,
                     inject_from_state,
                     load_adapter_state,
                     load_adapters,
                     matches,
                     merge_adapters,
                     named_adapter_parameters,
                     remove_adapters,
                     save_adapters,
                     set_adapter_weight,
                     set_adapters,
                     unmerge_adapters,
)
from .layer import AdaptedLinearMixin, AdaptedMixin, Adapter, AdapterError, adapt, unadapt
from .locon import LoRAConv2d
from .loha import LoHa
from .lokr import LoKr, factorization
from .lora import LoRA
from .max_norm import MaxNorm
