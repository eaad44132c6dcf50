"""Images held out of training for a validation loss (kohya's `validation_split`): of each dataset folder, a fixed
fraction of its images, never trained on.

    train, held = split_records(dataset, fraction=0.1, seed=42)       # indices into dataset.records
    train_ds = dataset.select(train)
    val_ds = dataset.select(held, [evaluation_config(c) for c in dataset.configs])

Which images are held out depends only on (seed, folder index, each image's path inside its folder): every image
gets the rank of sha256(seed, folder, path), and the round(fraction * n) lowest of a folder's n images (at least
one) are held out. The listing order of the folder, the machine and the process do not change it; adding or
removing an image moves at most the images whose rank it passes. A held-out image is out of every repeat, flip and
resolution of training.

An evaluation set is read once per evaluation and the same way every time: `evaluation_config` keeps a folder's
captions, trigger word, resolutions and buckets, and turns off what varies a sample between epochs or makes copies
(caption dropout, tag shuffling, random crops, flips, repeats), and reads no loss masks and no regularisation flag:
the validation loss is the plain loss. Regularisation folders (is_reg) hold nothing out: they stay whole in training.
"""
from dataclasses import replace

from .captions import stable_seed
from .errors import DataError


def split_records(dataset, fraction, seed):
    """(training records, held-out records): indices into dataset.records; DataError when a folder has too few
    images to give both parts one."""
    if not 0 < fraction < 1:
        raise DataError(f"validation split must be a fraction in (0, 1), got {fraction!r}")
    by_config = {}
    for ri, ci in enumerate(dataset.record_config):
        by_config.setdefault(ci, []).append(ri)
    train, held = [], []
    for ci, recs in sorted(by_config.items()):
        if dataset.configs[ci].is_reg:    # regularisation images are not what the validation loss measures
            train += recs
            continue
        n = len(recs)
        k = max(1, round(fraction * n))
        if k >= n:
            raise DataError(f"datasets[{ci}]: validation split {fraction:g} of its {n} image(s) leaves none to "
                            f"train on (hold out fewer, or add images)")
        ranked = sorted(recs, key=lambda ri: (stable_seed("validation", seed, ci, dataset.records[ri].relpath),
                                              dataset.records[ri].relpath))
        held += ranked[:k]
        train += ranked[k:]
    return sorted(train), sorted(held)


def evaluation_config(cfg, **fields):
    """A DatasetConfig read the same way at every evaluation: `cfg` (with `fields` replaced) without caption
    dropout, tag shuffling, random crops, flips or repeats, and without loss masks or the regularisation flag."""
    return replace(cfg, **fields, caption_dropout_rate=0.0, shuffle_tokens=False, random_crop=False, flip_x=False,
                   flip_y=False, num_repeats=1, mask_path=None, alpha_mask=False, invert_mask=False,
                   mask_min_value=0.0, is_reg=False)
