"""Experiment trackers beside the loss CSV: TensorBoard event files (tensorboardX, under <run folder>/tensorboard/
<run_name>) and Weights & Biases (wandb, offline unless WANDB_MODE says otherwise), as `logging:` asks.

Both are optional dependencies, imported only when asked for; a run that asks for one that is not installed stops
at set-up with the package to install. Scalars: train/loss (the log window's mean), train/lr per parameter group,
train/timestep, train/grad_norm (before clipping; with max_grad_norm > 0), train/step_seconds, train/memory_gib
(the device's peak, on CUDA), max_norm/keys_scaled, max_norm/average_key_norm and max_norm/max_key_norm (kohya's
figures; with train.scale_weight_norms); validation/loss and validation/loss_t<t> per timestep when `validation:` is set
(validation_loss.py); samples as images. On resume, TensorBoard discards the events a previous run wrote after the
checkpoint's step (purge_step), so a curve holds each step once.
"""
import importlib.util
import os
import time

import numpy as np

from .config import ConfigError


class TrackerError(ConfigError):
    """A tracker was asked for but cannot be used (its package is missing)."""


def check_available(logging_cfg):
    """TrackerError naming the package when `logging` asks for a tracker that is not installed (cheap: no import)."""
    if logging_cfg.use_tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise TrackerError("logging.use_tensorboard: tensorboardX is not installed; "
                           "pip install 'flame-diffusion[tensorboard]' (or tensorboardX)")
    if logging_cfg.use_wandb and importlib.util.find_spec("wandb") is None:
        raise TrackerError("logging.use_wandb: wandb is not installed; pip install wandb")


def _tensorboard_writer(folder, purge_step):
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise TrackerError("logging.use_tensorboard: tensorboardX is not installed; "
                           "pip install 'flame-diffusion[tensorboard]' (or tensorboardX)") from e
    # tensorboardX names the file by the second and the host: a run resumed within the same second (same process)
    # would open the same name and overwrite the first run's events, so the name also gets the pid and nanoseconds
    return SummaryWriter(logdir=folder, purge_step=purge_step, flush_secs=30,
                         filename_suffix=f".{os.getpid()}.{time.time_ns()}")


def _wandb_run(project, name, folder, config, resume_step):
    try:
        import wandb
    except ImportError as e:
        raise TrackerError("logging.use_wandb: wandb is not installed; pip install wandb") from e
    os.environ.setdefault("WANDB_MODE", "offline")  # no network needed unless the user says so
    return wandb.init(project=project, name=name, dir=folder, config=config,
                      resume="allow" if resume_step else None)


class Trackers:
    """The trackers of one run; every method is a no-op for what is not enabled."""

    def __init__(self, logging_cfg, run_folder, run_name, config=None, resume_step=0):
        name = logging_cfg.run_name or run_name
        self.tb = self.wandb = None
        if logging_cfg.use_tensorboard:
            self.tb = _tensorboard_writer(os.path.join(run_folder, "tensorboard", name),
                                          resume_step + 1 if resume_step else None)
        if logging_cfg.use_wandb:
            self.wandb = _wandb_run(logging_cfg.project_name, name, run_folder, config, resume_step)

    @property
    def enabled(self):
        return self.tb is not None or self.wandb is not None

    def scalars(self, step, values):
        """values: {tag: number}; None values are left out."""
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None and values:
            self.wandb.log(values, step=step)

    def image(self, step, tag, image):
        """image: a uint8 HxWxC array (the samples grid)."""
        image = np.asarray(image)
        if self.tb is not None:
            self.tb.add_image(tag, image, step, dataformats="HWC")
        if self.wandb is not None:
            import wandb
            self.wandb.log({tag: wandb.Image(image)}, step=step)

    def flush(self):
        if self.tb is not None:
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
