"""Diffusion LoRA training: one model-agnostic trainer, model families that plug into it (family.py; each family's
plug-in is its folder's family.py, named by flame_models.registry: Flux, SD3 / SD3.5, SDXL), the flow-matching and
DDPM objectives, timestep sampling, config, checkpoints, EMA, logging and progress (the data: flame_models.data)."""
from .config import ConfigError, TrainConfig, config_from_dict, load_config
from .ddpm_objective import DDPM
from .ema import EMA
from .family import ModelFamily, ModelFileError, available_families, get_family, register_family
from .logging import LossLog, plot_losses
from .objective import (
                        WEIGHTING_SCHEMES,
                        FlowMatching,
                        flow_matching_loss,
                        noisy_latents,
                        sd3_loss_weights,
                        velocity_target,
                        weighted_mse,
)
from .progress import Progress
from .timesteps import TIMESTEP_TYPES, flux_mu, flux_time_shift, mode_sigmas, sample_sigmas, shift_sigmas
from .trainer import Trainer
from .validation import validate
