"""Adapters for fine-tuning frozen Linears: LoRA (rsLoRA), DoRA, LoKr, LoHa; and Conv2ds: LoRA (LoCon, locon.py); several per layer with weights;
merge/unmerge, enable/disable; kohya (ComfyUI) and PEFT (diffusers) files. See inject.py for the model-level API."""
from .layer import Adapter, AdapterError, AdaptedMixin, AdaptedLinearMixin, adapt, unadapt
from .conv_layer import AdaptedConv2dMixin
from .locon import LoRAConv2d
from .lora import LoRA
from .dora import DoRA
from .lokr import LoKr, factorization
from .loha import LoHa
from .formats import AdapterFormatError, AdapterPart, NameMap
from .inject import (inject_adapters, find_targets, matches, adapted_modules, adapter_names, adapter_modules,
                     adapter_parameters, named_adapter_parameters, adapter_state, load_adapter_state, save_adapters,
                     load_adapters, set_adapters, set_adapter_weight, enable_adapters, disable_adapters,
                     merge_adapters, unmerge_adapters, remove_adapters)
