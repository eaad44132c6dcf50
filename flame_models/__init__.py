"""flame_models: diffusion models on flame_nn. Each family -- flux, sd3, sdxl -- is one subpackage, named by
flame_models.registry; import the one you need, e.g. `from flame_models.flux import Flux, load_flux, sample`.
Shared parts: vae, text_encoders, tokenization, conditioning, blocks, pipeline, samplers, checkpoint_io, data,
training (one trainer for every family) and generate (`python -m flame_models.generate`)."""
