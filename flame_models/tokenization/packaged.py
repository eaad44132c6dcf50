"""The vocabularies shipped inside flame_models (see vocab/NOTICE.md for their origin and licences)."""
import gzip
from functools import lru_cache
from importlib import resources

from .errors import TokenizerFilesError

CLIP_MERGES = "clip_merges.txt.gz"
T5_TOKENIZER_JSON = "t5_tokenizer.json.gz"


@lru_cache(maxsize=4)
def read_packaged(name, needed):
    """The uncompressed bytes of packaged vocabulary file `name`; `needed` says which tokenizer folder replaces it
    when this installation lacks it."""
    try:
        data = resources.files(__package__).joinpath("vocab", name).read_bytes()
    except (FileNotFoundError, OSError):
        raise TokenizerFilesError(
            f"the vocabulary packaged with FLAME (flame_models/tokenization/vocab/{name}) is missing from this "
            f"installation; pass the tokenizer folder of your model instead: {needed}") from None
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise TokenizerFilesError(f"the packaged vocabulary flame_models/tokenization/vocab/{name} is damaged ({e}); "
                                  f"reinstall FLAME or pass the tokenizer folder of your model: {needed}") from None
