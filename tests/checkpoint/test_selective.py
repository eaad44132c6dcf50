"""Selective checkpointing (flame_core.checkpoint's save=("attention",)): a region keeps each attention output of its
first run and its recompute takes it back instead of running the attention again -- the same gradients as full
checkpointing, one attention forward per call instead of two."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional as F
from flame_core.checkpoint import SAVE_KINDS, checkpoint, maybe_checkpoint, stash
from flame_core.errors import AutogradError
from flame_core.kernels import attention as K


def _count_forwards(monkeypatch):
    calls = [0]
    real = K.flash_attention_forward

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    monkeypatch.setattr(K, "flash_attention_forward", counted)
    return calls


def _region(w1, w2):
    def f(x):
        h = x @ w1                                                   # (B, L, 3 * 8)
        q, k, v = (h[..., i * 8:(i + 1) * 8].reshape(2, 6, 2, 4).transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(q.tanh(), k, v)            # (B, heads, L, 4)
        o2 = F.scaled_dot_product_attention(o, k * 0.5, v)            # a second attention in the same region
        return (o2.transpose(1, 2).reshape(2, 6, 8) @ w2).sin() + x
    return f


def _inputs(dtype=flame.float64):
    rng = np.random.default_rng(0)
    x = flame.tensor(rng.standard_normal((2, 6, 8)), dtype=dtype, requires_grad=True)
    w1 = flame.tensor(0.4 * rng.standard_normal((8, 24)), dtype=dtype, requires_grad=True)
    w2 = flame.tensor(0.4 * rng.standard_normal((8, 8)), dtype=dtype, requires_grad=True)
    return x, w1, w2


@pytest.mark.parametrize("save", [(), ("attention",), "attention"])
def test_kept_attention_gives_the_gradients_of_full_checkpointing(monkeypatch, save):
    calls = _count_forwards(monkeypatch)
    grads = {}
    for mode in ("plain", "ckpt"):
        x, w1, w2 = _inputs()
        f = _region(w1, w2)
        before = calls[0]
        y = f(x) if mode == "plain" else checkpoint(f, x, save=save)
        (y * y).sum().backward()
        grads[mode] = (x.grad.numpy(), w1.grad.numpy(), w2.grad.numpy())
        grads[mode + "_calls"] = calls[0] - before
    for a, b in zip(grads["plain"], grads["ckpt"]):
        np.testing.assert_array_equal(a, b)                           # the same values, bit for bit
    assert grads["plain_calls"] == 2
    assert grads["ckpt_calls"] == (2 if save else 4)                 # kept: the recompute ran no attention


def test_maybe_checkpoint_reads_the_block_switch_and_the_kept_outputs_are_freed(monkeypatch):
    calls = _count_forwards(monkeypatch)
    x, w1, w2 = _inputs()

    class Block:
        gradient_checkpointing = True
        checkpoint_save = ("attention",)

        def __call__(self, x):
            return _region(w1, w2)(x)
    y = maybe_checkpoint(Block(), x)
    node = y.grad_fn
    assert calls[0] == 2 and len(node.stash.items) == 2 and stash("attention") is None   # none outside a region
    (y * y).sum().backward()
    assert calls[0] == 2 and getattr(node, "stash", None) is None    # taken back, then dropped


def test_nested_regions_keep_their_own_and_bad_kinds_are_refused(monkeypatch):
    calls = _count_forwards(monkeypatch)
    x, w1, w2 = _inputs()
    inner = _region(w1, w2)

    def outer(x):  # the inner region keeps nothing: its attentions run in its own recompute again
        return checkpoint(inner, x)
    y = checkpoint(outer, x, save=("attention",))
    (y * y).sum().backward()
    assert calls[0] == 2 + 0 + 2   # outer's first run, its recompute (inner's first run: outer's kept), inner's
    with pytest.raises(ValueError, match="save='matmul' is not an op kind.*attention"):
        checkpoint(inner, x, save="matmul")
    assert SAVE_KINDS == ("attention",)


def test_a_recompute_that_changes_its_ops_is_refused():
    x, w1, w2 = _inputs()
    runs = [0]

    def f(x):
        runs[0] += 1
        h = x.reshape(2, 6, 2, 4).transpose(1, 2)
        if runs[0] == 1:
            return F.scaled_dot_product_attention(h, h, h).sum() + x.sum()
        return (F.scaled_dot_product_attention(h, h, h).sum() + F.scaled_dot_product_attention(h, h, h).sum()
                + x.sum())
    y = checkpoint(f, x, save=("attention",))
    with pytest.raises(AutogradError, match="ran more attention ops than the region's first run"):
        y.backward()


def test_a_region_after_a_nested_one_takes_its_own_outputs():
    """The nested region is a plain call in the outer's first run (grad mode off) and a region in its recompute: its
    attentions' outputs kept by the outer go to it there, so the outer's own attention gets its own back."""
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((1, 2, 6, 4))

    def inner(x):
        return F.scaled_dot_product_attention(x, x, x) * 2.0

    def outer(x):
        return F.scaled_dot_product_attention(checkpoint(inner, x).tanh(), x, x)
    grads = []
    for save in ((), ("attention",)):
        x = flame.tensor(x0, dtype=flame.float64, requires_grad=True)
        y = checkpoint(outer, x, save=save)
        (y * y).sum().backward()
        grads.append(x.grad.numpy())
    np.testing.assert_array_equal(grads[0], grads[1])


@pytest.mark.parametrize("where", ["inside", "caller"])
def test_a_kept_output_overwritten_in_place_is_refused(where):
    x = flame.tensor(np.random.default_rng(2).standard_normal((1, 2, 6, 4)), dtype=flame.float64,
                     requires_grad=True)

    def f(x):
        o = F.scaled_dot_product_attention(x.tanh(), x, x)
        if where == "inside" and not flame.is_grad_enabled():   # in place only while nothing records (add_residual)
            o += x
            return o.sin()
        return o.transpose(1, 2) if where == "caller" else (o + x).sin()
    y = checkpoint(f, x, save=("attention",))
    if where == "caller":
        y += 1.0
    with pytest.raises(AutogradError, match="modified in place after its first run"):
        (y * y).sum().backward()
