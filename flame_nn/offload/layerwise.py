"""Layer-wise full fine-tuning of a model larger than GPU memory (a fused backward pass).

    streamer = BlockStreamer(model.blocks, stream_trainable=True, device="cuda")   # trainable weights stream too
    opt = LayerwiseAdamW(streamer, lr=1e-5, weight_decay=0.01)    # the blocks' optimizer
    rest = flame_nn.optim.AdamW(non_block_parameters, lr=1e-5)    # everything outside the blocks, as usual
    loss.backward()          # each block is updated inside backward, as soon as its gradients are complete
    opt.step(); rest.step(); rest.zero_grad()                     # opt.step / zero_grad only keep the loop familiar

Per block the AdamW moments (fp32) and, for bf16/fp16 weights, fp32 master weights live in pinned host memory
(16 bytes per parameter with masters, 8 without, plus the weights themselves). When block i's backward starts, its
state is copied to a device scratch buffer on the copy stream (behind the block's weights); when its backward ends,
its gradients are gathered into one flat buffer and freed, the fused AdamW kernel (flame_core.kernels.adamw; its
NumPy reference on cpu) updates the weights in their slot, and the moments, masters and new weights are copied back
to the host on the copy stream -- the next forward's copy of the block follows them on the same stream.

Rules: every block runs checkpointed (its backward is the update point); a parameter must be used by one block only;
gradient accumulation and global gradient clipping are not available (each block is updated before the next block's
gradients exist -- the same limits as PyTorch's optimizer-in-backward recipe).
"""
import numpy as np

from flame_core.kernels.adamw import adamw_plan, adamw_step
from flame_core.memory import pinned_pool

from .engine import device_bytes
from .host import OffloadError

_ALIGN = 64  # elements: each tensor's slice starts on a 256-byte boundary of the fp32 buffers


def _pinned_f32(n, fill=None):
    a = pinned_pool().empty((n,), np.float32)
    a[...] = 0 if fill is None else fill
    return a


class _State:
    __slots__ = ("entries", "offsets", "numel", "exp_avg", "exp_avg_sq", "master", "step", "loaded", "plans")


class LayerwiseAdamW:
    """AdamW (PyTorch's rule, decoupled weight decay) for the trainable tensors of a streamer's blocks, applied
    block by block during backward with the state in pinned host memory."""

    def __init__(self, streamer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if not streamer.stream_trainable:
            raise OffloadError("LayerwiseAdamW needs a BlockStreamer built with stream_trainable=True")
        if streamer._layerwise is not None:
            raise OffloadError("this BlockStreamer already has a LayerwiseAdamW")
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self.param_groups = [dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)]
        self._streamer = streamer
        self._states = []
        params = []
        for i, hb in enumerate(streamer._host):
            tr = hb.trainable
            if not tr:
                self._states.append(None)
                continue
            dts = {e.dtype for e in tr}
            if len(dts) > 1:
                raise OffloadError(f"block {streamer.names[i]}: trainable tensors of several dtypes "
                                   f"{sorted(d.name for d in dts)}; LayerwiseAdamW needs one dtype per block")
            for e in tr:
                if e.offset >= hb.pinned_bytes:
                    raise OffloadError(f"block {streamer.names[i]}: {e.name} streams from a mapped file; trainable "
                                       f"weights need a pinned host copy (build the streamer without sources=)")
            st = _State()
            st.entries = tr
            st.offsets, n = [], 0
            for e in tr:
                st.offsets.append(n)
                n += (int(np.prod(e.shape)) + _ALIGN - 1) // _ALIGN * _ALIGN
            st.numel = n
            st.exp_avg, st.exp_avg_sq = _pinned_f32(n), _pinned_f32(n)
            st.master = None
            if tr[0].dtype != np.float32:
                st.master = _pinned_f32(n)
                host = hb.host_arrays()
                for e, off in zip(tr, st.offsets):
                    st.master[off:off + host[e.name].size] = host[e.name].reshape(-1).astype(np.float32)
            st.step, st.loaded, st.plans = 0, None, {}
            self._states.append(st)
            params += [e.tensor for e in tr]
        if not params:
            raise OffloadError("LayerwiseAdamW: the streamer's blocks have no trainable parameters "
                               "(requires_grad_(True) them before building the streamer)")
        from flame_core import grad_pool
        grad_pool.unregister(params)  # one flat gradient buffer for the whole model is what this avoids
        self._scratch = None
        streamer._layerwise = self

    # ------------------------------------------------------------------ device scratch
    def _buffers(self, grad_dtype):
        n = max(s.numel for s in self._states if s is not None)
        if self._scratch is None or self._scratch[0] != grad_dtype:
            dev = self._streamer.device
            f32 = [device_bytes(4 * n, dev) for _ in range(3)]
            g = device_bytes(n * np.dtype(grad_dtype).itemsize, dev)
            self._scratch = (grad_dtype, f32, g)
        _, f32, g = self._scratch
        return [a for _, a in f32], g[1]

    def _before_backward(self, i):
        st = self._states[i]
        if st is None:
            return
        (m, v, w), _ = self._buffers(st.entries[0].dtype)
        eng = self._streamer.engine
        eng.copy_waits(eng.record_compute())  # the scratch's last reader (the previous block's update) is enqueued
        eng.h2d(m, 0, st.exp_avg)
        eng.h2d(v, 0, st.exp_avg_sq)
        if st.master is not None:
            eng.h2d(w, 0, st.master)
        st.loaded = eng.record_copy()

    def _after_backward(self, i):
        st = self._states[i]
        if st is None:
            return
        streamer = self._streamer
        hb = streamer._host[i]
        dt = st.entries[0].dtype
        (m8, v8, w8), g8 = self._buffers(dt)
        g = g8.view(dt)[:st.numel]
        for e, off in zip(st.entries, st.offsets):
            t = e.tensor
            n = t.array.size
            if t._grad is None:
                g[off:off + n] = 0
            else:
                g[off:off + n] = t._grad.array.reshape(-1)
                t._grad = None
        eng = streamer.engine
        eng.compute_waits(st.loaded)
        # the kernel's table of parameter addresses, per buffer the block is bound to (slots are few and fixed; a
        # re-placement (set_resident) makes new buffers and drops the old plans, which hold views of the old ones)
        if st.plans.get("gen") != streamer._generation:
            st.plans = {"gen": streamer._generation}
        key = ("bound", id(hb.bound))
        plan = st.plans.get(key)
        if plan is None:
            plan = st.plans[key] = adamw_plan([e.tensor.array for e in st.entries], st.offsets)
        grp = self.param_groups[0]
        m, v = m8.view(np.float32)[:st.numel], v8.view(np.float32)[:st.numel]
        master = w8.view(np.float32)[:st.numel] if st.master is not None else None
        adamw_step(plan, g, m, v, lr=grp["lr"], beta1=grp["betas"][0], beta2=grp["betas"][1], eps=grp["eps"],
                   weight_decay=grp["weight_decay"], step=st.step + 1, master=master)
        st.step += 1
        for e in st.entries:
            e.tensor._version[0] += 1
        # moments, masters and the new weights back to the host, behind the update
        eng.copy_waits(eng.record_compute())
        eng.d2h(st.exp_avg, m8, 0)
        eng.d2h(st.exp_avg_sq, v8, 0)
        if st.master is not None:
            eng.d2h(st.master, w8, 0)
        for e in st.entries:
            eng.d2h(hb.host[e.offset:e.offset + e.nbytes], hb.bound, e.offset)

    # ------------------------------------------------------------------ the optimizer API
    def step(self, closure=None):
        """The blocks were updated during backward; nothing is left to do (kept for the familiar loop)."""
        return None if closure is None else closure()

    def zero_grad(self, set_to_none=True):
        """Block gradients are freed right after each block's update."""

    def state_dict(self):
        """{'<block name>.<tensor>': {'step', 'exp_avg', 'exp_avg_sq'[, 'master']}} with NumPy copies shaped like the
        tensors (after the pending copies)."""
        self._streamer.synchronize()
        out = {}
        for name, st in zip(self._streamer.names, self._states):
            if st is None:
                continue
            for e, off in zip(st.entries, st.offsets):
                n = int(np.prod(e.shape))
                d = {"step": st.step, "exp_avg": st.exp_avg[off:off + n].reshape(e.shape).copy(),
                     "exp_avg_sq": st.exp_avg_sq[off:off + n].reshape(e.shape).copy()}
                if st.master is not None:
                    d["master"] = st.master[off:off + n].reshape(e.shape).copy()
                out[f"{name}.{e.name}"] = d
        return out

    def load_state_dict(self, state):
        self._streamer.synchronize()
        for name, st in zip(self._streamer.names, self._states):
            if st is None:
                continue
            for e, off in zip(st.entries, st.offsets):
                key = f"{name}.{e.name}"
                if key not in state:
                    raise OffloadError(f"LayerwiseAdamW.load_state_dict: no state for {key}")
                d, n = state[key], int(np.prod(e.shape))
                st.step = int(d["step"])
                st.exp_avg[off:off + n] = np.asarray(d["exp_avg"], np.float32).reshape(-1)
                st.exp_avg_sq[off:off + n] = np.asarray(d["exp_avg_sq"], np.float32).reshape(-1)
                if st.master is not None and "master" in d:
                    st.master[off:off + n] = np.asarray(d["master"], np.float32).reshape(-1)
