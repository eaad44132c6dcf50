"""The budget matrix of bench/budgets.py: one JSON of rows (family, storage, budget, offload mode -> the run's
figures), filled over several GPU calls (each call's runs MERGED into the rows of the calls before), rendered into a
markdown page (the matrix and the detailed table) and an SVG plot (step time against budget, a line per family and
storage) -- written by hand, no plotting library needed.

    rows = load("docs/budget_matrix.json")           # [] when the file does not exist
    rows = merge(rows, new_rows)                      # a run replaces the row of the same key
    write_all(rows, out_dir)                          # budget_matrix.json / .md / .svg, each written whole or not

A row: family, storage, budget (GiB or None: unconstrained), offload_mode, step_ms, graph_step_ms, driver_peak_GiB,
graph_driver_peak_GiB, pool_peak_GiB, host_peak_rss_GiB, resident, streamed, offload_activations, offloaded_GiB,
outside_fp8, h2d_GB, h2d_s (copy seconds per step; `h2d_s_estimated` when it is bytes / H2D_GBPS),
host_blocks_GiB and activation_host_GiB (pinned host memory), error, commit, date. The hidden copy share is
computed here, against the unconstrained row of the same family and storage, whichever call measured it:
1 - max(0, step - unconstrained step) / copy time.
"""
import json
import math
import os

from common import slowed

KEY = ("family", "storage", "budget", "offload_mode")
FIGURES = ("step_ms", "graph_step_ms")


class MatrixError(ValueError):
    pass


def key_of(row):
    return tuple(row.get(k) for k in KEY)


def load(path):
    """The rows of the matrix file at `path` ([] when it does not exist); MatrixError names what is wrong."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise MatrixError(f"{path}: not a budget matrix JSON ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise MatrixError(f"{path}: expected {{\"rows\": [{{...}}, ...]}}")
    for k, r in enumerate(rows):
        missing = [f for f in ("family", "storage") if not isinstance(r.get(f), str)]
        b = r.get("budget", "absent")
        if missing or not (b is None or (isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0)):
            raise MatrixError(f"{path}: rows[{k}]: needs family and storage (strings) and budget (GiB > 0 or null), "
                              f"got {({f: r.get(f) for f in KEY})}")
    return rows


def _measured(row):
    return any(isinstance(row.get(f), (int, float)) for f in FIGURES)


def merge(old, new):
    """old rows with each new row in place of the old row of its key; a new row that measured nothing (it failed)
    keeps an old measured row, with the failure in its `last_error`. Sorted by family, storage, budget, mode."""
    out = {key_of(r): dict(r) for r in old}
    for r in new:
        k = key_of(r)
        prev = out.get(k)
        if prev is not None and _measured(prev) and not _measured(r):
            prev["last_error"] = r.get("error")
            continue
        out[k] = dict(r)
    return sorted(out.values(), key=_order)


def _order(r):
    b = r.get("budget")
    return (r.get("family") or "", r.get("storage") or "", b is None, b or 0, r.get("offload_mode") or "")


def hidden(ms, base_ms, copy_s):
    if not isinstance(ms, (int, float)) or not isinstance(base_ms, (int, float)) or not copy_s:
        return None
    return round(max(0.0, 1 - max(0.0, ms - base_ms) / 1e3 / copy_s), 3)


def with_hidden(rows):
    """The rows with `hidden` / `graph_hidden` against their family's and storage's unconstrained row."""
    base = {(r["family"], r["storage"]): r for r in rows if r.get("budget") is None}
    out = []
    for r in rows:
        r = dict(r)
        b = base.get((r["family"], r["storage"]))
        if r.get("budget") is not None and b is not None:
            r["hidden"] = hidden(r.get("step_ms"), b.get("step_ms"), r.get("h2d_s"))
            r["graph_hidden"] = hidden(r.get("graph_step_ms"), b.get("graph_step_ms"), r.get("h2d_s"))
        out.append(r)
    return out


def best_ms(r):
    """The row's step time as the trainer runs it: the CUDA-graph step where measured, else the eager one."""
    g, e = r.get("graph_step_ms"), r.get("step_ms")
    return g if isinstance(g, (int, float)) else e if isinstance(e, (int, float)) else None


def _columns(budgets):
    """The budgets present, ascending, unconstrained (None) last."""
    got = set(budgets)
    return sorted(b for b in got if b is not None) + ([None] if None in got else [])


def _budget_label(b):
    return "none" if b is None else f"{b:g} GiB"


def _cell(v, fmt="{}"):
    return "–" if v is None else fmt.format(v)


def _pinned(r):
    blocks, acts = r.get("host_blocks_GiB"), r.get("activation_host_GiB")
    if blocks is None:
        return "–"
    return f"{blocks + (acts or 0):.2f}" if r.get("streamed") else "–"  # (resident only: no host copies needed)


def _pct(h):
    return "–" if h is None else f"{100 * h:.0f}%"


def _chosen(rows):
    """Per (family, storage, budget) the row the matrix shows: offload 'auto' (what auto_fit plans) where there is
    one, else the first mode measured."""
    pick = {}
    for r in rows:
        k = (r["family"], r["storage"], r.get("budget"))
        cur = pick.get(k)
        if cur is None or (r.get("offload_mode") == "auto" and cur.get("offload_mode") != "auto"):
            pick[k] = r
    return pick


def markdown(rows, title="LoRA step at 1024² under GPU memory budgets"):
    rows = with_hidden(rows)
    pick = _chosen(rows)
    budgets = _columns(k[2] for k in pick)
    lines = [f"# {title}", "",
             "Generated by `bench/budgets.py` from `budget_matrix.json` (the runs of every GPU call merged; each row "
             "names its commit and date). Budgets are driver-observed device peaks (cudaMemGetInfo, polled). Cell: "
             "step ms (the CUDA-graph step where measured, else eager) / driver peak GiB; `does not fit`: auto_fit "
             "refused the budget; empty: not run yet.", "",
             "![step time against budget](budget_matrix.svg)", "",
             "| family | storage | " + " | ".join(_budget_label(b) for b in budgets) + " |",
             "|---|---|" + "---:|" * len(budgets)]
    for fam, st in sorted({(k[0], k[1]) for k in pick}):
        cells = []
        for b in budgets:
            r = pick.get((fam, st, b))
            if r is None:
                cells.append("")
            elif best_ms(r) is None:
                cells.append("does not fit" if "does not fit" in str(r.get("error") or "") or "below the minimum"
                             in str(r.get("error") or "") else "failed")
            else:
                peak = r.get("graph_driver_peak_GiB") if r.get("graph_step_ms") is not None else r.get(
                    "driver_peak_GiB")
                cells.append(f"{best_ms(r):.1f} / {_cell(peak)}")
        lines.append(f"| {fam} | {st} | " + " | ".join(cells) + " |")
    lines += ["", "## Every run", "",
              "res/str: resident / streamed blocks; offload: activation offload (the checkpointed block inputs in "
              "pinned host memory); hidden: the share of the host->device copy time hidden behind compute, 1 - "
              "max(0, step - unconstrained step) / copy time (copy time estimated from bytes where marked *); "
              "host RSS: the run's peak resident host memory (pinned buffers included); pinned: the blocks' host "
              "copies + the offloaded activations' buffers (the host memory streaming needs at least).", "",
              "| family | storage | budget | offload mode | res/str | offload | eager ms | graph ms | driver GiB e / g "
              "| pool GiB | host RSS GiB | pinned GiB | H2D GB/step | hidden e / g | commit | note |",
              "|---|---|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        est = "*" if r.get("h2d_s_estimated") else ""
        note = "; ".join(n for n in (str(r.get("error") or r.get("last_error") or "").replace("|", "/")[:90],
                                      str(r.get("note") or "").replace("|", "/"), clock_note(r.get("clocks"))) if n)
        lines.append(
            f"| {r['family']} | {r['storage']} | {_budget_label(r.get('budget'))} | {r.get('offload_mode') or ''} | "
            f"{_cell(r.get('resident'))}/{_cell(r.get('streamed'))} | "
            f"{'yes' if r.get('offload_activations') else 'no'} | {_cell(r.get('step_ms'))} | "
            f"{_cell(r.get('graph_step_ms'))} | {_cell(r.get('driver_peak_GiB'))} / "
            f"{_cell(r.get('graph_driver_peak_GiB'))} | {_cell(r.get('pool_peak_GiB'))} | "
            f"{_cell(r.get('host_peak_rss_GiB'))} | {_pinned(r)} | {_cell(r.get('h2d_GB'))} | "
            f"{_pct(r.get('hidden'))} / {_pct(r.get('graph_hidden'))}{est} | {r.get('commit') or ''} | {note} |")
    return "\n".join(lines) + "\n"


CLOCK_FLAG = 0.95  # a run whose median SM clock fell below this share of the rated clock is flagged


def clock_note(clocks):
    """'' or what held the GPU's clock down during the run's timed steps (bench/common.GpuClocks' summary): a power
    or thermal cap, or hardware slowdown, that kept the median SM clock below CLOCK_FLAG of the rated one (brief
    power-cap dips at the H200's ~630 W are routine and cost a few percent of the clock at worst), with the lowest
    SM clock seen."""
    if not isinstance(clocks, dict):
        return ""
    capped = slowed(clocks)
    median, rated = clocks.get("sm_mhz_median"), clocks.get("sm_mhz_rated")
    if not capped or not median or not rated or median >= CLOCK_FLAG * rated:
        return ""
    return (f"clock capped ({', '.join(capped)}): SM {clocks.get('sm_mhz_min')}-{clocks.get('sm_mhz_median')} of "
            f"{clocks.get('sm_mhz_rated')} MHz, {clocks.get('power_w_max')} W, {clocks.get('temp_c_max')} C")


# ----------------------------------------------------------------------------- the plot
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def svg(rows, width=720, height=420):
    """Step time (ms, the matrix's cells) against budget (GiB, the budgets in order, 'none' last): a polyline per
    family and storage (fp8 solid, bf16 and fp8c dashed), a marker per measured point."""
    pick = _chosen(with_hidden(rows))
    series = {}
    for (fam, st, b), r in pick.items():
        ms = best_ms(r)
        if ms is not None:
            series.setdefault((fam, st), []).append((b, ms))
    budgets = _columns(p[0] for pts in series.values() for p in pts)
    left, right, top, bottom = 70, 190, 40, 50
    pw, ph = width - left - right, height - top - bottom
    ymax = max([ms for pts in series.values() for _, ms in pts], default=1.0)
    ystep = _nice_step(ymax / 5)
    ytop = ystep * (int(ymax / ystep) + 1)
    xs = {b: left + (pw * (k + 0.5) / max(1, len(budgets))) for k, b in enumerate(budgets)}

    def y(v):
        return top + ph * (1 - v / ytop)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">LoRA step at 1024² against the GPU memory budget</text>']
    v = 0.0
    while v <= ytop + 1e-9:
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + pw}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v += ystep
    for b, x in xs.items():
        out.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{_esc(_budget_label(b))}</text>')
    out.append(f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 12}" text-anchor="middle">budget (driver-observed '
               f'peak)</text>')
    out.append(f'<text transform="translate(18 {top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">step ms'
               f'</text>')
    fams = sorted({f for f, _ in series})
    for k, (fam, st) in enumerate(sorted(series)):
        color = _COLORS[fams.index(fam) % len(_COLORS)]
        pts = sorted(series[(fam, st)], key=lambda p: budgets.index(p[0]))
        dash = ' stroke-dasharray="6 4"' if st != "fp8" else ""
        coords = " ".join(f"{xs[b]:.1f},{y(ms):.1f}" for b, ms in pts)
        if len(pts) > 1:
            out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for b, ms in pts:
            out.append(f'<circle cx="{xs[b]:.1f}" cy="{y(ms):.1f}" r="3.5" fill="{color}">'
                       f'<title>{_esc(fam)} {_esc(st)} {_esc(_budget_label(b))}: {ms:.1f} ms</title></circle>')
        ly = top + 14 + 18 * k
        out.append(f'<line x1="{left + pw + 14}" y1="{ly - 4}" x2="{left + pw + 40}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + pw + 46}" y="{ly}">{_esc(fam)} {_esc(st)}</text>')
    if not series:
        out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph / 2:.1f}" text-anchor="middle">no run measured '
                   f'yet</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice_step(x):
    """The smallest of 1, 2, 2.5, 5 x a power of ten that is >= x (the y axis' tick step)."""
    if x <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(x))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= x * (1 - 1e-12))


# ----------------------------------------------------------------------------- files
def write_atomic(path, text):
    """`text` into `path` through a temp file, fsync and rename: the file is whole or untouched."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_all(rows, out_dir, stem="budget_matrix"):
    """`stem`.json (the rows), .md and .svg into `out_dir`; returns their paths."""
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "svg")]
    write_atomic(paths[0], json.dumps({"rows": rows}, indent=1, default=str) + "\n")
    write_atomic(paths[1], markdown(rows))
    write_atomic(paths[2], svg(rows))
    return paths
