"""Gradient buckets: contiguous ranges of the flat gradient buffers (flame_core.grad_pool), each all-reduced in
place as one collective.

Parameters are taken in reverse registration order -- roughly the order backward produces their gradients, as
torch's DDP does -- and a bucket grows while the next parameter's slot sits right before the bucket's first slot in
the same flat buffer and the bucket stays under its byte cap (1 MiB for the first bucket, so communication starts
early; `bucket_cap_mb` after). A bucket is then the slice [first offset, last offset + numel) of its buffer: the
zero alignment gaps between slots ride along (they stay zero), and no slot of a parameter outside the model's
trainable set is ever inside one. A parameter larger than the cap gets a bucket of its own.
"""
from dataclasses import dataclass, field

from flame_core import grad_pool

FIRST_BUCKET_BYTES = 1 << 20


@dataclass
class Bucket:
    index: int
    flat: object              # the flat buffer Tensor
    start: int                # element offsets in it
    end: int
    params: list = field(default_factory=list)  # indices into the DDP's parameter list
    view: object = None       # flat[start:end]

    @property
    def nbytes(self):
        return (self.end - self.start) * self.flat.element_size()


def _slot_positions():
    """{id(flat tensor): {offset: position}} over every live slot of every flat buffer."""
    out = {}
    for buf in grad_pool.buffers():
        offsets = sorted(s.offset for s in buf.live_slots())
        out[id(buf.tensor)] = {o: k for k, o in enumerate(offsets)}
    return out


def plan_buckets(params, cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES):
    """Buckets (in launch order) over `params` (registered in the gradient pool), see the module docstring."""
    positions = _slot_positions()
    buckets, open_ = [], {}
    for i in reversed(range(len(params))):
        p = params[i]
        flat = grad_pool.flat_buffer_of(p)
        off, n = grad_pool.slice_of(p)
        pos = positions[id(flat)][off]
        b = open_.get(id(flat))
        if b is not None:
            cap = first_cap_bytes if b.index == 0 else cap_bytes
            first_pos = positions[id(flat)][b.start]
            if pos == first_pos - 1 and (b.end - off) * flat.element_size() <= cap:
                b.start = off
                b.params.append(i)
                continue
        b = Bucket(len(buckets), flat, off, off + n, [i])
        buckets.append(b)
        open_[id(flat)] = b
    for b in buckets:
        b.view = b.flat[b.start:b.end]
    return buckets
