"""The error raised when a tokenizer's files cannot be found or read."""
from flame_core.errors import FlameError


class TokenizerFilesError(FlameError, FileNotFoundError):
    """Tokenizer files are missing or unusable; the message names the folder (or file) that is needed."""
