"""Training data, the one pipeline: folders of images and captions (ai-toolkit's `datasets:`), aspect-ratio buckets,
per-epoch caption rules, disk caches of VAE latents and text embeddings, and batches of one bucket; folders of
precomputed samples and synthetic samples with their loader (samples.py); each rank's share of the batches
(sharding.py).

The trainer drives it in three stages, so that only one model is in memory at a time:
    ds = ImageDataset(configs, seed=seed, trigger_word=trigger)        # checks every file; no model yet
    loader = BucketLoader(TrainingDataset(ds, latents, texts), batch_size, shuffle, seed)
    (a) latents.fill(ds.latent_specs(), encode_images)                 # VAE loaded, used, freed
    (b) texts.fill(ds.prompts(range(loader.sampler.epochs_needed(n))) + prompts, encode_prompts)   # TEs, freed
    (c) loader.next_batch() ...                                         # transformer; caches only
"""
from .errors import DataError
from .config import DatasetConfig, validate_dataset_config, resolutions, IMAGE_EXTENSIONS
from .images import ImageRecord, list_images, load_image, probe_image, image_array, BACKGROUND
from .captions import CaptionRule, apply_trigger, read_caption, shuffle_tags, split_tags
from .buckets import Bucket, Placement, make_buckets, closest_bucket, place, MAX_ASPECT
from .dataset import ImageDataset, LatentSpec, Sample
from .sampler import BucketBatchSampler
from .cache import LatentCache, TextEmbeddingCache
from .loader import TrainingDataset, BucketLoader
from .samples import (ConcatDataset, FolderDataset, SampleLoader, SyntheticDataset, dataset_kind, scan_folder,
                      write_sample)
from .sharding import ShardedBucketLoader, ShardedLoader, shard_loader
