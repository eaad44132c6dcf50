"""Samplers for discrete ε / v-prediction diffusion models (SD-family: SDXL): the DDPM schedule, sigma tables
(normal / Karras / DDIM / DPM-Solver's / KDPM2's / LCM's, zero-terminal-SNR as an option), a denoiser wrapper and
k-diffusion-style samplers (Euler, Euler ancestral, Heun, DPM2, DPM2 ancestral, DPM++ 2M, DPM++ 2M SDE, DDIM,
UniPC, LCM). The flow-matching models (Flux, SD3) have their own samplers."""
from .denoiser import PREDICTION_TYPES, Denoiser, check_prediction_type
from .k_samplers import (
                         DRAWS_NOISE,
                         SAMPLERS,
                         STOCHASTIC,
                         ancestral_sigmas,
                         sample_ddim,
                         sample_dpm_2,
                         sample_dpm_2_ancestral,
                         sample_dpmpp_2m,
                         sample_dpmpp_2m_sde,
                         sample_euler,
                         sample_euler_ancestral,
                         sample_heun,
                         sample_lcm,
                         sample_unipc,
)
from .schedules import (
                        LCM_ORIGINAL_STEPS,
                        SPACINGS,
                        ZERO_SNR_ALPHA_CUMPROD,
                        DDPMSchedule,
                        ddim_sigmas,
                        dpm_sigmas,
                        get_sigmas,
                        karras_sigmas,
                        kdpm2_sigmas,
                        lcm_sigmas,
                        linear_betas,
                        rescale_zero_terminal_snr,
                        scaled_linear_betas,
                        spaced_timesteps,
)

__all__ = ["DDPMSchedule", "SPACINGS", "ZERO_SNR_ALPHA_CUMPROD", "scaled_linear_betas", "linear_betas",
           "rescale_zero_terminal_snr", "spaced_timesteps", "karras_sigmas", "get_sigmas", "ddim_sigmas", "dpm_sigmas",
           "kdpm2_sigmas", "lcm_sigmas", "LCM_ORIGINAL_STEPS", "Denoiser", "PREDICTION_TYPES", "check_prediction_type",
           "SAMPLERS", "STOCHASTIC", "DRAWS_NOISE", "ancestral_sigmas", "sample_euler", "sample_euler_ancestral",
           "sample_heun", "sample_dpm_2", "sample_dpm_2_ancestral", "sample_dpmpp_2m", "sample_dpmpp_2m_sde",
           "sample_ddim", "sample_lcm", "sample_unipc"]
