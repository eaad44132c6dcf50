"""Batches that each come from one bucket, in an order that depends only on (seed, epoch).

Per epoch: every bucket's samples are permuted, cut into batches of `batch_size` (a bucket's last, short batch is
dropped: every batch is full and of one size), and the batches of all buckets are permuted together. Without
shuffle, buckets and samples keep their given order. `next_batch()` never ends; `state_dict()` = {epoch, index,
fingerprint} is all a checkpoint needs to continue with exactly the same batches, and loading a state written for
other data is an error instead of a silent change of order.
"""
import hashlib
import json
import math

import numpy as np

from .errors import DataError


class BucketBatchSampler:
    """`buckets`: {bucket key: [sample indices]} (keys of any kind with a stable str())."""

    def __init__(self, buckets, batch_size=1, shuffle=True, seed=0):
        self.batch_size, self.shuffle, self.seed = int(batch_size), bool(shuffle), int(seed)
        if self.batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        self.buckets = [(k, [int(i) for i in v]) for k, v in sorted(buckets.items(), key=lambda kv: str(kv[0]))]
        self.batches_per_epoch = sum(len(v) // self.batch_size for _, v in self.buckets)
        if self.batches_per_epoch == 0:
            sizes = ", ".join(f"{k}: {len(v)}" for k, v in self.buckets)
            raise DataError(f"no bucket holds batch_size {self.batch_size} samples ({sizes or 'no samples'}); "
                            f"lower batch_size or add images of a common aspect ratio")
        self.unused = {k: len(v) for k, v in self.buckets if len(v) < self.batch_size}
        h = hashlib.sha256(json.dumps([self.batch_size, self.shuffle, self.seed,
                                       [[str(k), v] for k, v in self.buckets]]).encode("utf-8"))
        self.fingerprint = h.hexdigest()[:16]
        self.epoch, self.index = 0, 0
        self._order = None

    def batches(self, epoch):
        """The list of batches (lists of sample indices) of `epoch`."""
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        out = []
        for _, items in self.buckets:
            items = list(np.asarray(items)[rng.permutation(len(items))]) if rng is not None else items
            n = len(items) // self.batch_size * self.batch_size
            out += [[int(i) for i in items[j:j + self.batch_size]] for j in range(0, n, self.batch_size)]
        if rng is not None:
            out = [out[k] for k in rng.permutation(len(out))]
        return out

    def next_batch(self):
        """(epoch, [sample indices]) of the next batch."""
        if self._order is None:
            self._order = self.batches(self.epoch)
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self.batches(self.epoch)
        batch = self._order[self.index]
        self.index += 1
        return self.epoch, batch

    def epochs_needed(self, num_batches):
        """How many epochs (0, 1, ...) a run of `num_batches` batches from the start touches."""
        return max(1, math.ceil(int(num_batches) / self.batches_per_epoch))

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "fingerprint": self.fingerprint}

    def load_state_dict(self, state):
        fp = state.get("fingerprint")
        if fp is not None and fp != self.fingerprint:
            raise DataError("the data position in this checkpoint belongs to other data or settings (images, "
                            "buckets, batch_size, shuffle or seed changed): exact resume is impossible; start "
                            "fresh or restore the data")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = None
