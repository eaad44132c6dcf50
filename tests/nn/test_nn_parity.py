"""The torch.nn pieces FLAME added for parity -- embedding_bag / EmbeddingBag, ctc_loss / CTCLoss, rrelu / RReLU,
alpha_dropout / feature_alpha_dropout, the in-place activations, the poolings' *_with_indices, max_unpool1d / 3d,
AdaptiveMaxPool1d, lp_pool3d, multilabel_margin_loss, BatchNorm3d, nn.Buffer, LazyLinear / LazyBatchNorm: golden
outputs and gradients from PyTorch (tests/fixtures/make_nn_parity_fixtures.py runs the cases of nn_parity_cases.py
with torch), then behaviour, module / functional equality and errors. The random ones by their statistics."""
import math
import os
import sys
import types

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from golden_cases import check_case  # noqa: E402
from nn_parity_cases import CASES  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "nn_parity.safetensors")


class _Flame(types.ModuleType):
    """flame_core with `nn` = flame_nn: the cases' `L` for FLAME (torch's place)."""

    def __getattr__(self, name):
        return getattr(flame, name)


LIB = _Flame("flame_parity")
LIB.nn = nn


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


def npa(t):
    return np.asarray(t.detach().cpu().numpy()) if isinstance(t, flame.Tensor) else np.asarray(t)


def T(a, device, **kw):
    return flame.tensor(np.asarray(a), device=device, **kw)


# ----------------------------------------------------------------------------- golden values from PyTorch
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    fn, names, grad, *rtol = CASES[case]
    check_case(case, golden, LIB, fn, names, grad, device, grad_tol=(rtol[0] if rtol else 1e-9, 1e-12))


# ----------------------------------------------------------------------------- embedding_bag / EmbeddingBag
def test_embedding_bag_layouts_empty_bags_and_module(device):
    w = flame.randn(6, 3, dtype=flame.float64, device=device)
    idx, off = T([1, 2, 4, 5, 4, 3], device), T([0, 2, 2, 6], device)
    bags = [[1, 2], [], [4, 5, 4, 3], []]
    for mode, red in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
        want = np.stack([red(npa(w)[b], 0) if b else np.zeros(3) for b in bags])
        np.testing.assert_allclose(npa(F.embedding_bag(idx, w, off, mode=mode)), want, rtol=1e-12)
        np.testing.assert_allclose(npa(F.embedding_bag(idx.int(), w, off.int(), mode=mode)), want, rtol=1e-12)
        rows = F.embedding_bag(idx[:4].reshape(2, 2), w, mode=mode)                  # 2-D: one bag per row
        np.testing.assert_allclose(npa(rows), np.stack([red(npa(w)[[1, 2]], 0), red(npa(w)[[4, 5]], 0)]))
    last = F.embedding_bag(idx, w, T([0, 2, 6], device), include_last_offset=True)
    assert tuple(last.shape) == (2, 3)
    assert tuple(F.embedding_bag(idx[:0], w, T([0, 0], device)).shape) == (2, 3)
    bag = nn.EmbeddingBag.from_pretrained(w, mode="max")
    assert not bag.weight.requires_grad
    np.testing.assert_array_equal(npa(bag(idx, off)), npa(F.embedding_bag(idx, w, off, mode="max")))
    assert nn.EmbeddingBag.from_pretrained(w, freeze=False).weight.requires_grad
    fresh = nn.EmbeddingBag(5, 2, padding_idx=-1, mode="sum", device=device)
    assert fresh.padding_idx == 4 and not np.any(npa(fresh.weight[4]))
    assert repr(fresh) == "EmbeddingBag(5, 2, mode='sum', padding_idx=4)"


def test_embedding_bag_scale_grad_by_freq_divides_by_each_rows_count(device):
    w = flame.randn(8, 2, dtype=flame.float64, device=device, requires_grad=True)
    idx = T([0, 3, 3, 4, 4, 4, 4, 7], device)
    F.embedding_bag(idx, w, T([0, 3], device), mode="sum", scale_grad_by_freq=True).sum().backward()
    # each occurrence contributes 1 / (its row's count): every row that appears gets 1 in total
    np.testing.assert_allclose(npa(w.grad)[:, 0], [1, 0, 0, 1, 1, 0, 0, 1])


def test_embedding_bag_max_norm_renormalises_the_rows_looked_up(device):
    w = flame.tensor([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0]], device=device)
    F.embedding_bag(T([0, 1], device), w, T([0], device), max_norm=1.0)
    np.testing.assert_allclose(npa(w), [[0.6, 0.8], [0.3, 0.4], [6.0, 8.0]], rtol=1e-6)   # row 2 not looked up


@pytest.mark.parametrize("call, err, match", [
    (lambda w, i, o: F.embedding_bag(i.reshape(2, 3), w, o), ValueError, "offsets has to be None"),
    (lambda w, i, o: F.embedding_bag(i, w), ValueError, "offsets has to be a 1D Tensor"),
    (lambda w, i, o: F.embedding_bag(i, w, o + 1), ValueError, "offsets\\[0\\] has to be 0"),
    (lambda w, i, o: F.embedding_bag(i, w, o.reshape(2, 1)), ValueError, "1D"),
    (lambda w, i, o: F.embedding_bag(i, w, o, mode="mean", per_sample_weights=flame.ones(6)), NotImplementedError,
     "only supported for mode='sum'"),
    (lambda w, i, o: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=flame.ones(5)), ValueError,
     "same shape as the input"),
    (lambda w, i, o: F.embedding_bag(i, w, o, sparse=True), NotImplementedError, "sparse=True"),
    (lambda w, i, o: F.embedding_bag(i, w, o, mode="median"), ValueError, "sum, mean or max"),
    (lambda w, i, o: F.embedding_bag(i, w, o, padding_idx=6), ValueError, "padding_idx"),
    (lambda w, i, o: F.embedding_bag(i, w, o, mode="max", scale_grad_by_freq=True), ValueError, "max mode"),
    (lambda w, i, o: F.embedding_bag(i + 3, w, o), IndexError, "indices must be in \\[0, 6\\)"),
    (lambda w, i, o: F.embedding_bag(i.float(), w, o), flame.DTypeError, "integers"),
    (lambda w, i, o: F.embedding_bag(i, w[0], o), ValueError, "2D"),
    (lambda w, i, o: F.embedding_bag(i.reshape(1, 2, 3), w), ValueError, "1D or 2D"),
    (lambda w, i, o: nn.EmbeddingBag(6, 3, _weight=w[:3]), ValueError, "_weight"),
])
def test_embedding_bag_errors(call, err, match):
    w, i, o = flame.randn(6, 3), flame.tensor([0, 1, 2, 3, 4, 5]), flame.tensor([0, 3])
    with pytest.raises(err, match=match):
        call(w, i, o)


# ----------------------------------------------------------------------------- ctc_loss / CTCLoss
def _ctc_brute_force(lp, target, blank):
    """-log of the summed probability of every path of length T whose collapse (repeats merged, blanks dropped) is
    the target."""
    T_, C = lp.shape
    total = 0.0
    for path in np.ndindex(*(C,) * T_):
        collapsed = [c for k, c in enumerate(path) if c != blank and (k == 0 or c != path[k - 1])]
        if collapsed == list(target):
            total += math.exp(sum(lp[t, c] for t, c in enumerate(path)))
    return -math.log(total) if total else math.inf


def test_ctc_loss_is_the_sum_over_alignments(device):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 4))
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    targets, il, tl = np.array([[1, 1, 0], [2, 3, 1], [3, 0, 0]]), [5, 4, 2], [2, 3, 0]
    got = npa(F.ctc_loss(T(lp, device), T(targets, device), il, tl, blank=0, reduction="none"))
    want = [_ctc_brute_force(lp[:il[n], n], targets[n, :tl[n]], 0) for n in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    # blank 1 with classes 0 and 1 swapped (columns and labels): the same figures
    swapped = lp[:, :, [1, 0, 2, 3]]
    got = npa(F.ctc_loss(T(swapped, device), T(np.where(targets == 1, 0, targets), device), il, tl, blank=1,
                         reduction="none"))
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_ctc_loss_reductions_module_lengths_and_infeasible(device):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 2, 5))
    lp = T(x - np.log(np.exp(x).sum(-1, keepdims=True)), device)
    tg, il, tl = T([[1, 2, 3], [4, 0, 0]], device), T([6, 1], device), T([3, 2], device)
    none = npa(F.ctc_loss(lp, tg, il, tl, reduction="none"))
    assert np.isinf(none[1])                                    # 2 labels cannot fit in 1 frame
    # its gradient, as PyTorch's: NaN for every class within its input length (the loss is +inf), zero after it
    lpg = lp.detach().requires_grad_()
    F.ctc_loss(lpg, tg, il, tl, reduction="sum").backward()
    g = npa(lpg.grad)
    assert np.isnan(g[:1, 1]).all() and (g[1:, 1] == 0).all() and np.isfinite(g[:, 0]).all()
    assert npa(F.ctc_loss(lp, tg, il, tl, reduction="sum", zero_infinity=True)) == pytest.approx(none[0])
    il = T([6, 4], device)
    none = npa(F.ctc_loss(lp, tg, il, tl, reduction="none"))
    assert npa(F.ctc_loss(lp, tg, il, tl)) == pytest.approx((none / [3, 2]).mean())
    assert npa(nn.CTCLoss(reduction="sum")(lp, tg, [6, 4], (3, 2))) == pytest.approx(none.sum())
    half = F.ctc_loss(lp.float(), tg, il, tl, reduction="none")
    assert half.dtype == flame.float32
    np.testing.assert_allclose(npa(half), none, rtol=1e-5)
    one = F.ctc_loss(lp[:, 0], tg[0], 6, 3, reduction="none")
    assert one.shape == () and npa(one) == pytest.approx(none[0])


@pytest.mark.parametrize("kw, err, match", [
    (dict(blank=5), ValueError, "blank"),
    (dict(input_lengths=[7, 6]), ValueError, "at most T"),
    (dict(input_lengths=[6]), flame.ShapeError, "batch_size"),
    (dict(target_lengths=[4, 2]), flame.ShapeError, "max\\(target_lengths\\)"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(targets=[[1, 7, 2], [1, 0, 0]]), IndexError, "labels"),
    (dict(targets=[1, 2]), flame.ShapeError, "1-D targets"),
    (dict(input_lengths=[6.0, 5.0]), TypeError, "integers"),
])
def test_ctc_loss_errors(kw, err, match):
    args = dict(log_probs=flame.randn(6, 2, 5).log_softmax(-1), targets=[[1, 2, 3], [1, 0, 0]],
                input_lengths=[6, 5], target_lengths=[3, 1])
    args.update(kw)
    args["targets"] = flame.tensor(args["targets"])
    with pytest.raises(err, match=match):
        F.ctc_loss(**args)


# ----------------------------------------------------------------------------- rrelu, alpha dropout, in-place forms
def test_rrelu_training_draws_one_slope_per_negative_element(device):
    flame.manual_seed(0)
    x = flame.tensor(np.r_[-np.linspace(0.5, 2.0, 20000), np.linspace(0.1, 1.0, 100)], dtype=flame.float64,
                     device=device, requires_grad=True)
    y = F.rrelu(x, 0.1, 0.4, training=True)
    y.sum().backward()
    slopes = npa(y)[:20000] / npa(x)[:20000]
    assert slopes.min() >= 0.1 and slopes.max() <= 0.4
    assert slopes.mean() == pytest.approx(0.25, abs=0.005) and slopes.var() == pytest.approx(0.3 ** 2 / 12, rel=0.05)
    np.testing.assert_array_equal(npa(y)[20000:], npa(x)[20000:])
    np.testing.assert_allclose(npa(x.grad)[:20000], slopes, rtol=1e-12)          # the gradient is the drawn slope
    np.testing.assert_array_equal(npa(x.grad)[20000:], 1.0)
    flame.manual_seed(0)
    np.testing.assert_array_equal(npa(F.rrelu(x, 0.1, 0.4, training=True)), npa(y))   # FLAME's generator
    m = nn.RReLU(0.1, 0.4)
    assert not np.array_equal(npa(m(x)), npa(m.eval()(x)))
    np.testing.assert_array_equal(npa(m(x)), npa(F.leaky_relu(x, 0.25)))
    z = x.detach().clone()
    assert F.rrelu_(z, 0.1, 0.4, training=True) is z and np.all(npa(z)[:20000] > npa(x)[:20000])
    with pytest.raises(ValueError, match="lower bound"):
        F.rrelu(x, 0.5, 0.2)


def test_alpha_dropout_keeps_mean_and_variance(device):
    flame.manual_seed(1)
    x = flame.randn(400, 500, dtype=flame.float64, device=device, requires_grad=True)
    assert F.alpha_dropout(x, 0.3) is x and F.alpha_dropout(x, 0.0, training=True) is x     # eval default, p = 0
    y = F.alpha_dropout(x, 0.3, training=True)
    a = 1.0 / math.sqrt((1.7580993408473766 ** 2 * 0.3 + 1.0) * 0.7)
    dropped = np.isclose(npa(y), a * (-1.7580993408473766 * 0.7))
    assert dropped.mean() == pytest.approx(0.3, abs=0.005)
    assert npa(y).mean() == pytest.approx(0.0, abs=0.01) and npa(y).var() == pytest.approx(1.0, abs=0.02)
    np.testing.assert_allclose(npa(y)[~dropped], a * npa(x)[~dropped] + 1.7580993408473766 * a * 0.3, rtol=1e-12)
    y.sum().backward()
    np.testing.assert_allclose(npa(x.grad), np.where(dropped, 0.0, a), rtol=1e-12)
    assert not np.any(npa(F.alpha_dropout(x, 1.0, training=True)))
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.alpha_dropout(x, 1.5, training=True)


def test_feature_alpha_dropout_drops_whole_channels_and_modules(device):
    flame.manual_seed(2)
    x = flame.randn(50, 40, 3, 4, device=device)
    y = npa(F.feature_alpha_dropout(x, 0.5, training=True)).reshape(50, 40, 12)
    a = 1.0 / math.sqrt((1.7580993408473766 ** 2 * 0.5 + 1.0) * 0.5)
    dropped = np.all(np.isclose(y, a * (-1.7580993408473766 * 0.5), rtol=1e-5), axis=-1)
    assert dropped.mean() == pytest.approx(0.5, abs=0.05)
    kept = ~dropped
    np.testing.assert_allclose(y[kept], (a * npa(x).reshape(50, 40, 12) + 1.7580993408473766 * a * 0.5)[kept],
                               rtol=1e-5, atol=1e-6)
    for m in (nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.2)):
        assert m.eval()(x) is x
    flame.manual_seed(3)
    y1 = nn.FeatureAlphaDropout(0.2)(x)
    flame.manual_seed(3)
    np.testing.assert_array_equal(npa(y1), npa(F.feature_alpha_dropout(x, 0.2, training=True)))
    row = x[0, 0, 0]
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        F.feature_alpha_dropout(row, 0.5, training=True)
    assert F.feature_alpha_dropout(row, 0.5) is row                    # eval: the input, whatever its shape


@pytest.mark.parametrize("name, args", [("relu_", ()), ("elu_", (0.5,)), ("celu_", (2.0,)), ("selu_", ()),
                                        ("leaky_relu_", (0.1,)), ("hardtanh_", (-0.3, 0.6)),
                                        ("threshold_", (0.2, -1.0)), ("rrelu_", (0.1, 0.3))])
def test_inplace_functionals_write_the_input(device, name, args):
    x = flame.randn(4, 5, dtype=flame.float64, device=device)
    want = getattr(F, name[:-1])(x, *args)
    y = x.clone()
    version = y._version[0]
    assert getattr(F, name)(y, *args) is y and y._version[0] > version
    np.testing.assert_array_equal(npa(y), npa(want))


def test_inplace_functionals_refuse_what_cannot_be_undone():
    x = flame.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="negative_slope"):
        F.leaky_relu_(x * 1.0, -0.1)


# ----------------------------------------------------------------------------- pooling, unpooling, lp_pool3d
def test_with_indices_names_and_adaptive_max_pool1d(device):
    x = flame.randn(2, 3, 4, 6, 5, device=device)
    pairs = [(F.max_pool1d_with_indices(x[:, :, 0, 0], 2), F.max_pool1d(x[:, :, 0, 0], 2, return_indices=True)),
             (F.max_pool2d_with_indices(x[:, :, 0], 2, 1), F.max_pool2d(x[:, :, 0], 2, 1, return_indices=True)),
             (F.max_pool3d_with_indices(x, 2), F.max_pool3d(x, 2, return_indices=True)),
             (F.adaptive_max_pool1d_with_indices(x[:, :, 0, 0], 3), F.adaptive_max_pool1d(x[:, :, 0, 0], 3, True)),
             (F.adaptive_max_pool2d_with_indices(x[:, :, 0], 2), F.adaptive_max_pool2d(x[:, :, 0], 2, True)),
             (F.adaptive_max_pool3d_with_indices(x, 2), F.adaptive_max_pool3d(x, 2, True))]
    for got, want in pairs:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(npa(g), npa(w))
    m = nn.AdaptiveMaxPool1d(3)
    np.testing.assert_array_equal(npa(m(x[:, :, 0, 0])), npa(F.adaptive_max_pool1d(x[:, :, 0, 0], 3)))
    assert repr(m) == "AdaptiveMaxPool1d(output_size=3)"


def test_max_unpool_places_each_maximum_and_checks_sizes(device):
    x = flame.randn(3, 4, 6, 8, device=device)                                  # unbatched (C, D, H, W)
    out, idx = F.max_pool3d(x, 2, return_indices=True)
    up = F.max_unpool3d(out, idx, 2)
    kept = npa(up) != 0
    np.testing.assert_array_equal(npa(up)[kept], npa(x)[kept])
    assert kept.sum() == out.numel()
    np.testing.assert_array_equal(npa(nn.MaxUnpool3d(2)(out, idx)), npa(up))
    assert tuple(nn.MaxUnpool3d(2)(out, idx, output_size=(5, 7, 9)).shape) == (3, 5, 7, 9)
    x1 = flame.randn(2, 3, 9, device=device)
    out, idx = F.max_pool1d(x1, 3, return_indices=True)
    np.testing.assert_array_equal(npa(nn.MaxUnpool1d(3)(out, idx)), npa(F.max_unpool1d(out, idx, 3)))
    assert repr(nn.MaxUnpool2d(2)) == "MaxUnpool2d(kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))"
    with pytest.raises(ValueError, match="invalid output_size"):
        F.max_unpool1d(out, idx, 3, output_size=[12])
    with pytest.raises(ValueError, match="1 or 3 elements"):
        F.max_unpool1d(out, idx, 3, output_size=[9, 9])
    with pytest.raises(IndexError, match="outside"):
        F.max_unpool3d(flame.ones(1, 1, 1, 1, 1), flame.tensor([[[[[8]]]]]), 2)
    with pytest.raises(flame.ShapeError, match="do not match"):
        F.max_unpool3d(flame.ones(1, 1, 1, 1, 1), flame.zeros(1, 1, 1, 1, 2, dtype=flame.int64), 2)
    with pytest.raises(flame.DTypeError, match="int64"):
        F.max_unpool3d(flame.ones(1, 1, 1, 1, 1), flame.zeros(1, 1, 1, 1, 1), 2)


def test_lp_pool3d_module_is_its_function(device):
    x = flame.rand(2, 3, 4, 5, 6, device=device)
    np.testing.assert_array_equal(npa(nn.LPPool3d(2, (2, 2, 3), stride=1)(x)),
                                  npa(F.lp_pool3d(x, 2.0, (2, 2, 3), 1)))
    assert tuple(F.lp_pool3d(x, 1.0, 2).shape) == (2, 3, 2, 2, 3)
    np.testing.assert_allclose(npa(F.lp_pool3d(x, 1.0, 2)), npa(F.avg_pool3d(x, 2)) * 8, rtol=1e-5)


# ----------------------------------------------------------------------------- multilabel_margin_loss, BatchNorm3d
def test_multilabel_margin_loss_errors_and_module():
    x = flame.randn(2, 4)
    t = flame.tensor([[3, 0, -1, 1], [1, 2, 3, 0]])
    np.testing.assert_array_equal(npa(nn.MultiLabelMarginLoss(reduction="none")(x, t)),
                                  npa(F.multilabel_margin_loss(x, t, reduction="none")))
    assert npa(F.multilabel_margin_loss(x, flame.full((2, 4), -1, dtype=flame.int64), reduction="sum")) == 0
    for target, err, match in [(flame.tensor([[0, 4, -1, 0], [1, -1, 0, 0]]), IndexError, "class indices"),
                               (flame.tensor([[0, 1, -1], [1, -1, 0]]), flame.ShapeError, "inconsistent"),
                               (t.float(), flame.DTypeError, "int64")]:
        with pytest.raises(err, match=match):
            F.multilabel_margin_loss(x, target)
    with pytest.raises(flame.ShapeError, match="\\(C,\\) or \\(N, C\\)"):
        F.multilabel_margin_loss(flame.randn(2, 3, 4), flame.zeros(2, 3, 4, dtype=flame.int64))


def test_batch_norm3d_eval_bias_flag_and_dims(device):
    bn = nn.BatchNorm3d(3, device=device)
    x = flame.randn(2, 3, 2, 3, 4, device=device) * 2 + 1
    bn(x)
    bn.eval()
    want = (npa(x) - npa(bn.running_mean).reshape(1, 3, 1, 1, 1)) / np.sqrt(
        npa(bn.running_var).reshape(1, 3, 1, 1, 1) + 1e-5)
    np.testing.assert_allclose(npa(bn(x)), want, rtol=1e-5, atol=1e-6)
    no_bias = nn.BatchNorm3d(3, bias=False)
    assert no_bias.bias is None and list(no_bias.state_dict())[:2] == ["weight", "running_mean"]
    with pytest.raises(ValueError, match="5D"):
        bn(x[0])


# ----------------------------------------------------------------------------- nn.Buffer, lazy modules
def test_buffer_registers_itself_with_its_persistence(device):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.kept = nn.Buffer(flame.ones(2, device=device))
            self.scratch = nn.Buffer(flame.zeros(3, device=device), persistent=False)

    net = Net()
    assert isinstance(net.kept, nn.Buffer) and isinstance(net.kept, flame.Tensor)
    assert not isinstance(flame.ones(1), nn.Buffer)
    assert [n for n, _ in net.named_buffers()] == ["kept", "scratch"] and list(net.state_dict()) == ["kept"]
    net.scratch = flame.ones(3, device=device)                       # a plain tensor keeps the buffer's persistence
    assert list(net.state_dict()) == ["kept"]
    net.load_state_dict({"kept": np.array([5.0, 6.0], dtype=np.float32)})
    np.testing.assert_array_equal(npa(net.kept), [5.0, 6.0])
    t = flame.ones(2, requires_grad=True)
    b = nn.Buffer(t)
    assert b is not t and b.requires_grad and b.grad_fn is None and b.persistent
    assert tuple(nn.Buffer().shape) == (0,)
    with pytest.raises(TypeError, match="Tensor"):
        nn.Buffer([1.0])


def test_lazy_linear_infers_in_features_at_the_first_call(device):
    lazy = nn.LazyLinear(3, dtype=flame.float64, device=device)
    assert repr(lazy) == "LazyLinear(in_features=0, out_features=3, bias=True)" and not list(lazy.parameters())
    with pytest.raises(nn.StateDictError, match="first forward"):
        nn.Sequential(lazy).state_dict()
    x = flame.randn(2, 5, dtype=flame.float64, device=device)
    y = lazy(x)
    assert type(lazy) is nn.Linear and lazy.in_features == 5 and tuple(lazy.weight.shape) == (3, 5)
    assert lazy.weight.dtype == flame.float64 and [n for n, _ in lazy.named_parameters()] == ["weight", "bias"]
    np.testing.assert_allclose(npa(y), npa(F.linear(x, lazy.weight, lazy.bias)), rtol=1e-12)
    assert list(lazy.state_dict()) == ["weight", "bias"]
    assert nn.LazyLinear(2, bias=False)(x.float()).shape == (2, 2)


def test_lazy_batch_norm_infers_num_features(device):
    bn = nn.LazyBatchNorm2d(momentum=0.5, device=device)
    x = flame.randn(4, 3, 2, 2, device=device)
    y = bn(x)
    assert type(bn) is nn.BatchNorm2d and bn.num_features == 3 and bn.momentum == 0.5
    assert list(bn.state_dict()) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    ref = nn.BatchNorm2d(3, momentum=0.5, device=device)
    np.testing.assert_allclose(npa(y), npa(ref(x)), rtol=1e-6)
    np.testing.assert_allclose(npa(bn.running_var), npa(ref.running_var), rtol=1e-6)
    with pytest.raises(ValueError, match="5D"):
        nn.LazyBatchNorm3d()(x)


def test_embedding_from_pretrained_shares_and_freezes(device):
    w = flame.randn(5, 3, device=device)
    emb = nn.Embedding.from_pretrained(w)
    assert not emb.weight.requires_grad and emb.weight.data_ptr() == w.data_ptr()
    assert nn.Embedding.from_pretrained(w, freeze=False).weight.requires_grad
    np.testing.assert_array_equal(emb(flame.tensor([4, 0], device=device)).cpu().numpy(), w.cpu().numpy()[[4, 0]])
    assert repr(nn.Embedding(5, 3, padding_idx=-1, max_norm=2.0)) == "Embedding(5, 3, padding_idx=4, max_norm=2.0)"
    with pytest.raises(ValueError, match="2-dimensional"):
        nn.Embedding.from_pretrained(flame.zeros(3, device=device))
    with pytest.raises(NotImplementedError, match="sparse"):
        nn.Embedding(4, 2, sparse=True)
    with pytest.raises(NotImplementedError, match="sparse"):
        F.embedding(flame.tensor([0], device=device), w, sparse=True)
    with pytest.raises(ValueError, match="padding_idx 7 must be within num_embeddings 5"):
        F.embedding(flame.tensor([0], device=device), w, padding_idx=7)


def test_lazy_modules_follow_to_before_their_first_forward(device):
    m = nn.LazyLinear(3).to(device).double()
    y = m(flame.randn(2, 5, dtype=flame.float64, device=device))
    assert type(m) is nn.Linear and m.weight.dtype == flame.float64 and m.weight.device == device
    assert tuple(y.shape) == (2, 3) and m.in_features == 5
    bn = nn.LazyBatchNorm1d().to(device, dtype=flame.float64)
    bn(flame.randn(4, 6, dtype=flame.float64, device=device))
    assert bn.running_mean.dtype == flame.float64 and bn.num_features == 6


def test_rnn_rejects_a_packed_input_of_the_wrong_width(device):
    from flame_nn.utils.rnn import pack_sequence
    packed = pack_sequence([flame.randn(3, 6, device=device), flame.randn(2, 6, device=device)])
    with pytest.raises(flame.ShapeError, match="input_size=5"):
        nn.GRU(5, 4).to(device)(packed)
    out, h = nn.GRU(6, 4).to(device)(packed)
    assert tuple(out.data.shape) == (5, 4) and tuple(h.shape) == (1, 2, 4)
