"""A discrete ε- or v-prediction model seen as a denoiser D(x, σ) ≈ x0 on the samplers' (VE) latents x = x0 + σ·ε.

    x_in = x / √(σ² + 1)                                  (the VP sample the model was trained on)
    ε-prediction:  D = x − σ · model(x_in, t)
    v-prediction:  D = x / (σ² + 1) − σ/√(σ² + 1) · model(x_in, t)
with t the timestep of σ (given by the sigma table, else looked up from σ as diffusers / k-diffusion do).
"""
import math

PREDICTION_TYPES = ("epsilon", "v_prediction")


def check_prediction_type(prediction_type):
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {', '.join(PREDICTION_TYPES)}, got {prediction_type!r}")
    return prediction_type


class Denoiser:
    """D(x, sigma, timestep=None) -> x0 estimate (float32). `model(x_in, t)` returns the prediction for the VP input
    x_in at the (possibly fractional) timestep t, a Python float; `schedule` a DDPMSchedule."""

    def __init__(self, model, schedule, prediction_type="epsilon"):
        self.model, self.schedule = model, schedule
        self.prediction_type = check_prediction_type(prediction_type)

    def __call__(self, x, sigma, timestep=None):
        sigma = float(sigma)
        t = self.schedule.sigma_to_t(sigma) if timestep is None else float(timestep)
        c_in = 1.0 / math.sqrt(sigma * sigma + 1.0)
        out = self.model(x * c_in, t).float()
        if self.prediction_type == "epsilon":
            return x - sigma * out
        return out * (-sigma * c_in) + x * (c_in * c_in)
