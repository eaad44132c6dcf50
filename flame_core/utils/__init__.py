"""flame_core.utils: helpers beside the tensor library (`flame_core.utils.data`: datasets and the DataLoader)."""
from . import data

__all__ = ["data"]
