"""What a setting will allocate, checked before it is allocated: a mistyped number (`--rank 1000000`, `steps: 1e12`,
`--width 100000`) is a one-line error naming the setting, not an out-of-memory machine or a traceback.

- train.steps: at most MAX_STEPS (the data's epochs, caption variants and schedules are laid out for the whole run),
  and steps x gradient_accumulation_steps at most MAX_MICRO_STEPS.
- adapter rank: at most min(in, out) of every targeted layer (a higher rank adds parameters, not capacity), and the
  adapters with their gradients and optimizer moments must fit the device (the memory budget, else the GPU's or the
  host's memory).
- generated images: each side at most MAX_SIDE pixels, and the image's latents, activations and pixels must fit the
  device (the budget, else the GPU's or the host's memory) -- estimated per pixel, before any model is loaded.
The functions return a message (or None); the caller raises its own error type (ConfigError, GenerateError).
"""
import math
import os

from flame_core.memory.stats import fmt_bytes

from .optimizers import STATE_BYTES  # the optimizer's state per trained parameter

MAX_STEPS = 10 ** 6
MAX_MICRO_STEPS = 10 ** 7
MAX_SIDE = 16384                    # pixels per side of a generated image
# device bytes per image pixel while generating one image: the transformer's activations (a token is 16x16 pixels:
# ~24 live (hidden,) bf16 rows of a 3072-wide block, ~150 KB, ~600 B per pixel), the latents, the decoded image in
# float32 (the VAE decodes in tiles above its tile size)
GENERATE_BYTES_PER_PIXEL = 640
HOST_BYTES_PER_PIXEL = 16           # the decoded image in float32 on the host, then 8-bit


def steps_problems(steps, accumulation, prefix=""):
    out = []
    if steps > MAX_STEPS:
        out.append(f"{prefix}train.steps: at most {MAX_STEPS:,} optimizer steps, got {steps:,} (the data's epochs and "
                   f"the schedule are laid out for the whole run)")
    elif steps * accumulation > MAX_MICRO_STEPS:
        out.append(f"{prefix}train.steps x gradient_accumulation_steps: at most {MAX_MICRO_STEPS:,} micro-batches, got "
                   f"{steps:,} x {accumulation:,}")
    return out


def device_memory(device, budget=None):
    """(bytes, what) that a run may use on `device`: the budget when given, else the GPU's total memory, else the
    host's physical memory (None where it cannot be told)."""
    if budget is not None:
        return int(budget), "max_gpu_memory"
    if getattr(device, "type", str(device)) == "cuda":
        import flame_core as flame
        return int(flame.cuda.mem_get_info(device)[1]), f"{device}'s memory"
    return host_memory(), "host memory"


def host_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _dims(mod, rows):
    """(in, out) of a targeted Linear (its rows) or Conv2d (in: in_channels x kernel)."""
    shape = tuple(mod.weight.shape)
    out = rows[1] - rows[0] if rows is not None else shape[0]
    return math.prod(shape[1:]), out


def adapter_problems(found, rank, kind, setting, device, budget=None, optimizer="adamw", dtype_bytes=4):
    """Problems of adapters of `rank` on the layers `found` ([(name, module, rows)] of find_targets): a rank above a
    layer's min(in, out), or adapters (values, gradients, optimizer moments) that do not fit the device."""
    if not found:
        return []
    dims = [(name, *_dims(mod, rows)) for name, mod, rows in found]
    if kind != "lokr":  # (LoKr's rank is that of a Kronecker factor: bounded by its own shapes)
        over = [(n, i, o) for n, i, o in dims if rank > min(i, o)]
        if over:
            n, i, o = min(over, key=lambda d: min(d[1], d[2]))
            return [(f"{setting}: rank {rank:,} exceeds min(in, out) of {len(over)} of the {len(dims)} targeted layers "
                    f"(e.g. {n}: {i} in, {o} out); at most {min(min(i, o) for _, i, o in dims):,} for these targets "
                    f"(a higher rank adds parameters, not capacity)")]
    factor = 2 if kind == "loha" else 1
    count = sum(factor * rank * (i + o) for _, i, o in dims) if kind != "lokr" else 0
    problem = adapter_fit_problem(count, len(dims), f"{setting}: rank {rank:,}", device, budget, optimizer, dtype_bytes)
    return [problem] if problem else []


def adapter_fit_problem(count, layers, what_makes, device, budget=None, optimizer="adamw", dtype_bytes=4):
    """Why `count` adapter parameters on `layers` layers (values, gradients, `optimizer`'s moments) do not fit
    `device` under `budget`, or None. what_makes: the setting that makes them, first in the message."""
    need = count * (2 * dtype_bytes + STATE_BYTES.get(optimizer, 8))       # value, gradient, moments
    have, what = device_memory(device, budget)
    if have is not None and need > have:
        return (f"{what_makes} makes {count:,} adapter parameters on {layers} layers, {fmt_bytes(need)} with their "
                f"gradients and optimizer moments: more than the {fmt_bytes(have)} of {what}")
    return None


def image_problem(width, height, batch_size, device, budget=None):
    """Why a `width` x `height` image (batches of `batch_size`) cannot be generated on `device`, or None."""
    for name, v in (("width", width), ("height", height)):
        if v > MAX_SIDE:
            return f"--{name} {v}: at most {MAX_SIDE} pixels per side"
    pixels = width * height * max(1, batch_size)
    need = pixels * GENERATE_BYTES_PER_PIXEL
    have, what = device_memory(device, budget)
    if have is not None and need > have:
        return (f"--width {width} --height {height}: {batch_size} image(s) of {width * height / 1e6:.0f} MP need about "
                f"{fmt_bytes(need)} for their latents and activations, more than the {fmt_bytes(have)} of {what}")
    host = host_memory()
    if host is not None and pixels * HOST_BYTES_PER_PIXEL > host:
        return (f"--width {width} --height {height}: the decoded images need {fmt_bytes(pixels * HOST_BYTES_PER_PIXEL)}"
                f" of host memory, more than its {fmt_bytes(host)}")
    return None
