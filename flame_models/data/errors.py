"""The one exception type of the image-data pipeline."""
from flame_core.errors import FlameError


class DataError(FlameError, ValueError):
    """A dataset folder, image, caption or cache file that cannot be used; the message names the file or field."""
