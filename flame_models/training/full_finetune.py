"""Full fine-tuning (`network: {type: full}`, `--network full`): the denoiser's own weights trained, instead of
adapters on a frozen model -- kohya's sdxl_train.py / flux_train.py, SimpleTuner's `--model_type full`,
OneTrainer's FINE_TUNE, ai-toolkit without a network.

    n = make_trainable(model, network, name_map, device=dev, budget=None, optimizer="adamw8bit")
    named = trained_parameters(model)      # [(name, Parameter)]: what the optimizer, checkpoints and EMA hold

Precision: the trained parameters are held in float32 -- converted from the model's dtype when it is lower -- and
the forward runs under the trainer's autocast (`train.dtype`, bf16 by default), as PyTorch's automatic mixed precision
and diffusers' training scripts train: the optimizer adds float32 updates (a bf16 weight would drop every update
below 2^-8 of its value: a learning rate of 1e-5 moves nothing), the matmuls run in bf16. The file written at the
end (the family's `save_model`) is the whole denoiser in its native checkpoint layout at `save.dtype`.
`train.full_bf16` (kohya's flag) keeps them in the model's bf16 instead -- half the weights' memory and bf16
gradients -- and AdamW8bit or Adafactor writes each update back with stochastic rounding
(flame_core.kernels.stochastic_rounding), so small updates still move the weights on average.

Which parameters: every floating parameter of the denoiser, or those `network.network_kwargs` picks --
`only_if_contains` / `ignore_if_contains` match substrings of the parameter's name in the model's native layout
(`double_blocks.3.img_attn.qkv.weight`, `input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight`) or of its
module's diffusers names (`transformer_blocks.3.attn.to_q`), as ai-toolkit's filters match its module names. The
rest stays frozen in its dtype. Sizes are checked before anything is converted: the trained parameters' float32
values (unless full_bf16), gradients and optimizer state (state_bytes) must fit what the device has free (or the
memory budget). With train.train_text_encoder (SDXL) the text encoders' weights are checked and held alike
(`extra`: text_training.full_selection) and the family's save_model writes them into the checkpoint.

Under max_gpu_memory (`streamed`: the block stacks' parameters) the blocks' weights stream from pinned host memory and
train layer-wise (the trainer wraps the optimizer in flame_nn.offload.LayerwiseOptimizer): they are marked trainable
here and held in float32 (unless full_bf16) as each block is packed (`hold_in_float32`); the size check counts their
values against the host's memory and only their optimizer state against the device's.
"""
import flame_core as flame
from flame_core.memory.stats import fmt_bytes

from .config import ConfigError
from .limits import device_memory, host_memory
from .optimizers import STATE_BYTES


def _names_of(name, module_name, name_map):
    """The names the filters match for parameter `name` of module `module_name`: its own, and the module's diffusers
    names (with the parameter's leaf) where the name map has them."""
    out = [name]
    peft_targets = getattr(name_map, "peft_targets", None)
    if peft_targets is not None and module_name:
        leaf = name[len(module_name) + 1:]
        out += [f"{p}.{leaf}" for p, _ in peft_targets(module_name) if p != module_name]
    return out


def select(model, network, name_map=None):
    """[(name, Parameter)] of the denoiser that network.network_kwargs' filters keep (all floating ones without
    filters), in model.named_parameters() order."""
    kw = network.network_kwargs
    only, ignore = kw.get("only_if_contains"), kw.get("ignore_if_contains")
    out, seen = [], set()
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if not p.dtype.is_floating_point or id(p) in seen:   # (a tied parameter once, under its first name)
                continue
            seen.add(id(p))
            name = f"{module_name}.{leaf}" if module_name else leaf
            names = _names_of(name, module_name, name_map) if (only or ignore) else (name,)
            if only and not any(s in n for s in only for n in names):
                continue
            if ignore and any(s in n for s in ignore for n in names):
                continue
            out.append((name, p))
    return out


def state_bytes(optimizer, p, optimizer_params=None):
    """Bytes of `optimizer`'s state for parameter `p`: Adafactor's factored second moment (a float32 row and column
    mean for 2+ dimensions; float32 per element otherwise) and first moment only with beta1; the others by
    optimizers.STATE_BYTES per element."""
    n = p.numel()
    if optimizer != "adafactor":
        return n * STATE_BYTES.get(optimizer, 8)
    shape = tuple(p.shape)
    second = 4 * (n // shape[-1] + n // shape[-2]) if len(shape) >= 2 else 4 * n
    return second + (4 * n if (optimizer_params or {}).get("beta1") is not None else 0)


def problems(selected, device, budget, optimizer, setting="network.type", keep_dtype=False, optimizer_params=None,
             ema=False, streamed=frozenset()):
    """Why the selected parameters cannot be trained on `device`: none selected, or their float32 values (the part
    not yet held; keep_dtype: none), gradients (in the values' dtype), optimizer state (state_bytes) and, with `ema`,
    the float32 average and the copy its swap keeps while sampling, more than the device has free (the budget, else
    its free memory). `streamed`: ids of parameters in streamed blocks (max_gpu_memory): their values live in pinned
    host memory (counted against the host's) and their gradients exist one block at a time (auto-fit measures them);
    their optimizer state stays on the device."""
    if not selected:
        return [f"{setting}: full -- network.network_kwargs' filters leave no parameter of the model to train"]
    count = sum(p.numel() for _, p in selected)
    need = sum(state_bytes(optimizer, p, optimizer_params) for _, p in selected)
    held = [p for _, p in selected if id(p) not in streamed]
    if keep_dtype:   # gradients in the values' dtype
        need += sum(p.numel() * p.dtype.itemsize for p in held)
    else:            # the float32 values' part not yet held, float32 gradients
        need += sum(p.numel() * (4 - p.dtype.itemsize) for p in held if p.dtype != flame.float32)
        need += sum(p.numel() for p in held) * 4
    if ema:          # training.ema.EMA: a float32 shadow, and the values saved while it is swapped in
        need += count * 4 + sum(p.numel() * (p.dtype.itemsize if keep_dtype else 4) for _, p in selected)
    dev = flame.device(device)
    if budget is None and dev.type == "cuda":
        have, what = int(flame.cuda.mem_get_info(dev)[0]), f"free memory of {dev}"
    else:
        have, what = device_memory(dev, budget)
    if have is not None and need > have:
        return [f"{setting}: full fine-tuning of {count:,} parameters needs {fmt_bytes(need)} more for their "
                f"{'optimizer state' if streamed else ('' if keep_dtype else 'float32 ') + 'values, gradients'}"
                f"{', EMA' if ema else ''} and {optimizer} "
                f"state beside the model's weights: more than the "
                f"{fmt_bytes(have)} of {what} (pick fewer with network.network_kwargs only_if_contains, take an "
                f"optimizer with less state -- {'adafactor: a few MiB' if streamed else 'adamw8bit, adafactor'} --, "
                f"or train a LoRA)"]
    host_need = sum(p.numel() * (p.dtype.itemsize if keep_dtype else 4) for _, p in selected if id(p) in streamed)
    host = host_memory()
    if streamed and host is not None and host_need > host:
        return [f"max_gpu_memory: the streamed blocks' {'' if keep_dtype else 'float32 '}weights take "
                f"{fmt_bytes(host_need)} of pinned host memory while they train, more than the host's "
                f"{fmt_bytes(host)}" + ("" if keep_dtype else " (train.full_bf16 halves them)")]
    return []


def make_trainable(model, network, name_map=None, *, device, budget, optimizer, keep_dtype=False,
                   optimizer_params=None, ema=False, extra=(), streamed=frozenset()):
    """Select (select) and check (problems: ConfigError) the parameters to train, then hold each in float32
    (keep_dtype: in the model's dtype -- train.full_bf16) with requires_grad set; every other parameter stays frozen.
    extra: [(name, Parameter)] trained beside them (the text encoders' weights under train.train_text_encoder),
    checked and held alike. streamed: ids of parameters of blocks that will stream (max_gpu_memory), possibly without
    data yet: marked trainable only -- `hold_in_float32` converts each as its block is packed. Returns how many of the
    model's parameter tensors train."""
    selected = select(model, network, name_map)
    found = problems(selected + list(extra) if selected else selected, device, budget, optimizer,
                     keep_dtype=keep_dtype, optimizer_params=optimizer_params, ema=ema, streamed=streamed)
    if found:
        raise ConfigError("; ".join(found))
    model.requires_grad_(False)
    with flame.no_grad():
        for _, p in selected + list(extra):
            if p.dtype != flame.float32 and not keep_dtype and id(p) not in streamed:
                p.data = p.data.to(flame.float32)
            p.requires_grad_(True)
    return len(selected)


def hold_in_float32(block):
    """A streamed block's trained parameters converted to float32 as it is packed (make_trainable's `streamed`)."""
    with flame.no_grad():
        for p in block.parameters():
            if p.requires_grad and p.dtype != flame.float32:
                p.data = p.data.to(flame.float32)


def trained_parameters(model):
    """[(name, Parameter)] of the model's parameters that train (requires_grad), in named_parameters() order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
