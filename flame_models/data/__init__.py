"""Training data, the one pipeline: folders of images and captions (ai-toolkit's `datasets:`), aspect-ratio buckets,
per-epoch caption rules, disk caches of VAE latents and text embeddings, and batches of one bucket; folders of
precomputed samples and synthetic samples with their loader (samples.py); each rank's share of the batches
(sharding.py); images held out for a validation loss (holdout.py).

The trainer drives it in three stages, so that only one model is in memory at a time:
    ds = ImageDataset(configs, seed=seed, trigger_word=trigger)        # checks every file; no model yet
    loader = BucketLoader(TrainingDataset(ds, latents, texts), batch_size, shuffle, seed)
    (a) latents.fill(ds.latent_specs(), encode_images)                 # VAE loaded, used, freed
    (b) texts.fill(ds.prompts(range(loader.sampler.epochs_needed(n))) + prompts, encode_prompts)   # TEs, freed
    (c) loader.next_batch() ...                                         # transformer; caches only
"""
from .buckets import MAX_ASPECT, Bucket, Placement, closest_bucket, make_buckets, place
from .cache import LatentCache, TextEmbeddingCache
from .captions import CaptionRule, PreservationPrompt, apply_trigger, read_caption, shuffle_tags, split_tags
from .config import IMAGE_EXTENSIONS, DatasetConfig, resolutions, validate_dataset_config
from .dataset import ImageDataset, LatentSpec, Sample
from .errors import DataError
from .holdout import evaluation_config, split_records
from .images import BACKGROUND, ImageRecord, image_array, list_images, load_image, probe_image
from .loader import BucketLoader, TrainingDataset
from .sampler import BucketBatchSampler
from .samples import (
                      ConcatDataset,
                      FolderDataset,
                      SampleLoader,
                      SyntheticDataset,
                      dataset_kind,
                      scan_folder,
                      write_sample,
)
from .sharding import ShardedBucketLoader, ShardedLoader, shard_loader
