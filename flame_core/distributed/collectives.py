"""Collectives on FLAME tensors, with torch.distributed's names and signatures.

    dist.all_reduce(t, op=dist.ReduceOp.SUM)                 # in place, every rank gets the reduction
    dist.broadcast(t, src=0)                                 # in place, every rank gets rank src's values
    dist.all_gather(tensor_list, t)                          # tensor_list[r] = rank r's t
    dist.all_gather_into_tensor(out, t)                      # out = rank 0's t, rank 1's t, ... along dim 0
    dist.reduce_scatter(out, input_list, op)                 # out = reduction over ranks of input_list[my rank]
    dist.reduce_scatter_tensor(out, t, op)                   # the same with t split along dim 0
    work = dist.all_reduce(t, async_op=True); ...; work.wait()

Tensors must be contiguous, of the group's device (this rank's GPU for nccl; any for store) and of the same shape
and dtype on every rank; every rank must call the same collectives in the same order. Collectives are not
differentiable (as in torch, the tensors' data changes in place, their version counter moves). With async_op=True
the tensors must not be read or written until the Work's wait(); keep the Work until then.
"""
from ..errors import ShapeError, fmt_shape
from ..tensor import Tensor
from .base import REDUCE_OPS, ReduceOp, check_reducible
from .env import DistributedError
from .group import _group


def _array(t, what, g):
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: expected a flame Tensor, got {type(t).__name__}")
    arr = t._data
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: tensors must be contiguous (got shape {fmt_shape(t.shape)} with strides "
                         f"{arr.strides}); call .contiguous() first")
    if g.device is not None and t.device != g.device:
        raise DistributedError(f"{what}: the group works on {g.device}, the tensor is on {t.device}")
    return arr


def _reducible(t, arr, op, what):
    if op not in REDUCE_OPS:
        raise ValueError(f"{what}: op must be a ReduceOp ({', '.join(o.name for o in REDUCE_OPS)}), got {op!r}")
    if t._f8:
        raise DistributedError(f"{what}: cannot reduce float8 storage")
    check_reducible(arr, op, what)


def _touched(*tensors):
    for t in tensors:
        t._version[0] += 1


def _done(work, async_op):
    if async_op:
        return work
    work.wait()
    return None


def _same(ts, ref, what):
    for k, t in enumerate(ts):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: element {k} is a {type(t).__name__}, not a Tensor")
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            raise ShapeError(f"{what}: element {k} has shape {fmt_shape(t.shape)} and dtype {t.dtype}, the input "
                             f"{fmt_shape(ref.shape)} and {ref.dtype}")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    arr = _array(tensor, "all_reduce", g)
    _reducible(tensor, arr, op, "all_reduce")
    work = g.backend.all_reduce(arr, op)
    _touched(tensor)
    return _done(work, async_op)


def broadcast(tensor, src=0, group=None, async_op=False):
    g = _group(group)
    if not 0 <= int(src) < g.size():
        raise DistributedError(f"broadcast: src {src} is not a rank of this group (0..{g.size() - 1})")
    arr = _array(tensor, "broadcast", g)
    work = g.backend.broadcast(arr.view("uint8") if tensor._f8 else arr, int(src))
    _touched(tensor)
    return _done(work, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    g = _group(group)
    inp = _array(input_tensor, "all_gather_into_tensor", g)
    out = _array(output_tensor, "all_gather_into_tensor", g)
    if output_tensor.dtype != input_tensor.dtype or out.size != inp.size * g.size():
        raise ShapeError(f"all_gather_into_tensor: the output must hold world_size ({g.size()}) inputs of "
                         f"{fmt_shape(input_tensor.shape)} {input_tensor.dtype}; got {fmt_shape(output_tensor.shape)} "
                         f"{output_tensor.dtype}")
    work = g.backend.all_gather(out.reshape(-1), inp.reshape(-1))
    _touched(output_tensor)
    return _done(work, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[r] receives rank r's `tensor` (a list of world_size tensors like it)."""
    g = _group(group)
    tensor_list = list(tensor_list)
    if len(tensor_list) != g.size():
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} tensors, the group {g.size()} ranks")
    _same(tensor_list, tensor, "all_gather")
    inp = _array(tensor, "all_gather", g)
    for t in tensor_list:
        _array(t, "all_gather", g)
    from ..ops.creation import empty
    flat = empty(g.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work = g.backend.all_gather(flat._data, inp.reshape(-1))
    return _done(_Unpack(work, flat, tensor_list), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    inp = _array(input, "reduce_scatter_tensor", g)
    out = _array(output, "reduce_scatter_tensor", g)
    _reducible(input, inp, op, "reduce_scatter_tensor")
    if output.dtype != input.dtype or inp.size != out.size * g.size():
        raise ShapeError(f"reduce_scatter_tensor: the input must hold world_size ({g.size()}) outputs of "
                         f"{fmt_shape(output.shape)} {output.dtype}; got {fmt_shape(input.shape)} {input.dtype}")
    work = g.backend.reduce_scatter(out.reshape(-1), inp.reshape(-1), op)
    _touched(output)
    return _done(work, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """output = the reduction over ranks of their input_list[my rank] (a list of world_size tensors like output)."""
    g = _group(group)
    input_list = list(input_list)
    if len(input_list) != g.size():
        raise ValueError(f"reduce_scatter: input_list has {len(input_list)} tensors, the group {g.size()} ranks")
    _same(input_list, output, "reduce_scatter")
    from ..ops.shape import cat
    flat = cat([t.reshape(-1) for t in input_list]).contiguous()
    return reduce_scatter_tensor(output, flat, op, group=g, async_op=async_op)


class _Unpack:
    """all_gather's Work: after the gathered buffer arrived, copy each rank's part into its tensor."""

    def __init__(self, work, flat, tensor_list):
        self.work, self.flat, self.tensor_list = work, flat, tensor_list
        self.unpacked = False

    def wait(self, timeout=None):
        self.work.wait(timeout)
        if not self.unpacked:
            n = self.flat.numel() // len(self.tensor_list)
            for r, t in enumerate(self.tensor_list):
                t._data[...] = self.flat._data[r * n:(r + 1) * n].reshape(t._data.shape)
                t._version[0] += 1
            self.unpacked = True
        return True

    def is_completed(self):
        return self.unpacked or self.work.is_completed()

    def synchronize(self):
        self.wait()
        if hasattr(self.work, "synchronize"):
            self.work.synchronize()
