"""Diffusion LoRA training: one model-agnostic trainer, model families that plug into it (family.py; each family's
plug-in is its folder's family.py, named by flame_models.registry: Flux, SD3 / SD3.5, SDXL), the flow-matching and
DDPM objectives, timestep sampling, config, data, checkpoints, EMA, logging and progress."""
from .timesteps import sample_sigmas, TIMESTEP_TYPES, flux_mu, flux_time_shift, shift_sigmas, mode_sigmas
from .objective import (noisy_latents, velocity_target, flow_matching_loss, weighted_mse, sd3_loss_weights,
                        WEIGHTING_SCHEMES, FlowMatching)
from .ddpm_objective import DDPM
from .config import TrainConfig, ConfigError, load_config, config_from_dict
from .validation import validate
from .family import ModelFamily, ModelFileError, get_family, register_family, available_families
from .data import FolderDataset, SyntheticDataset, ConcatDataset, Loader, DatasetError, write_sample
from .ema import EMA
from .logging import LossLog, plot_losses
from .progress import Progress
from .trainer import Trainer
