"""Flux LoRA training: flow-matching objective, timestep sampling, config, data, trainer, EMA, logging, progress."""
from .timesteps import sample_sigmas, TIMESTEP_TYPES, flux_mu, flux_time_shift, shift_sigmas
from .objective import noisy_latents, velocity_target, flow_matching_loss
from .config import TrainConfig, ConfigError, load_config, config_from_dict, validate
from .data import FolderDataset, SyntheticDataset, Loader, DatasetError, write_sample
from .ema import EMA
from .logging import LossLog, plot_losses
from .progress import Progress
from .trainer import Trainer
