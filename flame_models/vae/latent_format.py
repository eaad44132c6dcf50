"""LatentFormat: how a model family scales the VAE's latents (the VAE itself works on unscaled latents). Each family
states its own (its about.py; flame_models.registry.latent_format(name)).

    to_model(z)   = (z - shift_factor) * scaling_factor      what the diffusion model sees
    from_model(z) = z / scaling_factor + shift_factor        what the VAE decodes
"""
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LatentFormat:
    scaling_factor: float
    shift_factor: float = 0.0

    def __post_init__(self):
        if not self.scaling_factor:
            raise ValueError("LatentFormat: scaling_factor must be non-zero")

    def to_model(self, z):
        return (z - self.shift_factor) * self.scaling_factor

    def from_model(self, z):
        return z / self.scaling_factor + self.shift_factor

    @classmethod
    def from_diffusers_config(cls, config):
        """The scale and shift of a diffusers AutoencoderKL config (a dict, a config.json path or its folder);
        a missing or null shift_factor is 0."""
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        if "scaling_factor" not in config:
            raise KeyError("LatentFormat.from_diffusers_config: the config has no 'scaling_factor'")
        return cls(float(config["scaling_factor"]), float(config.get("shift_factor") or 0.0))

