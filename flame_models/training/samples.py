"""Samples during training: each sampling step writes the prompts' latents (safetensors) and, with a VAE, one
decoded PNG per prompt; the grid of every sampling step (rows = prompts, columns = steps) is rebuilt from those files
after a resume, so it keeps its earlier columns. Without a VAE the grid shows latent projections, labelled so."""
import os
import re
from typing import NamedTuple

import numpy as np

from flame_core import io

from .preview import PROJECTION_TITLE, projection_images, save_image, save_image_grid, to_uint8


def split_ctrl_img(prompt):
    """(text, control image path or None) of a sample prompt: ai-toolkit's `--ctrl_img <path>` (Flux Kontext's
    previews: the image the prompt edits) taken out; the path runs to the next ` --` or the end (a path with spaces
    reads, as in ai-toolkit). '' when the flag has no path."""
    m = re.search(r"(?:^|\s)--ctrl_img(?=\s|$)", prompt)
    if m is None:
        return prompt, None
    rest = prompt[m.end():]
    nxt = re.search(r"\s--\S", rest)
    path = (rest[:nxt.start()] if nxt else rest).strip()
    return (prompt[:m.start()] + (rest[nxt.start():] if nxt else "")).strip(), path


class PreviewPrompt(NamedTuple):
    label: str          # the row's label: the prompt text, or where the conditioning came from
    cond: dict          # the family's conditioning arrays (sample_keys[1:])
    ref: object = None  # the training latents (C, h, w) of a dataset item the prompt belongs to, or None


class Previews:
    """The sample prompts of a run and the samples made so far. `decode(latents (N, C, h, w)) -> images (N, 3, H,
    W) in [-1, 1]`, or None for latent projections. Size: sample.width / height (the trainer defaults them to the
    dataset's resolution)."""

    def __init__(self, family, cfg, prompts, folder, device, decode=None, verbose=True):
        self.family, self.cfg, self.folder, self.device, self.verbose = family, cfg, folder, device, verbose
        self.prompts = list(prompts)
        self.decode = decode
        self.history = []        # [(step, [per prompt: (H, W, 3) uint8 image, or (C, h, w) latents])]
        self.refs = None         # the "data" column (decoded once), when every prompt has a reference
        self.grid_columns = None  # the column labels of the last grid written

    def size(self):
        return self.cfg.sample.height, self.cfg.sample.width

    def image_path(self, step, i):
        return os.path.join(self.folder, f"step_{step:06d}_{i}.png")

    def run(self, model, step, progress_file=None):
        """Sample every prompt at `step` with the model as it is (the caller swaps EMA weights in); returns the
        step's files (per prompt PNGs with a VAE, else the latents file)."""
        sm, fam = self.cfg.sample, self.family
        h, w = self.size()
        bar = _bar(len(self.prompts) * sm.sample_steps, f"sample @ {step}", self.verbose, progress_file)
        lat = []
        options = fam.sample_options(self.cfg)
        try:
            for i, p in enumerate(self.prompts):
                z = fam.sample(model, p.cond, height=h, width=w, steps=sm.sample_steps, guidance=sm.guidance_scale,
                               seed=sm.seed + (i if sm.walk_seed else 0), device=self.device,
                               callback=(lambda k, n: bar.update(1)) if bar is not None else None, **options)
                lat.append(z[0].float().cpu().numpy())
        finally:
            if bar is not None:
                bar.close()
        os.makedirs(self.folder, exist_ok=True)
        lat_path = os.path.join(self.folder, f"step_{step:06d}.safetensors")
        io.save_file({"latents": np.stack(lat)}, lat_path,
                     metadata={"step": str(step), "prompts": "\n".join(p.label for p in self.prompts)})
        if self.decode is None:  # the step's row of latent projections
            entry = lat
            written = [save_image_grid(projection_images([lat]), os.path.join(self.folder, f"step_{step:06d}.png"),
                                       col_labels=[p.label for p in self.prompts], title=PROJECTION_TITLE), lat_path]
        else:
            entry = to_uint8(self.decode(np.stack(lat)))
            written = [self._save_png(img, self.image_path(step, i)) for i, img in enumerate(entry)]
        self.history = [(s, x) for s, x in self.history if s != step] + [(step, entry)]
        return written

    @staticmethod
    def _save_png(img, path):
        from PIL import Image
        return save_image(Image.fromarray(img), path)

    def restore(self, upto_step):
        """The samples of earlier steps (<= upto_step) from their files: a resumed run's grid keeps its columns."""
        self.history = []
        if not os.path.isdir(self.folder):
            return self.history
        for name in sorted(os.listdir(self.folder)):
            m = re.fullmatch(r"step_(\d+)\.safetensors", name)
            if not m or int(m.group(1)) > upto_step:
                continue
            step = int(m.group(1))
            try:
                entry = self._restore_step(step, os.path.join(self.folder, name))
            except Exception:  # noqa: BLE001 - a damaged preview file costs its column, not the run
                continue
            if entry is not None:
                self.history.append((step, entry))
        return self.history

    def _restore_step(self, step, lat_path):
        lat = io.load_file(lat_path)["latents"].numpy()
        if len(lat) != len(self.prompts):
            return None
        if self.decode is None:
            return list(lat)
        from PIL import Image
        paths = [self.image_path(step, i) for i in range(len(self.prompts))]
        if all(os.path.isfile(p) for p in paths):
            return [np.asarray(Image.open(p).convert("RGB")) for p in paths]
        return to_uint8(self.decode(lat))

    def save_grid(self, path):
        """Rows: prompts (labelled); columns: the prompt's training image (when known and of the sample size),
        then each sampling step of the run (labelled)."""
        if not self.history:
            return None
        size = self.history[-1][1][0].shape
        hist = [(s, x) for s, x in self.history if x[0].shape == size]
        refs = self._refs(size)
        rows = [([refs[i]] if refs else []) + [x[i] for _, x in hist] for i in range(len(self.prompts))]
        cols = (["data"] if refs else []) + [f"step {s}" for s, _ in hist]
        labels = [p.label for p in self.prompts]
        self.grid_columns = cols
        if self.decode is None:
            return save_image_grid(projection_images(rows), path, col_labels=cols, row_labels=labels,
                                   title=PROJECTION_TITLE)
        return save_image_grid(rows, path, col_labels=cols, row_labels=labels)

    def _refs(self, size):
        """The data column: the prompts' training latents (decoded with a VAE), if all exist and fit `size`."""
        refs = [p.ref for p in self.prompts]
        if not refs or any(r is None for r in refs):
            return None
        if self.decode is None:
            return refs if all(r.shape == size for r in refs) else None
        if self.refs is None:
            if len({r.shape for r in refs}) != 1:
                return None
            self.refs = to_uint8(self.decode(np.stack(refs)))
        return self.refs if self.refs[0].shape == size else None


def _bar(total, desc, enabled, file):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=file)
