"""Regularisation (prior-preservation) images mixed into training: datasets with `is_reg: true` (ai-toolkit's name)
are drawn in their own micro-batches, at a set ratio, and their loss is scaled by train.reg_weight (ai-toolkit's
name; kohya's prior_loss_weight) in the loss stage (training/loss_weights.py).

How batches are composed. Every micro-batch comes from one aspect bucket of ONE kind: training images or
regularisation images (a bucket's images of the two kinds are never batched together). Micro-batches are counted
from the run's start, k = 0, 1, 2, ... (across gradient accumulation and optimizer steps); with the ratio r = p/q
(train.reg_ratio, a fraction in (0, 1), default 1/2),

    micro-batch k is a regularisation batch  <=>  floor((k + 1)·p / q) > floor(k·p / q)

so the first N micro-batches hold exactly floor(N·p/q) regularisation batches, spread evenly: r = 1/2 alternates
train, reg, train, reg (ai-toolkit's every other step; kohya's default of as many regularisation images as training
images), r = 1/3 gives train, train, reg, ... Each kind is drawn by its own BucketBatchSampler (sampler.py: shuffled
per epoch from the run's seed, the regularisation stream from seed + 1), so each runs through its own epochs: a small
regularisation set repeats more often than the training set, a large one is sampled without repeats. The position
(k and both samplers') is one state: a checkpoint resumes the mix exactly.
"""
import math
from fractions import Fraction

from .errors import DataError
from .loader import BucketLoader

DEFAULT_RATIO = 0.5
REG_SEED_OFFSET = 1


def ratio_fraction(ratio):
    """train.reg_ratio as an exact fraction p/q (a float such as 0.3 is 3/10)."""
    r = Fraction(ratio).limit_denominator(10_000)
    if not 0 < r < 1:
        raise DataError(f"train.reg_ratio: the share of regularisation micro-batches, in (0, 1), got {ratio!r}")
    return r


def reg_batches_before(n, ratio):
    """How many of micro-batches 0 .. n-1 are regularisation batches: floor(n·p/q)."""
    r = ratio_fraction(ratio)
    return int(n) * r.numerator // r.denominator


def is_reg_batch(k, ratio):
    """Whether micro-batch k (from 0) is a regularisation batch."""
    return reg_batches_before(k + 1, ratio) > reg_batches_before(k, ratio)


class _MixedSampler:
    """What the trainer reads of a loader's sampler: the buckets that fill a batch (one per shape, either kind),
    the batch size, and how many epochs a run's micro-batches touch."""

    def __init__(self, mix):
        self.mix = mix
        a, b = mix.train.sampler, mix.reg.sampler
        self.batch_size = a.batch_size
        merged = {}
        for s in (a, b):
            for key, items in s.buckets:
                if len(items) >= s.batch_size:
                    merged.setdefault(str(key), (key, items))
        self.buckets = list(merged.values())

    def epochs_needed(self, num_batches):
        """Epochs (0, 1, ...) either kind touches in a run of `num_batches` micro-batches from the start."""
        n_reg = reg_batches_before(num_batches, self.mix.ratio)
        return max(self.mix.train.sampler.epochs_needed(int(num_batches) - n_reg),
                   self.mix.reg.sampler.epochs_needed(max(1, n_reg)))


class RegMixLoader:
    """Micro-batches of training and regularisation samples at `ratio` (see the module docstring); `train` and
    `reg` are BucketLoaders (or their sharded views) over the two kinds; never ends."""

    def __init__(self, train, reg, ratio=DEFAULT_RATIO):
        self.train, self.reg, self.ratio = train, reg, float(ratio)
        ratio_fraction(ratio)
        self.count = 0
        self.dataset = train.dataset
        self.sampler = _MixedSampler(self)

    @classmethod
    def build(cls, dataset, batch_size, shuffle, seed, ratio=DEFAULT_RATIO):
        """The mix over TrainingDataset `dataset` (its ImageDataset's is_reg samples in the regularisation
        stream)."""
        ds = dataset.dataset
        reg = [i for i in range(len(ds)) if ds.is_reg(i)]
        train = [i for i in range(len(ds)) if not ds.is_reg(i)]
        loaders = []
        for kind, idx, s in (("training", train, seed), ("regularisation", reg, seed + REG_SEED_OFFSET)):
            try:
                loaders.append(BucketLoader(dataset.subset(idx), batch_size, shuffle, s))
            except DataError as e:
                raise DataError(f"the {kind} images (is_reg: {str(kind != 'training').lower()}): {e}") from None
        return cls(*loaders, ratio=ratio)

    def map_loaders(self, fn):
        """The same mix over fn(train), fn(reg) (ddp: each rank's shard of both streams), at this position."""
        out = RegMixLoader(fn(self.train), fn(self.reg), self.ratio)
        out.count = self.count
        return out

    def next_batch(self):
        reg = is_reg_batch(self.count, self.ratio)
        batch = (self.reg if reg else self.train).next_batch()      # its rows' "is_reg" come from the dataset
        self.count += 1
        return batch

    def state_dict(self):
        train = self.train.state_dict()
        ddp = {k: train[k] for k in ("world_size", "global_batch") if k in train}   # (what resume compares)
        return {"mix": "reg", "count": self.count, "ratio": self.ratio, "train": train,
                "reg": self.reg.state_dict(), **ddp}

    def load_state_dict(self, state):
        if state.get("mix") != "reg":
            raise DataError("the data position in this checkpoint is of a run without regularisation images "
                            "(is_reg): exact resume is impossible; start fresh or restore the datasets")
        if not math.isclose(float(state.get("ratio", -1)), self.ratio):
            raise DataError(f"the data position in this checkpoint mixes regularisation batches at "
                            f"{state.get('ratio')}, this run at {self.ratio} (train.reg_ratio): exact resume is "
                            f"impossible; start fresh or restore the setting")
        self.train.load_state_dict(state["train"])
        self.reg.load_state_dict(state["reg"])
        self.count = int(state["count"])
