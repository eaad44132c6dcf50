"""Post-accumulate-grad hooks and end-of-backward callbacks (what DistributedDataParallel builds on): when they
fire, with what, how often under gradient checkpointing, and what a failing pass leaves behind."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import autograd, grad_pool
from flame_core.checkpoint import checkpoint
from flame_core.errors import AutogradError


def test_post_accumulate_hook_sees_the_accumulated_grad_once_per_backward():
    w = flame.tensor([1.0, 2.0, 3.0], requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.numpy().copy()))
    ((w * w).sum() + (w * 3).sum()).backward()  # two uses in one graph: summed first, one accumulation
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], 2 * np.array([1, 2, 3]) + 3)
    (w * 2).sum().backward()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[1], 2 * np.array([1, 2, 3]) + 3 + 2)  # accumulated into .grad


def test_a_checkpointed_region_accumulates_again_and_the_callback_runs_once_at_the_very_end():
    w = flame.tensor([0.5, -1.0], requires_grad=True)
    x = flame.tensor([2.0, 3.0])
    events = []
    w.register_post_accumulate_grad_hook(lambda p: events.append(("acc", autograd.current_pass(),
                                                                  p.grad.numpy().copy())))

    def region(v):
        return (v * w).tanh()

    y = checkpoint(region, x).sum() + checkpoint(region, x * 2).sum() + (w * w).sum()
    y.register_hook(lambda g: autograd.queue_callback(lambda: events.append(("end", autograd.current_pass(),
                                                                             w.grad.numpy().copy()))))
    y.backward()
    accs = [e for e in events if e[0] == "acc"]
    assert len(accs) == 3 and events[-1][0] == "end"  # the outer graph's use and each region's recompute
    assert len({e[1] for e in events}) == 1  # one outermost pass, nested ones included
    xs = np.array([2.0, 3.0])
    wv = np.array([0.5, -1.0])
    want = xs * (1 - np.tanh(xs * wv) ** 2) + 2 * xs * (1 - np.tanh(2 * xs * wv) ** 2) + 2 * wv
    np.testing.assert_allclose(events[-1][2], want, rtol=1e-5)
    np.testing.assert_allclose(accs[-1][2], want, rtol=1e-5)  # the last accumulation holds the final grad
    assert autograd.current_pass() is None


def test_callbacks_queue_more_callbacks_and_queueing_outside_backward_is_an_error():
    w = flame.ones(2, requires_grad=True)
    order = []

    def first():
        order.append(1)
        autograd.queue_callback(lambda: order.append(2))
    w.register_post_accumulate_grad_hook(lambda p: autograd.queue_callback(first))
    (w * 2).sum().backward()
    assert order == [1, 2]
    with pytest.raises(AutogradError, match="only be called while a backward pass runs"):
        autograd.queue_callback(lambda: None)


def test_a_pass_that_raises_runs_no_callback_and_leaves_none_queued():
    w = flame.ones(2, requires_grad=True)
    ran = []

    def hook(p):
        autograd.queue_callback(lambda: ran.append("stale"))
        raise RuntimeError("boom")
    h = w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(RuntimeError, match="boom"):
        (w * 2).sum().backward()
    h.remove()
    (w * 2).sum().backward()
    assert ran == [] and autograd.current_pass() is None


def test_hook_registration_rules_and_removal():
    a = flame.ones(2, requires_grad=True)
    with pytest.raises(AutogradError, match="non-leaf"):
        (a * 2).register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(AutogradError, match="doesn't require gradient"):
        flame.ones(2).register_post_accumulate_grad_hook(lambda p: None)
    calls = []
    h = a.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    h.remove()
    a.sum().backward()
    assert calls == []


def test_autograd_grad_accumulates_nothing_so_no_hook_fires():
    w = flame.ones(2, requires_grad=True)
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    (g,) = autograd.grad((w * 3).sum(), [w])
    assert calls == [] and w.grad is None
    np.testing.assert_allclose(g.numpy(), [3, 3])


def test_pooled_grad_is_the_view_backward_writes_into():
    w = flame.ones(3, requires_grad=True)
    grad_pool.register([w])
    view = grad_pool.pooled_grad(w)
    (w * 4).sum().backward()
    assert w.grad is view
    off, n = grad_pool.slice_of(w)
    np.testing.assert_allclose(grad_pool.flat_buffer_of(w).numpy()[off:off + n], [4, 4, 4])
    with pytest.raises(AutogradError, match="not registered"):
        grad_pool.pooled_grad(flame.ones(2, requires_grad=True))
