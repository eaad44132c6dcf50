"""Samples during training: each sampling step writes the prompts' latents (safetensors) and, with a VAE, one
decoded PNG per prompt; the grid of every sampling step (rows = prompts, columns = steps) is rebuilt from those files
after a resume, so it keeps its earlier columns. Without a VAE the grid shows latent projections, labelled so."""
import copy
import dataclasses
import os
import re
from typing import NamedTuple

import numpy as np

from flame_core import io
from flame_nn import adapters as A

from .preview import PROJECTION_TITLE, projection_images, save_image, save_image_grid, to_uint8
from .prompt_options import true_cfg_of


class PreviewPrompt(NamedTuple):
    label: str              # the row's label: the prompt text, or where the conditioning came from
    cond: dict              # the family's conditioning arrays (sample_keys[1:])
    ref: object = None      # the training latents (C, h, w) of a dataset item the prompt belongs to, or None
    options: object = None  # the prompt's own flags (prompt_options.PromptOptions: size, seed, steps, guidance,
                            # sampler), or None: sample.*'s


class Previews:
    """The sample prompts of a run and the samples made so far. `decode(latents (N, C, h, w)) -> images (N, 3, H,
    W) in [-1, 1]`, or None for latent projections. Size: sample.width / height (the trainer defaults them to the
    dataset's resolution); a prompt's flags (PreviewPrompt.options: --w, --h, --d, --s, --l, --ss) override sample.*
    for it, and its --m weighs the model's adapters ("default") while it samples."""

    def __init__(self, family, cfg, prompts, folder, device, decode=None, verbose=True):
        self.family, self.cfg, self.folder, self.device, self.verbose = family, cfg, folder, device, verbose
        self.prompts = list(prompts)
        self.decode = decode
        self.history = []        # [(step, [per prompt: (H, W, 3) uint8 image, or (C, h, w) latents])]
        self.refs = None         # the "data" column (decoded once), when every prompt has a reference
        self.grid_columns = None  # the column labels of the last grid written

    def size(self, i):
        """(height, width) of prompt i's previews: its --h / --w, else sample.height / width."""
        sm, o = self.cfg.sample, self.prompts[i].options
        return (sm.height, sm.width) if o is None else o.size(sm.height, sm.width)

    def multiplier(self, i):
        """The adapters' weight while prompt i samples: its --m, else sample.network_multiplier; None for 1 (the
        weight they train at)."""
        o = self.prompts[i].options
        m = o.multiplier if o is not None and o.multiplier is not None else self.cfg.sample.network_multiplier
        return None if m == 1.0 else float(m)

    def image_path(self, step, i):
        return os.path.join(self.folder, f"step_{step:06d}_{i}.png")

    def _settings(self, i):
        """sample(...)'s arguments for prompt i: sample.*, with the prompt's flags where it has them."""
        sm, o = self.cfg.sample, self.prompts[i].options
        h, w = self.size(i)
        cfg = self.cfg
        if o is not None and o.sampler is not None:   # (--ss: the family reads its sampler from the config)
            cfg = copy.copy(cfg)
            cfg.sample = dataclasses.replace(sm, sampler=o.sampler)

        def pick(name, default):
            v = None if o is None else getattr(o, name)
            return default if v is None else v
        args = dict(height=h, width=w, steps=pick("steps", sm.sample_steps),
                    guidance=pick("scale", sm.guidance_scale),
                    seed=pick("seed", sm.seed + (i if sm.walk_seed else 0)), **self.family.sample_options(cfg))
        if self.family.true_cfg:   # (Flux: its --l beside --g, else sample.true_cfg; from sample.true_cfg_start)
            args.update(true_cfg=true_cfg_of(o, sm), true_cfg_start=sm.true_cfg_start)
        return args

    def run(self, model, step, progress_file=None):
        """Sample every prompt at `step` with the model as it is (the caller swaps EMA weights in); returns the
        step's files (per prompt PNGs with a VAE, else the latents file)."""
        fam = self.family
        settings = [self._settings(i) for i in range(len(self.prompts))]
        bar = _bar(sum(a["steps"] for a in settings), f"sample @ {step}", self.verbose, progress_file)
        lat = []
        try:
            for i, args in enumerate(settings):
                p, m = self.prompts[i], self.multiplier(i)
                if m is not None:   # --m / sample.network_multiplier: the adapters' weight for this prompt
                    A.set_adapter_weight(model, "default", m)
                try:
                    z = fam.sample(model, p.cond, device=self.device,
                                   callback=(lambda k, n: bar.update(1)) if bar is not None else None, **args)
                finally:
                    if m is not None:
                        A.set_adapter_weight(model, "default", 1.0)
                lat.append(z[0].float().cpu().numpy())
        finally:
            if bar is not None:
                bar.close()
        os.makedirs(self.folder, exist_ok=True)
        lat_path = os.path.join(self.folder, f"step_{step:06d}.safetensors")
        io.save_file(_latents_file(lat), lat_path,
                     metadata={"step": str(step), "prompts": "\n".join(p.label for p in self.prompts)})
        if self.decode is None:  # the step's row of latent projections
            entry = lat
            written = [save_image_grid(projection_images([lat]), os.path.join(self.folder, f"step_{step:06d}.png"),
                                       col_labels=[p.label for p in self.prompts], title=PROJECTION_TITLE), lat_path]
        else:
            entry = self._decode(lat)
            written = [self._save_png(img, self.image_path(step, i)) for i, img in enumerate(entry)]
        self.history = [(s, x) for s, x in self.history if s != step] + [(step, entry)]
        return written

    def _decode(self, lat):
        """[(H, W, 3) uint8 per prompt]: the latents decoded, those of one size together."""
        out = [None] * len(lat)
        for shape in dict.fromkeys(x.shape for x in lat):
            idx = [i for i, x in enumerate(lat) if x.shape == shape]
            for i, img in zip(idx, to_uint8(self.decode(np.stack([lat[i] for i in idx])))):
                out[i] = img
        return out

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
        lat = _read_latents(lat_path)
        if len(lat) != len(self.prompts):
            return None
        if self.decode is None:
            return list(lat)
        from PIL import Image
        paths = [self.image_path(step, i) for i in range(len(self.prompts))]
        if all(os.path.isfile(p) for p in paths):
            return [np.asarray(Image.open(p).convert("RGB")) for p in paths]
        return self._decode(lat)

    def save_grid(self, path):
        """Rows: prompts (labelled); columns: the prompt's training image (when known and of the sample size),
        then each sampling step of the run (labelled)."""
        if not self.history:
            return None
        shapes = [x.shape for x in self.history[-1][1]]     # (each prompt's size: its --w / --h)
        hist = [(s, x) for s, x in self.history if [y.shape for y in x] == shapes]
        size = shapes[0]
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


def _latents_file(lat):
    """The step's latents file: "latents" (N, C, h, w) when every prompt has one size, else "latents_<i>" each."""
    if len({x.shape for x in lat}) == 1:
        return {"latents": np.stack(lat)}
    return {f"latents_{i}": x for i, x in enumerate(lat)}


def _read_latents(path):
    """[(C, h, w) per prompt] of a step's latents file (_latents_file's either layout)."""
    t = io.load_file(path)
    if "latents" in t:
        return list(t["latents"].numpy())
    n = len([k for k in t if re.fullmatch(r"latents_\d+", k)])
    return [t[f"latents_{i}"].numpy() for i in range(n)]


def _bar(total, desc, enabled, file):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=file)
