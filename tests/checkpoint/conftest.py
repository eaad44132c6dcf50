"""A small pre-norm transformer written with flame_core ops only (no flame_nn), and activation-memory probes."""
import math
import types

import numpy as np
import pytest

import flame_core as flame
from flame_core import backend


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdim=True)
    return xc * (var + eps).rsqrt() * w + b


def dropout(x, p):
    if p == 0.0:
        return x
    keep = (flame.rand(*x.shape, device=x.device) >= p).to(x.dtype)  # the device's default generator
    return x * keep * (1.0 / (1.0 - p))


class Block:
    """x + attn(ln(x)); x + mlp(ln(x)), with dropout on the attention weights and the MLP output."""

    def __init__(self, dim, heads, device, dtype=flame.float32, p_drop=0.0, seed=0):
        rng = np.random.default_rng(seed)

        def param(*shape, scale=None, offset=0.0):
            s = 1.0 / math.sqrt(shape[0]) if scale is None else scale
            return flame.tensor(rng.standard_normal(shape) * s + offset, dtype=dtype, device=device,
                                requires_grad=True)
        self.dim, self.heads, self.p = dim, heads, p_drop
        self.ln1_w, self.ln1_b = param(dim, scale=0.1, offset=1.0), param(dim, scale=0.1)
        self.w_qkv, self.b_qkv = param(dim, 3 * dim), param(3 * dim, scale=0.02)
        self.w_proj, self.b_proj = param(dim, dim), param(dim, scale=0.02)
        self.ln2_w, self.ln2_b = param(dim, scale=0.1, offset=1.0), param(dim, scale=0.1)
        self.w_fc1, self.b_fc1 = param(dim, 4 * dim), param(4 * dim, scale=0.02)
        self.w_fc2, self.b_fc2 = param(4 * dim, dim), param(dim, scale=0.02)

    def parameters(self):
        return [self.ln1_w, self.ln1_b, self.w_qkv, self.b_qkv, self.w_proj, self.b_proj, self.ln2_w, self.ln2_b,
                self.w_fc1, self.b_fc1, self.w_fc2, self.b_fc2]

    def __call__(self, x):
        B, L, D = x.shape
        H = self.heads
        # attention
        h = layer_norm(x, self.ln1_w, self.ln1_b)
        qkv = h @ self.w_qkv + self.b_qkv                                    # (B, L, 3D)
        q, k, v = qkv.reshape(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, Dh)
        att = (q @ k.mT * (1.0 / math.sqrt(D // H))).softmax(-1)            # (B, H, L, L)
        att = dropout(att, self.p)
        y = (att @ v).transpose(1, 2).reshape(B, L, D)
        x = x + (y @ self.w_proj + self.b_proj)
        # mlp
        h = layer_norm(x, self.ln2_w, self.ln2_b)
        x = x + dropout((h @ self.w_fc1 + self.b_fc1).gelu() @ self.w_fc2 + self.b_fc2, self.p)
        return x


class Stack:
    """Blocks with the module-level switch block stacks use: `stack.gradient_checkpointing = True`."""

    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, n_blocks, dim, heads, device, dtype=flame.float32, p_drop=0.0, seed=0):
        self.blocks = [Block(dim, heads, device, dtype, p_drop, seed + i) for i in range(n_blocks)]

    def parameters(self):
        return [p for b in self.blocks for p in b.parameters()]

    def __call__(self, x):
        from flame_core.checkpoint import maybe_checkpoint
        for block in self.blocks:
            x = maybe_checkpoint(block, x, enabled=self.gradient_checkpointing, offload=self.checkpoint_offload)
        return x


def saved_activation_bytes(root, exclude=()):
    """Bytes of distinct storage held by the autograd graph behind `root` for backward (the saved tensors of
    every node), not counting `exclude` (the parameters)."""
    skip = {id(backend_base(t._data)) for t in exclude}
    seen_nodes, seen_mem, total = set(), set(), 0
    stack = [root.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen_nodes:
            continue
        seen_nodes.add(id(n))
        for item in (n._saved or ()):
            if item is None:
                continue
            base = backend_base(item[0]._data)
            if id(base) in skip or id(base) in seen_mem:
                continue
            seen_mem.add(id(base))
            total += base.nbytes
        stack.extend(e[0] for e in (n.next_functions or ()) if e is not None)
    return total


def backend_base(a):
    """The array that owns `a`'s memory (views share it); NumPy and CuPy arrays both keep `.base`."""
    while a.base is not None and type(a.base) is type(a):
        a = a.base
    return a


class LiveBytes:
    """Bytes of device memory allocated while the probe runs: flame_core.memory when present, else CuPy's pool on
    cuda and tracemalloc (NumPy reports its buffers to it) on cpu."""

    def __init__(self, device):
        self.device = device
        try:
            from flame_core import memory as M
            self._mem = M if hasattr(M, "memory_allocated") else None
        except ImportError:
            self._mem = None

    def __enter__(self):
        if self._mem is None and self.device.type == "cpu":
            import tracemalloc
            tracemalloc.start()
        self.start = self.now()
        return self

    def now(self):
        if self._mem is not None:
            return self._mem.memory_allocated(self.device)
        if self.device.type == "cuda":
            backend.cupy.cuda.Device().synchronize()
            return backend.cupy.get_default_memory_pool().used_bytes()
        import tracemalloc
        return tracemalloc.get_traced_memory()[0]

    def __exit__(self, *exc):
        if self._mem is None and self.device.type == "cpu":
            import tracemalloc
            tracemalloc.stop()
        return False

    @property
    def source(self):
        if self._mem is not None:
            return "flame_core.memory.memory_allocated"
        return "cupy pool used_bytes" if self.device.type == "cuda" else "tracemalloc"


@pytest.fixture
def tiny():
    return types.SimpleNamespace(Block=Block, Stack=Stack, layer_norm=layer_norm, dropout=dropout,
                                 saved_activation_bytes=saved_activation_bytes, LiveBytes=LiveBytes)
