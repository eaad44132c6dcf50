"""Formatting of memory statistics: the `memory_stats()` dict, `memory_summary()` text and the OOM report.

Works on any accountant with the counters of `DevicePool` (device pools, the cpu tensor tracker, the pinned pool).
"""
import re

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def fmt_bytes(n):
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(x):
    """Bytes from an int or a string such as '24GiB', '12 GB', '512MiB' (None stays None)."""
    if x is None:
        return None
    if isinstance(x, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", x)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse memory size {x!r}; use bytes or a number with a unit such as '24GiB'")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"memory limit must be a number of bytes, a size string or None, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"memory limit must be >= 0 bytes, got {x}")
    return int(x)


def parse_budget(x, what="max_gpu_memory"):
    """Bytes of a memory budget as people write one -- the trainer's `max_gpu_memory` and the `--max-gpu-memory`
    flags, through this one function: a number with a unit ('12GiB', '24 GB', '512MiB'; KiB / MiB / GiB are powers
    of 1024, KB / MB / GB of 1000) or a bare number, which means GiB ('12' and 12 are 12 GiB, as in ai-toolkit's
    configs). It must be more than 0. ValueError naming `what` and the value otherwise (None stays None).
    (parse_size, under it, is the byte-level API: there a bare number means bytes, as in torch.cuda.)"""
    if x is None:
        return None
    bad = ValueError(f"{what}: a size such as '12GiB' or '24 GB', or a number of GiB, more than 0; got {x!r}")
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        raise bad
    if isinstance(x, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", x):
        x = float(x)
    try:
        n = int(x * (1 << 30)) if isinstance(x, (int, float)) else parse_size(x)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if not n > 0:
        raise bad
    return n


def stats_dict(acct):
    """PyTorch-style flat dict (`allocated_bytes.all.current`, ...) plus FLAME's cache counters."""
    d = {
        "allocated_bytes.all.current": acct.allocated,
        "allocated_bytes.all.peak": acct.peak_allocated,
        "allocated_bytes.all.allocated": acct.bytes_allocated_total,
        "allocated_bytes.all.freed": acct.bytes_freed_total,
        "reserved_bytes.all.current": acct.reserved,
        "reserved_bytes.all.peak": acct.peak_reserved,
        "requested_bytes.all.current": acct.requested,
        "allocation.all.current": acct.num_alloc - acct.num_free,
        "allocation.all.allocated": acct.num_alloc,
        "allocation.all.freed": acct.num_free,
        "segment.all.current": acct.num_device_alloc - acct.num_device_free,
        "num_alloc": acct.num_alloc,
        "num_free": acct.num_free,
        "cache_hits": acct.cache_hits,
        "cache_misses": acct.cache_misses,
        "num_splits": acct.num_splits,
        "num_merges": acct.num_merges,
        "num_device_alloc": acct.num_device_alloc,
        "num_device_free": acct.num_device_free,
        "num_alloc_retries": acct.num_alloc_retries,
        "num_ooms": acct.num_ooms,
        "limit": acct.limit,
    }
    class_bytes = getattr(acct, "class_bytes", None)
    if class_bytes is not None:
        for name, (a, r) in class_bytes().items():
            d[f"allocated_bytes.{name}_pool.current"] = a
            d[f"reserved_bytes.{name}_pool.current"] = r
    return d


def summary(acct, device):
    s = stats_dict(acct)
    lim = "none" if acct.limit is None else fmt_bytes(acct.limit)
    rows = [
        f"FLAME memory summary, device {device}  (limit {lim})",
        "-" * 64,
        f"{'':24}{'current':>14}{'peak':>14}",
        f"{'allocated':24}{fmt_bytes(acct.allocated):>14}{fmt_bytes(acct.peak_allocated):>14}",
        f"{'reserved':24}{fmt_bytes(acct.reserved):>14}{fmt_bytes(acct.peak_reserved):>14}",
        f"{'requested':24}{fmt_bytes(acct.requested):>14}",
        "-" * 64,
        f"allocations {s['num_alloc']}  frees {s['num_free']}  live {s['allocation.all.current']}",
        f"cache hits {s['cache_hits']}  misses {s['cache_misses']}  splits {s['num_splits']}  "
        f"merges {s['num_merges']}",
        f"device mallocs {s['num_device_alloc']}  device frees {s['num_device_free']}  "
        f"retries {s['num_alloc_retries']}  OOMs {s['num_ooms']}",
    ]
    if getattr(acct, "class_bytes", None) is not None:
        rows.append("-" * 64)
        rows.append(f"{'size class':24}{'allocated':>14}{'reserved':>14}")
        for name, (a, r) in acct.class_bytes().items():
            rows.append(f"{name:24}{fmt_bytes(a):>14}{fmt_bytes(r):>14}")
    top = largest_live(acct, 5)
    if top:
        rows.append("-" * 64)
        rows.append("largest live tensors:")
        rows.extend("  " + line for line in top)
    return "\n".join(rows)


def largest_live(acct, n=8):
    items = sorted(acct.live_items(), key=lambda it: -it[0])[:n]
    out = []
    for nbytes, shape, dtype, origin in items:
        what = f"{tuple(shape)} {dtype}" if shape is not None else "(no tensor recorded: an internal buffer)"
        out.append(f"{fmt_bytes(nbytes):>12}  {what}" + (f"  created at {origin}" if origin else ""))
    return out


def oom_message(acct, nbytes, rounded, class_name, freed_cache):
    from .tracking import is_tracking
    lim = "none" if acct.limit is None else fmt_bytes(acct.limit)
    lines = [
        f"FLAME out of memory on {acct.name}: tried to allocate {fmt_bytes(nbytes)} "
        f"(block of {fmt_bytes(rounded)}, {class_name}).",
        f"  allocated {fmt_bytes(acct.allocated)} by live tensors; reserved {fmt_bytes(acct.reserved)}; "
        f"limit {lim}" + (" (flame_core.memory.set_memory_limit)" if acct.limit is not None else ""),
    ]
    info = acct.device_info() if hasattr(acct, "device_info") else None
    if info is not None:
        free, total = info
        lines.append(f"  device: {fmt_bytes(free)} free of {fmt_bytes(total)}")
    if freed_cache is not None:
        lines.append(f"  cached blocks were released before giving up ({fmt_bytes(freed_cache)} returned to the "
                     f"device)")
    top = largest_live(acct, 8)
    if top:
        lines.append("  largest live tensors:")
        lines.extend("    " + line for line in top)
    if not is_tracking():
        lines.append("  (set FLAME_MEMORY_TRACKING=1 or flame_core.memory.set_tracking(True) to record where each "
                     "tensor was created)")
    return "\n".join(lines)
