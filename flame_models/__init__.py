"""flame_models: diffusion models on flame_nn (flux, ...). Import the subpackage you need, e.g.
`from flame_models import flux` or `from flame_models.flux import Flux, load_flux, sample`."""
