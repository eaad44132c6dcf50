"""Hypothesis gradient checks (float64 central differences, flame_core.autograd.gradcheck) of the differentiable
parity ops: embedding_bag (weight and per_sample_weights), ctc_loss (through log_softmax, where PyTorch's gradient
convention is the true one), rrelu (eval, and training with the slopes fixed by reseeding), max_unpool1d / 3d,
lp_pool3d and multilabel_margin_loss; inputs kept away from kinks where the draw allows."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import gradcheck

seeds = st.integers(0, 2 ** 16)


def _leaf(a, device):
    return flame.tensor(np.asarray(a, dtype=np.float64), device=device, requires_grad=True)


def _away_from_zero(rng, shape):
    return rng.uniform(0.1, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@given(seed=seeds, bags=st.integers(1, 4), num=st.integers(2, 6), dim=st.integers(1, 3), two_d=st.booleans())
def test_embedding_bag(device, mode, seed, bags, num, dim, two_d):
    rng = np.random.default_rng(seed)
    w = _leaf(rng.normal(size=(num, dim)), device)
    if two_d:
        idx, off = flame.tensor(rng.integers(0, num, size=(bags, 3)), device=device), None
    else:
        lengths = rng.integers(0, 4, size=bags)
        idx = flame.tensor(rng.integers(0, num, size=int(lengths.sum())), device=device)
        off = flame.tensor(np.r_[0, np.cumsum(lengths)[:-1]], device=device)
    pad = int(rng.integers(0, num)) if rng.random() < 0.5 else None
    if mode == "sum":
        psw = _leaf(rng.normal(size=tuple(idx.shape)), device)
        assert gradcheck(lambda w, p: F.embedding_bag(idx, w, off, mode="sum", per_sample_weights=p,
                                                      padding_idx=pad), (w, psw))
    else:
        assert gradcheck(lambda w: F.embedding_bag(idx, w, off, mode=mode, padding_idx=pad), (w,))


@given(seed=seeds, T=st.integers(1, 6), N=st.integers(1, 3), C=st.integers(2, 4),
       reduction=st.sampled_from(["none", "sum", "mean"]), concatenated=st.booleans())
def test_ctc_loss_through_log_softmax(device, seed, T, N, C, reduction, concatenated):
    rng = np.random.default_rng(seed)
    x = _leaf(rng.normal(size=(T, N, C)), device)
    tl = rng.integers(0, 4, size=N)
    il = rng.integers(0, T + 1, size=N)
    blank = int(rng.integers(0, C))
    labels = [rng.choice([c for c in range(C) if c != blank], size=n) for n in tl]
    if concatenated:
        targets = flame.tensor(np.concatenate(labels + [np.zeros(0, dtype=np.int64)]).astype(np.int64),
                               device=device)
    else:
        targets = flame.tensor(np.stack([np.r_[lab, np.full(3 - len(lab), blank)] for lab in labels]).astype(
            np.int64), device=device)
    assert gradcheck(lambda x: F.ctc_loss(x.log_softmax(-1), targets, il, tl, blank=blank, reduction=reduction,
                                          zero_infinity=True), (x,))


@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), training=st.booleans())
def test_rrelu(device, seed, shape, training):
    x = _leaf(_away_from_zero(np.random.default_rng(seed), shape), device)

    def fn(x):
        flame.manual_seed(seed)                           # the same slopes on every evaluation
        return F.rrelu(x, 0.1, 0.4, training=training)
    assert gradcheck(fn, (x,))


@given(seed=seeds, n=st.integers(1, 2), length=st.integers(2, 7), k=st.integers(1, 3))
def test_max_unpool1d(device, seed, n, length, k):
    x = _leaf(np.random.default_rng(seed).normal(size=(n, 2, max(length, k))), device)

    def fn(x):
        out, idx = F.max_pool1d(x, k, return_indices=True)
        return F.max_unpool1d(out * 1.5, idx, k)
    assert gradcheck(fn, (x,))


@given(seed=seeds, dhw=st.tuples(st.integers(2, 4), st.integers(2, 4), st.integers(2, 4)), batched=st.booleans())
def test_max_unpool3d(device, seed, dhw, batched):
    x = _leaf(np.random.default_rng(seed).normal(size=((2,) if batched else ()) + (2,) + dhw), device)

    def fn(x):
        out, idx = F.max_pool3d(x, 2, return_indices=True)
        return F.max_unpool3d(out * 1.5, idx, 2, output_size=dhw)
    assert gradcheck(fn, (x,))


@given(seed=seeds, dhw=st.tuples(st.integers(2, 4), st.integers(2, 4), st.integers(2, 4)),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, 1.5]), ceil_mode=st.booleans())
def test_lp_pool3d(device, seed, dhw, norm_type, ceil_mode):
    x = _leaf(np.random.default_rng(seed).uniform(0.2, 2.0, size=(1, 2) + dhw), device)
    assert gradcheck(lambda x: F.lp_pool3d(x, norm_type, 2, stride=1, ceil_mode=ceil_mode), (x,))


@given(seed=seeds, n=st.integers(1, 3), c=st.integers(1, 5), batched=st.booleans(),
       reduction=st.sampled_from(["none", "sum", "mean"]))
def test_multilabel_margin_loss(device, seed, n, c, batched, reduction):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, c))
    target = np.stack([np.r_[rng.permutation(c)[:rng.integers(0, c + 1)], -np.ones(c, dtype=np.int64)][:c]
                       for _ in range(n)])
    if not batched:
        x, target = x[0], target[0]
    x = _leaf(x, device)
    assert gradcheck(lambda x: F.multilabel_margin_loss(x, flame.tensor(target, device=device),
                                                        reduction=reduction), (x,))
