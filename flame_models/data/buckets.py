"""Aspect-ratio buckets: for a resolution r, bucket sizes (width, height) in multiples of `step` pixels with area
at most r² and as close to it as the step allows, from square to `max_aspect`:1 both ways. Mode "short_side"
(SimpleTuner's resolution_type pixel): the shorter side is r and the longer one every multiple of `step` up to
max_aspect·r, so a wide image keeps r pixels across its short side and its bucket holds up to max_aspect·r² pixels.

An image goes to the bucket whose aspect ratio is closest to its own (in log ratio, so 2:1 and 1:2 are equally
far from 1:1); it is resized to COVER the bucket (the smaller scale that fills both sides) and cropped - centred,
or at a position drawn from a seed. Buckets never hold more pixels than r², so a memory budget sized for an r×r
image holds for every bucket of r (mode "area").
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

MAX_ASPECT = 4.0
MODES = ("area", "short_side")


class Bucket(NamedTuple):
    width: int
    height: int

    def __str__(self):
        return f"{self.width}x{self.height}"

    @property
    def aspect(self):
        return self.width / self.height


def make_buckets(resolution, step=64, max_aspect=MAX_ASPECT, min_side=None, max_side=None, mode="area"):
    """Sorted buckets for `resolution` (a multiple of `step`): for every width w >= resolution (a multiple of
    `step`), the tallest height h (a multiple of `step`) with w·h <= resolution² (mode "area"), or h = resolution
    (mode "short_side"), while w/h <= max_aspect; plus each one's transpose. min_side / max_side (kohya's
    min_bucket_reso / max_bucket_reso): only buckets whose sides both lie within them (the square one always does:
    resolution itself must)."""
    if mode not in MODES:
        raise ValueError(f"bucket mode {mode!r}: one of {', '.join(MODES)}")
    if resolution % step or resolution < step:
        raise ValueError(f"resolution {resolution} must be a positive multiple of the bucket step {step}")
    if (min_side is not None and resolution < min_side) or (max_side is not None and resolution > max_side):
        raise ValueError(f"resolution {resolution} lies outside the bucket sides' bounds [{min_side}, {max_side}]")
    if min_side is not None or max_side is not None:
        lo, hi = min_side or 0, max_side or float("inf")
        return [b for b in make_buckets(resolution, step, max_aspect, mode=mode) if lo <= min(b) and max(b) <= hi]
    area = resolution * resolution
    found = set()
    w = resolution
    while True:
        h = area // w // step * step if mode == "area" else resolution
        if h < step or w / h > max_aspect:
            break
        found.add(Bucket(w, h))
        found.add(Bucket(h, w))
        w += step
    return sorted(found, key=lambda b: (b.aspect, b.width))


def closest_bucket(width, height, buckets):
    """The bucket whose aspect is nearest to width/height in log ratio (ties: the larger area, then the wider)."""
    a = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.aspect) - a), -b.width * b.height, -b.width))


@dataclass(frozen=True)
class Placement:
    """How an image becomes a bucket-sized picture: resize to `resized` (width, height), then crop `bucket`
    at (top, left) = `crop`."""
    bucket: Bucket
    resized: tuple
    crop: tuple
    scale: float

    @property
    def upscales(self):
        return self.scale > 1.0 + 1e-9


def cover_scale(width, height, bucket):
    return max(bucket.width / width, bucket.height / height)


def place(width, height, bucket, rng=None):
    """The placement of a width×height image in `bucket`: cover-resize, then a centred crop, or a uniformly drawn
    one when `rng` (a NumPy Generator) is given."""
    s = cover_scale(width, height, bucket)
    rw = max(bucket.width, int(round(width * s)))
    rh = max(bucket.height, int(round(height * s)))
    spare_h, spare_w = rh - bucket.height, rw - bucket.width
    if rng is None:
        top, left = spare_h // 2, spare_w // 2
    else:
        top, left = int(rng.integers(0, spare_h + 1)), int(rng.integers(0, spare_w + 1))
    return Placement(bucket, (rw, rh), (top, left), s)
