"""The loss log (CSV written as training goes, JSON at checkpoints and the end) and the loss-curve PNG.

Columns: step, loss (the mean over the steps since the previous row -- `log_every` of them -- of each optimizer
step's mean over its micro-batches), lr (at the row's step), timestep (the mean timestep drawn: σ for flow
matching), seconds (training time so far, pauses excluded, earlier runs of a resumed one included). On resume the
log is cut back to the checkpoint's step, so a curve never holds two versions of one step. The JSON and the plot are
written atomically; the plot uses matplotlib when it is installed, else a small Pillow drawing. A validation loss
(validation_loss.py) has its own log, validation.csv / .json (step, loss, the loss at each of its timesteps,
seconds), and its curve is drawn in the same plot.
"""
import csv
import io
import json
import os

from flame_core.io import atomic_write, write_json

FIELDS = ("step", "loss", "lr", "timestep", "seconds")


class LossLog:
    def __init__(self, folder, name="loss", fields=FIELDS):
        os.makedirs(folder, exist_ok=True)
        self.fields = tuple(fields)
        self.csv_path = os.path.join(folder, f"{name}.csv")
        self.json_path = os.path.join(folder, f"{name}.json")
        self.rows = []

    def append(self, **row):
        row = {k: row.get(k) for k in self.fields}
        self.rows.append(row)
        new = not os.path.exists(self.csv_path)
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields)
            if new:
                w.writeheader()
            w.writerow(row)

    def truncate(self, step):
        """Keep rows up to and including `step` (resume) and rewrite both files."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        self.flush()

    def flush(self):
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=self.fields)
        w.writeheader()
        w.writerows(self.rows)
        with atomic_write(self.csv_path) as f:
            f.write(buf.getvalue().encode("utf-8"))
        write_json(self.json_path, {"fields": list(self.fields), "rows": self.rows}, indent=None)

    def load(self):
        """Rows from the JSON (or CSV) a previous run left (for resume)."""
        if os.path.exists(self.json_path):
            with open(self.json_path) as f:
                self.rows = json.load(f)["rows"]
        elif os.path.exists(self.csv_path):
            with open(self.csv_path, newline="") as f:
                self.rows = [{k: (int(v) if k == "step" else float(v)) if v not in ("", None) else None
                              for k, v in r.items()} for r in csv.DictReader(f)]
        # (a resumed run may log other columns -- validation timesteps changed: the old rows keep what they share)
        self.rows = [{k: r.get(k) for k in self.fields} for r in self.rows]
        return self.rows


def smooth(values, beta=0.9):
    """Bias-corrected exponential moving average (what TensorBoard's smoothing shows)."""
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta ** i))
    return out


def plot_losses(rows, path, title="training loss", ylabel="loss", validation=None):
    """Loss per step (faint) and its smoothed curve (bold), as a PNG; `validation`: rows of a validation loss,
    drawn beside it (points joined by a line)."""
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    if not steps:
        raise ValueError("plot_losses: no rows to plot")
    val = [(r["step"], r["loss"]) for r in validation or () if r.get("loss") is not None]
    sm = smooth(losses)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(steps, losses, sm, path, title, val)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    ax.plot(steps, sm, color="tab:blue", lw=2, label="smoothed")
    if val:
        ax.plot(*zip(*val), color="tab:orange", lw=1.5, marker="o", ms=4, label="validation")
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


def _plot_pillow(steps, losses, sm, path, title, val=()):
    from PIL import Image, ImageDraw
    W, H, pad = 700, 400, 40
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    lo, hi = min(losses + [v for _, v in val]), max(losses + [v for _, v in val])
    hi = hi if hi > lo else lo + 1.0
    first, last = min(steps + [s for s, _ in val]), max(steps + [s for s, _ in val])
    s0, s1 = first, last if last > first else first + 1

    def xy(s, v):
        return pad + (s - s0) / (s1 - s0) * (W - 2 * pad), H - pad - (v - lo) / (hi - lo) * (H - 2 * pad)

    d.rectangle([pad, pad, W - pad, H - pad], outline="black")
    d.line([xy(s, v) for s, v in zip(steps, losses)], fill=(160, 190, 230), width=1)
    d.line([xy(s, v) for s, v in zip(steps, sm)], fill=(31, 119, 180), width=3)
    orange = (255, 127, 14)
    if len(val) > 1:
        d.line([xy(s, v) for s, v in val], fill=orange, width=2)
    for s, v in val:
        x, y = xy(s, v)
        d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=orange)
    d.text((pad, 10), f"{title}  (steps {s0}-{last}, loss {lo:.3g}-{hi:.3g})"
           + ("; orange: validation" if val else ""), fill="black")
    from .preview import save_image
    return save_image(img, path)
