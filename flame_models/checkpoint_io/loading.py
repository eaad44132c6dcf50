"""Loading a checkpoint into a model built under `flame_nn.empty_init`: name every missing, unexpected and
misshaped tensor in one error before any tensor is read, then read the tensors one at a time straight into each
parameter's dtype and device and make them the parameters' storage (no random init, no second copy)."""
import contextlib
import contextvars

from tqdm.auto import tqdm

import flame_core as flame
import flame_nn
from flame_core.ops.fp8 import quantize_fp8
from flame_nn.offload import is_fp8_linear, set_fp8_weight_

PROGRESS_BYTES = 1 << 30  # loads of more bytes show a progress bar
COMPUTE_DTYPES = (flame.float16, flame.bfloat16, flame.float32, flame.float64)


def listing(names, limit=20):
    """`names` joined by commas, the first `limit` of them and how many more."""
    return ", ".join(names[:limit]) + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def mismatch_message(header, missing=(), unexpected=(), misshaped=(), *, limit=20, noun="keys", hint=None):
    """`header`, then one line each for the missing and unexpected names and the misshaped descriptions that there
    are ("  missing keys (3): a, b, c"), then `hint` when given."""
    lines = [header]
    label = f" {noun}" if noun else ""
    if missing:
        lines.append(f"  missing{label} ({len(missing)}): {listing(list(missing), limit)}")
    if unexpected:
        lines.append(f"  unexpected{label} ({len(unexpected)}): {listing(list(unexpected), limit)}")
    if misshaped:
        lines.append(f"  misshaped ({len(misshaped)}): " + "; ".join(list(misshaped)[:limit]))
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def check_mismatch(error, header, missing=(), unexpected=(), misshaped=(), *, strict=True, **message):
    """Raise `error(mismatch_message(...))` when a tensor is misshaped or, with `strict`, when one is missing or
    unexpected. `message`: mismatch_message's options."""
    if misshaped or (strict and (missing or unexpected)):
        raise error(mismatch_message(header, missing, unexpected, misshaped, **message))


def planned_mismatches(plan, targets, ckpt, *, what):
    """(missing, unexpected, misshaped) of a load plan against an open checkpoint (SafetensorsCheckpoint, keys
    relative to its prefix). `plan`: {model key: (file keys, how)} -- each model tensor is one file tensor, or
    several concatenated along dim 0 (how == "cat"); `targets`: {model key: tensor}. Missing and unexpected are
    the file's names; `what` names the model class when plan and targets disagree (a bug, not a bad file)."""
    unknown = sorted(set(plan) ^ set(targets))
    if unknown:
        raise ckpt.error(f"model and plan disagree on {unknown[:10]}: is this a flame_models {what}?")
    used = {k for keys, _ in plan.values() for k in keys}
    missing = [k for keys, _ in plan.values() for k in keys if not ckpt.has(k)]
    unexpected = [k for k in ckpt.keys() if k.startswith(ckpt.prefix) and k[len(ckpt.prefix):] not in used]
    misshaped = []
    for key, (keys, how) in plan.items():
        if all(ckpt.has(k) for k in keys):
            got, want = _planned_shape(ckpt, keys, how), tuple(targets[key].shape)
            if got != want:
                misshaped.append(f"{'+'.join(keys)}: {got} in the file, {want} in the model ({key})")
    return missing, unexpected, misshaped


def _planned_shape(ckpt, keys, how):
    shapes = [ckpt.shape(k) for k in keys]
    if how != "cat":
        return shapes[0]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        return tuple(shapes)  # pieces that cannot be concatenated: reported as they are
    return (sum(s[0] for s in shapes),) + shapes[0][1:]


def planned_reader(ckpt, plan, combine):
    """read(key, target) for fill_: the file tensors `plan` names for `key`, each read in the target's dtype and
    device, then `combine(how, pieces)` (contiguous)."""
    def read(key, target):
        keys, how = plan[key]
        pieces = [ckpt.get_like(k, target) for k in keys]
        return combine(how, pieces).contiguous()
    return read


def layout_plan(ckpt, params, *, native, native_shapes, plan):
    """The plan load_planned_ takes for a model whose keys are those of its own layout `native` (a checkpoint in it
    is read key by key: the keys of `native_shapes(params)`) and that reads another layout by `plan(params)` ({key:
    (file keys, how, sizes)}, e.g. a diffusers plan)."""
    if ckpt.layout == native:
        return {k: ((k,), "copy") for k in native_shapes(params)}
    return {k: (keys, how) for k, (keys, how, _) in plan(params).items()}


def empty_model(checkpoint_class, path, model_class, *, infer, probes, params=None, dtype=None, device=None):
    """`model_class(params)` built under flame_nn.empty_init (no storage yet) on `device` for the checkpoint at
    `path` (opened with `checkpoint_class`): params inferred from it (`infer(ckpt)`) when not given, in `dtype`, by
    default the dtype stored in its tensor `probes[ckpt.layout]`."""
    with checkpoint_class(path) as ckpt:
        if params is None:
            params = infer(ckpt)
        if dtype is None:
            dtype = ckpt.stored_dtype(probes[ckpt.layout])
    with flame_nn.empty_init(device=device, dtype=dtype):
        return model_class(params)


def load_planned_(model, ckpt, plan, targets, combine, *, what, strict=True):
    """Load `targets` ({model key: tensor} of `model`) from an open checkpoint as `plan` says (see
    planned_mismatches; `combine(how, pieces)` joins a tensor's pieces): `ckpt.error` naming every missing,
    unexpected and misshaped tensor -- "cannot load the `what` checkpoint ..." -- before any is read (missing and
    unexpected ones only when `strict`), then fill_. Returns `model`."""
    missing, unexpected, misshaped = planned_mismatches(plan, targets, ckpt, what=type(model).__name__)
    check_mismatch(ckpt.error, f"cannot load the {what} checkpoint {ckpt.describe()}:", missing, unexpected,
                   misshaped, strict=strict)
    present = {k: targets[k] for k, (keys, _) in plan.items() if all(ckpt.has(f) for f in keys)}
    return fill_(model, planned_reader(ckpt, plan, combine), present, desc=f"loading {type(model).__name__}",
                 read_stored=stored_fp8_reader(ckpt, plan, combine))


# ----------------------------------------------------------------------------- fp8 storage as the weights are read
_FP8_ON_READ = contextvars.ContextVar("fp8_on_read", default=None)
_E4M3 = flame.float8_e4m3fn.np


@contextlib.contextmanager
def fp8_on_read(stacks, *, per_tensor=False, device=None, keep=None):
    """Within it, `fill_` gives the weight of every plain Linear under the module paths `stacks` (a model's block
    ModuleLists: "double_blocks", ...; or a function of the model giving them, a family's block_stacks) fp8 storage
    as it reads it (flame_nn.offload.set_fp8_weight_, float8_e4m3fn with a scale per output row, computing in the
    model's dtype): the weight is never held whole in the model's dtype, so a model loaded for fp8 storage needs the
    memory of its fp8 bytes, not of its bfloat16 ones. A weight the file stores as float8_e4m3fn keeps its bytes and
    the file's scales (nothing re-rounded); another is quantised per row, as quantize_linear_weights_ does --
    per_tensor=True: with one scale per tensor (fp8 compute's operand format: quantize_linear_weights_(compute="fp8")
    then switches the layers without a second rounding). device: where those weights are read, quantised (a GPU's
    kernel: seconds for Flux, where NumPy takes minutes) and kept -- the device the model is placed on --; default
    each weight's own (the load's device). keep: where the fp8 weights then go instead ("cpu" for blocks a streamer
    will pack into host memory: the device holds one weight at a time)."""
    token = _FP8_ON_READ.set((stacks if callable(stacks) else tuple(stacks), per_tensor,
                              None if device is None else flame.device(device),
                              None if keep is None else flame.device(keep)))
    try:
        yield
    finally:
        _FP8_ON_READ.reset(token)


# ----------------------------------------------------------------------------- LoRAs merged as the weights are read
_MERGE_ON_READ = contextvars.ContextVar("merge_on_read", default=None)


@contextlib.contextmanager
def merge_on_read(merger):
    """Within it, `fill_` passes each weight that `merger.keys(model)` names ({model key}) through `merger(key,
    tensor)` -- a LoRA merged in (pipeline.merged_loras.MergedLoRAs) -- as it reads it: before fp8_on_read's
    quantisation (a file's stored fp8 weight is read dequantised, merged and quantised again), before a streamer
    packs it, with no second copy of the model. A key the load does not read is merger.error naming it; when the
    load returns, merger.check() (when it has one) raises for a merged weight that is not finite."""
    token = _MERGE_ON_READ.set(merger)
    try:
        yield
    finally:
        _MERGE_ON_READ.reset(token)
    check = getattr(merger, "check", None)   # the load returned: the merged weights' finiteness, read once
    if check is not None:
        check()


def stored_fp8_reader(ckpt, plan=None, combine=None):
    """read_stored(key, target) for fill_: (q float8_e4m3fn, scales float32 (rows,)), on the target's device, of a
    model weight whose file tensors
    (`plan[key]`'s, joined by `combine` as the weight is; without a plan, the key's own) are all stored as
    float8_e4m3fn -- read as stored, with the file's scales (ComfyUI's scale_weight) or ones --, else None."""
    def read(key, target):
        keys, how = plan[key] if plan is not None else ((key,), "copy")
        if any(ckpt.dtype(k) != _E4M3 for k in keys) or len(ckpt.shape(keys[0])) != 2:
            return None
        qs, scales = [], []
        for k in keys:
            q = ckpt.get_stored(k, device=target.device)
            s = ckpt.scale(k, device=target.device)
            qs.append(q)
            scales.append(flame.ones(q.shape[0], dtype=flame.float32, device=q.device) if s is None else s)
        if combine is None:
            return qs[0], scales[0]
        return combine(how, qs).contiguous(), combine(how, scales).contiguous()
    return read


class _Placed:
    """What a reader reads of its target (dtype, device, shape), on another device: fp8_on_read's."""
    __slots__ = ("dtype", "device", "shape")

    def __init__(self, dtype, device, shape):
        self.dtype, self.device, self.shape = dtype, device, shape


def _fp8_targets(model, targets, stacks):
    """{key: Linear} of the targets that are the weights of plain Linears under the module paths `stacks`."""
    out = {}
    for key in targets:
        if not key.endswith(".weight") or not key.startswith(tuple(s + "." for s in stacks)):
            continue
        m = model.get_submodule(key[:-len(".weight")])
        if isinstance(m, flame_nn.Linear) and not is_fp8_linear(m) and m.weight.dtype.is_floating_point:
            out[key] = m
    return out


def fill_(model, read, targets, *, desc="loading", progress=True, read_stored=None):
    """Make `read(key, target)` -- a tensor in the target's dtype and device -- the storage of each of `targets`
    ({model key: parameter or buffer}, usually meta placeholders), one tensor at a time without recording grads,
    with a progress bar for loads over PROGRESS_BYTES. Returns `model`. Inside `fp8_on_read(stacks)` the Linear
    weights under `stacks` get fp8 storage as they are read: `read_stored(key, target)` -> (q, scales) of a weight
    stored in fp8 (stored_fp8_reader), or None (then the weight read is quantised). Inside `merge_on_read(merger)`
    the weights it names are merged as they are read, before any of that."""
    stacks, per_tensor, device, keep = _FP8_ON_READ.get() or ((), False, None, None)
    if callable(stacks):
        stacks = tuple(stacks(model))
    fp8 = _fp8_targets(model, targets, stacks) if stacks else {}
    merger = _MERGE_ON_READ.get()
    merged = merger.keys(model) if merger is not None else frozenset()
    unread = sorted(merged - set(targets))
    if unread:
        raise merger.error(f"{merger.describe()}: adapts {listing(unread, 6)}, which this load of "
                           f"{type(model).__name__} does not read")
    nbytes = sum(t.numel() * t.dtype.itemsize for t in targets.values())
    state = {}
    with flame.no_grad():
        for key, target in tqdm(targets.items(), desc=desc, unit="tensor", leave=False,
                                disable=not progress or nbytes < PROGRESS_BYTES):
            linear = fp8.get(key)
            if linear is None:
                t = read(key, target)
                state[key] = merger(key, t) if key in merged else t
                continue
            work = device if device is not None else target.device     # where a weight is quantised
            dst = keep if keep is not None else work                      # where its fp8 storage stays
            # a file's fp8 bytes go straight where they stay; another weight is read and quantised on `work`
            stored = read_stored(key, _Placed(target.dtype, dst, tuple(target.shape))) \
                if read_stored and key not in merged else None
            if stored is not None:
                q, scales = stored
            else:
                w = read(key, target if work == target.device else _Placed(target.dtype, work, tuple(target.shape)))
                q, scales = quantize_fp8(merger(key, w) if key in merged else w, per_tensor=per_tensor)
                if q.device != dst:
                    q, scales = q.to(dst), scales.to(dst)
            set_fp8_weight_(linear, q, scales, target.dtype)
    # assign=True: each tensor read becomes the model's storage (no second copy of the model)
    model.load_state_dict(state, strict=False, assign=True)
    return model


def config_argument(config, cls, infer, *, caller):
    """The config a load_* function builds its model with, from its `config` argument: a `cls` instance as is, None
    or a dict of fields to override -> `infer(config)` (read from the checkpoint); TypeError otherwise."""
    if isinstance(config, cls):
        return config
    if config is None or isinstance(config, dict):
        return infer(config)
    raise TypeError(f"{caller}: config must be a {cls.__name__}, a dict of {cls.__name__} fields or None, got "
                    f"{type(config).__name__}")


def preset(name_or_config, cls, presets, *, what, error=ValueError):
    """A `cls` instance passed through, or the preset of that name in `presets`; `error` naming the known presets
    ("unknown `what` config ...") otherwise."""
    if isinstance(name_or_config, cls):
        return name_or_config
    try:
        return presets[name_or_config]
    except (KeyError, TypeError):
        raise error(f"unknown {what} config {name_or_config!r}; known: {', '.join(presets)}") from None


def compute_dtype(stored):
    """The dtype to compute in for weights stored as `stored`: itself when it is a float dtype models compute in,
    bfloat16 for fp8 storage."""
    return stored if stored in COMPUTE_DTYPES else flame.bfloat16
