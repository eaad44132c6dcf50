"""Samples during training: the prompts' conditioning, sampling with a progress bar, one file per step (a PNG row
and the latents as safetensors), and the grid of every sampling step -- rebuilt from those files after a resume."""
import os
import re

import numpy as np

from flame_core import io

from .preview import save_grid


class Previews:
    """The sample prompts of a run and the samples made so far.

    Prompts: the conditioning arrays of `sample.prompt_embeds` files, else those of the first `sample.num_samples`
    dataset items (whose latents then head the grid as a "data" column). Size: sample.width/height, which the
    trainer defaults to the dataset's resolution."""

    def __init__(self, family, cfg, dataset, folder, device, verbose=True):
        self.family, self.cfg, self.folder, self.device, self.verbose = family, cfg, folder, device, verbose
        keys = family.sample_keys[1:]
        sm = cfg.sample
        self.prompts = []                               # [(conditioning {key: array}, reference latents or None)]
        if sm.prompt_embeds:
            for path in sm.prompt_embeds:
                with io.safe_open(path) as f:
                    self.prompts.append(({k: f.get_array(k).astype(np.float32) for k in keys}, None))
        else:
            for i in range(min(sm.num_samples, len(dataset))):
                item = dataset[i]
                self.prompts.append(({k: item[k] for k in keys}, item["latents"]))
        self.history = []                               # [(step, [latents (C, h, w) per prompt])]

    def size(self):
        return self.cfg.sample.height, self.cfg.sample.width

    def run(self, model, step, progress_file=None):
        """Sample every prompt at `step` with the model as it is (the caller swaps EMA weights in); returns the
        step's PNG."""
        sm, fam = self.cfg.sample, self.family
        h, w = self.size()
        bar = _bar(len(self.prompts) * sm.sample_steps, f"sample @ {step}", self.verbose, progress_file)
        lat = []
        try:
            for i, (cond, _) in enumerate(self.prompts):
                z = fam.sample(model, cond, height=h, width=w, steps=sm.sample_steps, guidance=sm.guidance_scale,
                               seed=sm.seed + (i if sm.walk_seed else 0), device=self.device,
                               callback=(lambda k, n: bar.update(1)) if bar is not None else None)
                lat.append(z[0].float().cpu().numpy())
        finally:
            if bar is not None:
                bar.close()
        self.history = [(s, x) for s, x in self.history if s != step] + [(step, lat)]
        os.makedirs(self.folder, exist_ok=True)
        io.save_file({"latents": np.stack(lat)}, os.path.join(self.folder, f"step_{step:06d}.safetensors"),
                     metadata={"step": str(step)})
        return save_grid([[x] for x in lat], os.path.join(self.folder, f"step_{step:06d}.png"))

    def restore(self, upto_step):
        """The samples of earlier steps (<= upto_step) from their files: a resumed run's grid keeps its columns."""
        self.history = []
        if not os.path.isdir(self.folder):
            return self.history
        for name in sorted(os.listdir(self.folder)):
            m = re.fullmatch(r"step_(\d+)\.safetensors", name)
            if not m or int(m.group(1)) > upto_step:
                continue
            try:
                lat = io.load_file(os.path.join(self.folder, name))["latents"].numpy()
            except Exception:  # noqa: BLE001 - a damaged preview file costs its column, not the run
                continue
            if len(lat) == len(self.prompts):
                self.history.append((int(m.group(1)), list(lat)))
        return self.history

    def save_grid(self, path):
        """Rows: prompts; columns: the prompt's training latents (when known and of the sample size), then each
        sampling step of the run."""
        if not self.history:
            return None
        size = self.history[-1][1][0].shape
        hist = [(s, lat) for s, lat in self.history if lat[0].shape == size]
        refs = [r for _, r in self.prompts]
        use_ref = all(r is not None and r.shape == size for r in refs)
        rows = [([refs[i]] if use_ref else []) + [lat[i] for _, lat in hist] for i in range(len(self.prompts))]
        labels = (["data"] if use_ref else []) + [f"step {s}" for s, _ in hist]
        return save_grid(rows, path, labels=labels)


def _bar(total, desc, enabled, file):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=file)
