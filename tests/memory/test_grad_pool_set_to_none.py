"""zero_grad(set_to_none=True) clears the flat gradient buffer too: a consumer of flat_buffer_of(p) (fused optimizer,
all-reduce, clipping) never sees last step's gradient of a parameter that got none this step."""
import gc

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core import grad_pool


def npa(t):
    return t.detach().numpy()


def _params(device):
    a = flame.ones(5, device=device, requires_grad=True)
    b = flame.ones(3, device=device, requires_grad=True)
    c = flame.ones(4, device=device, requires_grad=True)
    grad_pool.register([a, b, c])
    return a, b, c


@pytest.mark.parametrize("how", ["pool_all", "pool_params", "optimizer", "module_subset"])
def test_set_to_none_leaves_no_stale_gradient_in_the_flat_buffer(device, how):
    a, b, c = _params(device)
    ((a * 2).sum() + (b * 3).sum() + (c * 4).sum()).backward()
    flat = grad_pool.flat_buffer_of(a)
    assert flat is grad_pool.flat_buffer_of(b) and npa(flat).sum() == 10 + 9 + 16
    if how == "pool_all":
        grad_pool.zero_grad(set_to_none=True)
    elif how == "pool_params":
        grad_pool.zero_grad([a, b, c], set_to_none=True)
    elif how == "optimizer":
        nn.optim.SGD([a, b, c], lr=0.1).zero_grad(set_to_none=True)
    else:  # a subset of a buffer's parameters: slice by slice
        grad_pool.zero_grad([b, c], set_to_none=True)
        assert a.grad is not None and npa(flat)[:5].tolist() == [2] * 5
        a.grad = None
        grad_pool.zero_grad([a], set_to_none=True)
    assert a.grad is None and b.grad is None and c.grad is None
    assert not npa(flat).any()
    (a * 7).sum().backward()  # only a gets a gradient this step
    off_b, n_b = grad_pool.slice_of(b)
    off_c, n_c = grad_pool.slice_of(c)
    buf = npa(flat)
    assert not buf[off_b:off_b + n_b].any() and not buf[off_c:off_c + n_c].any()
    np.testing.assert_array_equal(npa(a.grad), [7] * 5)
    assert buf.sum() == 35


def test_set_to_none_is_one_memset_per_buffer(device, monkeypatch):
    params = _params(device)  # noqa: F841 (kept alive: their buffer with them)
    gc.collect()  # other tests' buffers waiting in cycles
    eager = [b for b in grad_pool.buffers() if b.resident and not b.lazy]  # (lazy ones are released instead)
    cleared = []
    real = grad_pool._memset
    monkeypatch.setattr(grad_pool, "_memset", lambda arr: (cleared.append(arr.size), real(arr)))
    grad_pool.zero_grad(set_to_none=True)
    assert sorted(cleared) == sorted(buf.numel for buf in eager)


@pytest.mark.gpu
def test_fused_adamw_skips_parameters_without_a_gradient():
    a = nn.Parameter(flame.ones(300, device="cuda"))
    b = nn.Parameter(flame.ones(200, device="cuda"))
    opt = nn.optim.AdamW([a, b], lr=0.1, weight_decay=0.1)
    (a.sum() * b.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    b_before, st_b = npa(b).copy(), opt.state[b]["exp_avg"].numpy().copy()
    (a * 2).sum().backward()  # b gets no gradient: the fused step must leave it (weights and moments) alone
    opt.step()
    np.testing.assert_array_equal(npa(b), b_before)
    np.testing.assert_array_equal(opt.state[b]["exp_avg"].numpy(), st_b)
    assert opt.state[a]["step"] == 2 and opt.state[b]["step"] == 1
