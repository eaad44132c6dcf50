"""The validation loss: the training objective's loss on held-out images (`validation:` -- a folder, or a split of the
training folders: flame_models/data/holdout.py) at fixed timesteps and fixed noise, so that its curve moves only
when the adapters do, and two runs' curves compare.

    v = ValidationLoss(data, family, objective, timesteps=[10, 350, 500, 650, 990], seed=42, batch_size=2,
                       device=dev)
    v.evaluate(model, autocast_dtype=dtype)   # {"loss": mean over images and timesteps, "per_timestep": [...]}

Every image is evaluated at every timestep (on the 0-1000 scale: flow matching takes σ = t / 1000 as given, with
no resolution shift; DDPM takes t as an integer). Image i's noise at timestep k is drawn on the CPU from a generator
seeded by (seed, the image's sample key -- folder, path, resolution --, k): the same whatever the batch size, the
device, the step or the run, and no draw touches the training's random streams. Batches hold images of one bucket
in the data's order (a bucket's last batch may be short); the text is the caption as written (no dropout, no tag
shuffling). The loss of an image at a timestep is the objective's (its weighting included: the same scale as the
training loss); the result is the mean over images and timesteps, and the mean over images per timestep.

It runs eagerly under no_grad, outside the step's CUDA graphs (the trainer gives a captured step's memory back
first, as for previews), in the trainer's autocast dtype, with the adapters the previews use (EMA / schedule-free
averaged weights when on) in eval mode (no adapter dropout); with block streaming the blocks stream as in a
preview, within the same budget (a forward without backward at most the training batch size needs less than a
training step).
"""
import numbers
from contextlib import nullcontext

import numpy as np

import flame_core as flame
from flame_core.amp import autocast
from flame_core.autograd import no_grad

from ..data.captions import stable_seed

DEFAULT_TIMESTEPS = (10, 350, 500, 650, 990)   # kohya sd-scripts' validation timesteps
NUM_TIMESTEPS = 1000
MAX_COUNT = 1000


def timestep_problems(value, path):
    """What is wrong with a `validation.timesteps` value (a count, or a list of numbers in [0, 1000))."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Number, list, str)):
        return [f"{path}: a count (e.g. 5) or a list of timesteps in [0, {NUM_TIMESTEPS}), got {value!r}"]
    if not isinstance(value, list):
        try:
            n = float(value)
        except ValueError:
            return [f"{path}: a count (e.g. 5) or a list of timesteps in [0, {NUM_TIMESTEPS}), got {value!r}"]
        if n != int(n) or not 1 <= n <= MAX_COUNT:
            return [f"{path}: a count is an integer from 1 to {MAX_COUNT}, got {value!r}"]
        return []
    if not value:
        return [f"{path}: an empty list; give timesteps in [0, {NUM_TIMESTEPS}) or a count"]
    e = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, numbers.Number) or not 0 <= t < NUM_TIMESTEPS:
            e.append(f"{path}[{i}]: a timestep in [0, {NUM_TIMESTEPS}) (flow matching: sigma = t / 1000), got {t!r}")
    return e


def timestep_values(value, integer=False):
    """The timesteps (0-1000 scale) a `validation.timesteps` value names: a list as given, a count N as
    1000 (i + 0.5) / N; integer: rounded down to whole timesteps (DDPM)."""
    if isinstance(value, list):
        ts = [float(t) for t in value]
    else:
        n = int(float(value))
        ts = [NUM_TIMESTEPS * (i + 0.5) / n for i in range(n)]
    return [float(np.floor(t)) for t in ts] if integer else ts


def noise_seed(seed, key, k):
    """The seed of an image's noise at its k-th validation timestep (key: the data's stable sample key)."""
    return stable_seed("validation-noise", seed, key, k)


class ValidationLoss:
    """The validation loss of `data` (a flame_models.data.TrainingDataset over the held-out images, caches filled)
    for a model `family` trained with `objective`: see the module docstring. `timesteps`: the config's value (a
    list or a count); `train_cfg`: the TrainSection family.training_inputs reads; `encode`: None, or a callable
    that turns a batch's token ids into conditioning (trained text encoders)."""

    def __init__(self, data, family, objective, *, timesteps=DEFAULT_TIMESTEPS, seed=42, batch_size=1,
                 max_batches=None, device="cpu", train_cfg=None, encode=None):
        self.data, self.family, self.objective = data, family, objective
        self.seed, self.device, self.train_cfg, self.encode = int(seed), flame.device(device), train_cfg, encode
        integer = getattr(objective, "name", None) == "ddpm"
        self.timesteps = timestep_values(list(timesteps) if not isinstance(timesteps, (int, float, str))
                                         else timesteps, integer=integer)
        # the objective's own timestep unit: σ for flow matching, the integer step for DDPM
        self.values = self.timesteps if integer else [t / NUM_TIMESTEPS for t in self.timesteps]
        self.batches = []
        for _, items in data.buckets().items():
            self.batches += [items[j:j + batch_size] for j in range(0, len(items), batch_size)]
        if max_batches is not None:
            self.batches = self.batches[:max_batches]
        if not self.batches:
            raise ValueError("validation: no held-out image to evaluate")
        self.num_images = sum(len(b) for b in self.batches)

    def columns(self):
        """The per-timestep names of a log row: loss_t10, loss_t350, ..."""
        return [f"loss_t{t:g}" for t in self.timesteps]

    def noise(self, indices, shape):
        """(B, *shape) float32 on the device: each image's own noise at each timestep -> list over timesteps."""
        keys = [self.data.dataset.samples[i].key for i in indices]
        out = []
        for k in range(len(self.values)):
            draws = [self.objective.sample_noise((1, *shape), device="cpu", generator=flame.Generator(
                "cpu").manual_seed(noise_seed(self.seed, key, k))).numpy() for key in keys]
            out.append(flame.tensor(np.concatenate(draws), device=self.device))
        return out

    def evaluate(self, model, autocast_dtype=None):
        """{"loss": the mean over images and timesteps, "per_timestep": [the mean over images at each timestep],
        "images": how many}. The caller puts the model in eval mode and the adapters it wants in place."""
        total = np.zeros(len(self.values))
        with no_grad():
            for idx in self.batches:
                batch = self.data.collate([self.data.get(i, 0) for i in idx])
                x0, cond = self.family.training_inputs(model, batch, self.device, self.train_cfg)
                b = x0.shape[0]
                for k, (noise, value) in enumerate(zip(self.noise(idx, tuple(x0.shape[1:])), self.values)):
                    t = flame.tensor(np.full(b, value, np.float32), device=self.device)
                    total[k] += float(self.loss(model, x0, noise, t, cond, autocast_dtype).item()) * b
        per_t = total / self.num_images
        return {"loss": float(per_t.mean()), "per_timestep": [float(x) for x in per_t], "images": self.num_images}

    def loss(self, model, x0, noise, t, cond, autocast_dtype=None):
        """The objective's loss of one batch at timesteps t with the given noise (what a training step computes)."""
        x_t = self.objective.noisy(x0, noise, t)
        with autocast(self.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext():
            c = self.encode(cond) if self.encode is not None else cond
            pred = self.family.forward(model, x_t, t, c)
        return self.objective.loss(pred, self.objective.target(x0, noise, t), t)


class ValidationStage:
    """The trainer's validation loss: a ValidationLoss of the run's held-out images, when it is due, and its log
    (<run>/validation.csv / .json: step, loss, loss_t<t> per timestep, seconds; cut back to the checkpoint's step on
    resume). `cfg`: the TrainConfig; `data`: the held-out images over the caches (image_data.Prepared.validation)."""

    def __init__(self, cfg, data, family, objective, *, device, encode=None):
        from .logging import LossLog
        v, t = cfg.validation, cfg.train
        self.every, self.last = v.every, t.steps
        self.loss = ValidationLoss(data, family, objective, timesteps=v.timesteps, seed=v.seed,
                                   batch_size=v.batch_size or t.batch_size, max_batches=v.max_batches, device=device,
                                   train_cfg=t, encode=encode)
        self.log = LossLog(cfg.output_dir, "validation", ("step", "loss", *self.loss.columns(), "seconds"))

    def describe(self):
        return (f"validation: {self.loss.num_images} held-out images at timesteps "
                f"{', '.join(f'{x:g}' for x in self.loss.timesteps)} every {self.every} steps")

    def due(self, step):
        """Before the first step, every `every` steps, and after the last."""
        return step % self.every == 0 or step == self.last

    def run(self, model, step, seconds, trackers=None, autocast_dtype=None):
        """Evaluate (the caller has the adapters in place, in eval mode) and log the row; returns it."""
        got = self.loss.evaluate(model, autocast_dtype)
        per_t = dict(zip(self.loss.columns(), got["per_timestep"]))
        self.log.append(step=step, loss=got["loss"], seconds=seconds, **per_t)
        if trackers is not None and trackers.enabled:
            trackers.scalars(step, {"validation/loss": got["loss"], **{f"validation/{k}": x for k, x in per_t.items()}})
        return {"step": step, **got}

    def resume(self, step):
        self.log.load()
        self.log.truncate(step)

    def results(self):
        """The log written whole, and the result entries of the run."""
        self.log.flush()
        return {"validation_csv": self.log.csv_path, "validation_json": self.log.json_path,
                "validation_losses": [(r["step"], r["loss"]) for r in self.log.rows]}
