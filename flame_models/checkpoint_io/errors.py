"""The base of every model family's checkpoint error."""
from flame_core.errors import FlameError


class CheckpointError(FlameError):
    """A checkpoint that cannot be loaded as asked: files that cannot be found or read, another model's weights,
    missing, unexpected or misshaped tensors. Each model family raises its own subclass (FluxCheckpointError,
    UNetCheckpointError, ...), which also derives from the built-in error its users catch; `except CheckpointError`
    catches them all."""
