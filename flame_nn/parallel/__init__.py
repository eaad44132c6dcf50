"""Data parallelism over processes (flame_core.distributed): `DistributedDataParallel` averages the trainable
parameters' gradients over the ranks while backward runs."""
from .distributed import DDPError, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDPError"]
