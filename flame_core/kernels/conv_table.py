"""The measured convolution table: for each convolution geometry that `bench/conv_tune.py` timed on a GPU, the
fastest algorithm of each pass (fwd, dx, dw) - im2col + cuBLAS, or the wgmma implicit GEMM with its tile and slices
over K - kept in conv_tuned.json next to this file, one section per compute capability.

    {"sm90": {"device": "NVIDIA H200", "commit": "...", "date": "...",
              "entries": {"fwd 2,320,128,128,320,3,3,1,1,1,1,1,1,128,128": {"algo": "wgmma", "plan": "128x256:s1",
                                                                      "ms": 0.159, "timed": {...}}, ...}}}

A key is the pass and the geometry N,C,H,W,O,KH,KW,sh,sw,ph,pw,dh,dw,OH,OW (ph, pw: the top and left padding; the
output size carries the bottom and right padding). `lookup` answers only for
geometries in the table; everything else keeps the size rule and the waves model of flame_core.ops.conv and
flame_core.kernels.conv. FLAME_CONV_ALGO / FLAME_CONV_WGMMA_TILE set by hand win over the table;
FLAME_CONV_TABLE=0 turns it off, FLAME_CONV_TABLE=<path> reads another file (the tuner's own runs).
"""
import json
import os
import pathlib

from .. import backend

TABLE_FILE = pathlib.Path(__file__).with_name("conv_tuned.json")
ALGOS = ("im2col", "wgmma")
PASSES = ("fwd", "dx", "dw")

_cache = {}  # (path, section) -> {key: entry}
_found = {}  # (path, section, pass, geometry) -> entry or None: what lookup answered (it runs per conv call)


def key(pass_, g):
    """The table key of one pass of a convolution geometry (flame_core.ops.conv.geometry)."""
    return f"{pass_} " + ",".join(str(int(v)) for v in (g.N, g.C, g.H, g.W, g.O, g.KH, g.KW, g.sh, g.sw, g.ph,
                                                          g.pw, g.dh, g.dw, g.OH, g.OW))


def table_path():
    """The table file in use, or None when FLAME_CONV_TABLE=0."""
    v = os.environ.get("FLAME_CONV_TABLE", "").strip()
    if v in ("0", "off", "false"):
        return None
    return pathlib.Path(v) if v else TABLE_FILE


def section_name():
    """The current device's section: 'sm' and its compute capability (sm90)."""
    from . import plans
    return f"sm{plans.compute_capability()}"


def load(path, section):
    """{key: entry} of one section of a table file, checked: a missing file or section is an empty table; a bad one
    raises ValueError naming the file, the key and the field."""
    ck = (str(path), section)
    if ck in _cache:
        return _cache[ck]
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        _cache[ck] = {}
        return _cache[ck]
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    entries = (doc.get(section) or {}).get("entries", {}) if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: section {section!r} must be an object with an 'entries' object")
    out = {}
    for k, e in entries.items():
        out[k] = check_entry(path, k, e)
    _cache[ck] = out
    return out


def check_entry(path, k, e):
    """One entry, checked: its key names a pass and 15 integers, its algo is one of ALGOS, a wgmma plan is 'TILE',
    'TILE:sN' or (fwd / dx) 'TILE:tN' of a known tile."""
    from .conv import WGMMA_TILES
    p, _, dims = k.partition(" ")
    parts = dims.split(",")
    if p not in PASSES or len(parts) != 15 or not all(s.lstrip("-").isdigit() for s in parts):
        raise ValueError(f"{path}: key {k!r} must be a pass ({', '.join(PASSES)}) and 15 integers "
                         f"N,C,H,W,O,KH,KW,sh,sw,ph,pw,dh,dw,OH,OW")
    if not isinstance(e, dict) or e.get("algo") not in ALGOS:
        raise ValueError(f"{path}: {k!r}: field 'algo' must be one of {', '.join(ALGOS)}, got "
                         f"{e.get('algo') if isinstance(e, dict) else e!r}")
    plan = e.get("plan")
    if e["algo"] == "wgmma" and plan is not None:
        plan = str(plan)
        sep = ":t" if ":t" in plan and p != "dw" else ":s"  # a tail split: fwd / dx only
        name, _, sn = plan.partition(sep)
        if name not in WGMMA_TILES or (sn and (not sn.isdigit() or int(sn) < (2 if sep == ":t" else 1))):
            raise ValueError(f"{path}: {k!r}: field 'plan' must be one of {sorted(WGMMA_TILES)}, optionally with "
                             f"':s<N>' (N >= 1){'' if p == 'dw' else ' or :t<N> (N >= 2)'}, got {plan!r}")
    return e


def lookup(pass_, g):
    """The measured entry of one pass of geometry g on the current CUDA device ({'algo': ..., 'plan': ...}), or None
    (not in the table, the table turned off, or no GPU)."""
    path = table_path()
    if path is None or not backend.cuda_available():
        return None
    ck = (path, section_name(), pass_, g)
    if ck not in _found:
        _found[ck] = load(path, ck[1]).get(key(pass_, g))
    return _found[ck]


def clear_cache():
    _cache.clear()
    _found.clear()
