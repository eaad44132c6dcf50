"""The loss log (CSV written as training goes, JSON at checkpoints and the end) and the loss-curve PNG.

Columns: step, loss (the mean over the steps since the previous row -- `log_every` of them -- of each optimizer
step's mean over its micro-batches), lr (at the row's step), timestep (the mean timestep drawn: σ for flow
matching), seconds (training time so far, pauses excluded, earlier runs of a resumed one included). On resume the
log is cut back to the checkpoint's step, so a curve never holds two versions of one step. The JSON and the plot are
written atomically; the plot uses matplotlib when it is installed, else a small Pillow drawing.
"""
import csv
import io
import json
import os

from flame_core.io import atomic_write, write_json

FIELDS = ("step", "loss", "lr", "timestep", "seconds")


class LossLog:
    def __init__(self, folder, name="loss"):
        os.makedirs(folder, exist_ok=True)
        self.csv_path = os.path.join(folder, f"{name}.csv")
        self.json_path = os.path.join(folder, f"{name}.json")
        self.rows = []

    def append(self, **row):
        row = {k: row.get(k) for k in FIELDS}
        self.rows.append(row)
        new = not os.path.exists(self.csv_path)
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)

    def truncate(self, step):
        """Keep rows up to and including `step` (resume) and rewrite both files."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        self.flush()

    def flush(self):
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(self.rows)
        with atomic_write(self.csv_path) as f:
            f.write(buf.getvalue().encode("utf-8"))
        write_json(self.json_path, {"fields": list(FIELDS), "rows": self.rows}, indent=None)

    def load(self):
        """Rows from the JSON (or CSV) a previous run left (for resume)."""
        if os.path.exists(self.json_path):
            with open(self.json_path) as f:
                self.rows = json.load(f)["rows"]
        elif os.path.exists(self.csv_path):
            with open(self.csv_path, newline="") as f:
                self.rows = [{k: (int(v) if k == "step" else float(v)) if v not in ("", None) else None
                              for k, v in r.items()} for r in csv.DictReader(f)]
        return self.rows


def smooth(values, beta=0.9):
    """Bias-corrected exponential moving average (what TensorBoard's smoothing shows)."""
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta ** i))
    return out


def plot_losses(rows, path, title="training loss", ylabel="loss"):
    """Loss per step (faint) and its smoothed curve (bold), as a PNG."""
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    if not steps:
        raise ValueError("plot_losses: no rows to plot")
    sm = smooth(losses)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(steps, losses, sm, path, title)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    ax.plot(steps, sm, color="tab:blue", lw=2, label="smoothed")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    with atomic_write(path) as f:
        f.write(buf.getvalue())
    return path


def _plot_pillow(steps, losses, sm, path, title):
    from PIL import Image, ImageDraw
    W, H, pad = 700, 400, 40
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    lo, hi = min(losses), max(losses)
    hi = hi if hi > lo else lo + 1.0
    s0, s1 = steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1

    def xy(s, v):
        return pad + (s - s0) / (s1 - s0) * (W - 2 * pad), H - pad - (v - lo) / (hi - lo) * (H - 2 * pad)

    d.rectangle([pad, pad, W - pad, H - pad], outline="black")
    d.line([xy(s, v) for s, v in zip(steps, losses)], fill=(160, 190, 230), width=1)
    d.line([xy(s, v) for s, v in zip(steps, sm)], fill=(31, 119, 180), width=3)
    d.text((pad, 10), f"{title}  (steps {s0}-{steps[-1]}, loss {lo:.3g}-{hi:.3g})", fill="black")
    from .preview import save_image
    return save_image(img, path)
