"""Samplers for discrete ε / v-prediction diffusion models (SD-family: SDXL): the DDPM schedule, sigma tables
(normal / Karras / DDIM / DPM-Solver's, zero-terminal-SNR as an option), a denoiser wrapper and k-diffusion-style
samplers (Euler, Euler ancestral, DPM++ 2M, DDIM). The flow-matching models (Flux, SD3) have their own samplers."""
from .schedules import (DDPMSchedule, SPACINGS, ZERO_SNR_ALPHA_CUMPROD, scaled_linear_betas, linear_betas,
                        rescale_zero_terminal_snr, spaced_timesteps, karras_sigmas, get_sigmas, ddim_sigmas,
                        dpm_sigmas)
from .denoiser import Denoiser, PREDICTION_TYPES, check_prediction_type
from .k_samplers import (SAMPLERS, ancestral_sigmas, sample_euler, sample_euler_ancestral, sample_dpmpp_2m,
                         sample_ddim)

__all__ = ["DDPMSchedule", "SPACINGS", "ZERO_SNR_ALPHA_CUMPROD", "scaled_linear_betas", "linear_betas",
           "rescale_zero_terminal_snr", "spaced_timesteps", "karras_sigmas", "get_sigmas", "ddim_sigmas", "dpm_sigmas",
           "Denoiser", "PREDICTION_TYPES", "check_prediction_type", "SAMPLERS", "ancestral_sigmas", "sample_euler",
           "sample_euler_ancestral", "sample_dpmpp_2m", "sample_ddim"]
