"""flame_nn.utils' torch.nn.utils surface (rnn packing, parametrize / parametrizations, clipping norms, fusion,
skip_init, functional_call, weight memory format) and flame_nn.init's dirac_ / eye_ / sparse_ and deprecated aliases,
against PyTorch 2.13 (golden values: tests/fixtures/make_utils_parity_fixtures.py), with float64 gradient checks."""
import copy
import math
import os
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
import flame_nn as nn
from flame_core.autograd import gradcheck
from flame_nn.utils import parametrize, rnn
from flame_nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm
from flame_nn.utils.stateless import functional_call

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "utils_parity.safetensors")


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


def _np(t):
    return t.detach().cpu().numpy()


def _close(actual, expected, rtol=1e-10, atol=1e-12, msg=""):
    np.testing.assert_allclose(_np(actual) if isinstance(actual, flame.Tensor) else actual, expected, rtol=rtol,
                               atol=atol, err_msg=msg)


def _prefixed(golden, prefix, device):
    return {k[len(prefix):]: flame.tensor(v, device=device) for k, v in golden.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------------------------------------------ rnn
def test_rnn_packing_matches_pytorch(golden, device):
    seqs = [flame.tensor(golden[f"rnn.seq.{i}"], device=device, requires_grad=True) for i in range(3)]
    _close(rnn.pad_sequence(seqs), golden["rnn.pad_right"])
    _close(rnn.pad_sequence(seqs, batch_first=True, padding_value=-1.0, padding_side="left"),
           golden["rnn.pad_left_bf"])
    packed = rnn.pack_sequence(seqs, enforce_sorted=False)
    assert packed._fields == ("data", "batch_sizes", "sorted_indices", "unsorted_indices")
    for field in packed._fields:
        _close(getattr(packed, field), golden[f"rnn.pack.{field}"], msg=field)
    assert packed.batch_sizes.device.type == "cpu" and packed.sorted_indices.device == packed.data.device
    padded, lengths = rnn.pad_packed_sequence(packed, batch_first=True, padding_value=0.5, total_length=4)
    _close(padded, golden["rnn.unpacked"])
    assert lengths.tolist() == golden["rnn.lengths"].tolist() and lengths.device.type == "cpu"
    (padded * flame.tensor(golden["rnn.unpacked_go"], device=device)).sum().backward()
    for i, s in enumerate(seqs):
        _close(s.grad, golden[f"rnn.grad.{i}"])
    batch = flame.tensor(golden["rnn.pp.input"], device=device, requires_grad=True)
    data = rnn.pack_padded_sequence(batch, flame.tensor([2, 4, 1]), batch_first=True, enforce_sorted=False).data
    _close(data, golden["rnn.pp.data"])
    (data * flame.tensor(golden["rnn.pp.go"], device=device)).sum().backward()
    _close(batch.grad, golden["rnn.pp.grad"])


def test_rnn_round_trips_and_packed_sequence(device):
    seqs = [flame.randn(n, 2, device=device) for n in (2, 4, 1)]
    for got, want in zip(rnn.unpack_sequence(rnn.pack_sequence(seqs, enforce_sorted=False)), seqs):
        _close(got, _np(want))
    padded = rnn.pad_sequence(seqs)
    for got, want in zip(rnn.unpad_sequence(padded, flame.tensor([2, 4, 1])), seqs):
        _close(got, _np(want))
    packed = rnn.pack_sequence(sorted(seqs, key=len, reverse=True))
    assert packed.sorted_indices is None and packed.unsorted_indices is None
    assert packed.batch_sizes.tolist() == [3, 2, 1, 1]
    cast = packed.to(flame.float64)
    assert isinstance(cast, rnn.PackedSequence) and cast.data.dtype == flame.float64 and packed.double().data.dtype \
        == flame.float64 and cast.is_cuda == (device.type == "cuda")
    assert rnn.invert_permutation(None) is None
    assert rnn.invert_permutation(flame.tensor([2, 0, 1])).tolist() == [1, 2, 0]
    again = rnn.PackedSequence(packed.data, packed.batch_sizes, flame.tensor([1, 0, 2]))
    assert again.unsorted_indices.tolist() == [1, 0, 2]
    legacy = rnn.PackedSequence((packed.data, packed.batch_sizes))          # PyTorch's (data, batch_sizes) form
    assert legacy.batch_sizes is packed.batch_sizes and legacy.data is packed.data and legacy.sorted_indices is None
    with pytest.raises(TypeError, match="one \\(data, batch_sizes\\) pair"):
        rnn.PackedSequence(packed.data)
    if device.type == "cuda":   # batch_sizes are read on the host: PyTorch refuses them on a GPU
        with pytest.raises(ValueError, match="batch_sizes should always be on CPU"):
            rnn.PackedSequence(packed.data, packed.batch_sizes.to(device))
    assert rnn.pad_sequence(flame.ones(2, 3)).shape == (3, 2)  # a tensor: its rows are the sequences


@pytest.mark.parametrize("call, error, match", [
    (lambda x: rnn.pad_sequence([x], padding_side="middle"), RuntimeError, "padding_side"),
    (lambda x: rnn.pad_sequence([]), RuntimeError, "empty list"),
    (lambda x: rnn.pad_sequence([x, x[:, :1]]), RuntimeError, "trailing dims"),
    (lambda x: rnn.pack_padded_sequence(x, [2, 3]), RuntimeError, "sorted in decreasing order"),
    (lambda x: rnn.pack_padded_sequence(x, [3, 0]), RuntimeError, "greater than 0"),
    (lambda x: rnn.pack_padded_sequence(x, [3]), RuntimeError, "batch_size=2"),
    (lambda x: rnn.pack_padded_sequence(x, [4, 2]), RuntimeError, "exceed"),
    (lambda x: rnn.pack_padded_sequence(x, [[3, 2]]), RuntimeError, "1D"),
    (lambda x: rnn.pad_packed_sequence(rnn.pack_padded_sequence(x, [3, 2]), total_length=2), ValueError,
     "total_length=2"),
])
def test_rnn_errors(call, error, match, device):
    with pytest.raises(error, match=match):
        call(flame.ones(3, 2, device=device))


@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=4), features=st.integers(1, 2),
       batch_first=st.booleans(), left=st.booleans())
def test_rnn_gradcheck(lengths, features, batch_first, left):
    rng = np.random.default_rng(len(lengths) * 10 + features)
    seqs = [flame.tensor(rng.standard_normal((n, features)), requires_grad=True) for n in lengths]
    side = "left" if left else "right"
    assert gradcheck(lambda *s: rnn.pad_sequence(list(s), batch_first, 0.25, side), seqs)
    padded = flame.tensor(rng.standard_normal((len(lengths), max(lengths), features)), requires_grad=True)

    def round_trip(x):
        packed = rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return rnn.pad_packed_sequence(packed, batch_first=batch_first, padding_value=-2.0)[0]
    assert gradcheck(round_trip, (padded,))


# ---------------------------------------------------------------------------------------------------------- parametrize
class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).mT


PARAMETRIZED = {  # case: (module, register, train, sd keys that registration draws at random)
    "sym": (lambda: nn.Linear(3, 3), lambda m: parametrize.register_parametrization(m, "weight", Symmetric()), True,
            ()),
    "wn_linear": (lambda: nn.Linear(3, 4), weight_norm, True, ()),
    "wn_conv_all": (lambda: nn.Conv2d(2, 3, 3), lambda m: weight_norm(m, dim=None), True, ()),
    "sn_linear": (lambda: nn.Linear(5, 4), spectral_norm, True, ("0._u", "0._v")),
    "sn_convt": (lambda: nn.ConvTranspose2d(3, 2, 3), spectral_norm, True, ("0._u", "0._v")),
    "sn_eval": (lambda: nn.Linear(5, 4), lambda m: spectral_norm(m, n_power_iterations=2), False, ("0._u", "0._v")),
    "orth_exp": (lambda: nn.Linear(3, 3), orthogonal, True, ()),
    "orth_cayley": (lambda: nn.Linear(3, 3), lambda m: orthogonal(m, orthogonal_map="cayley"), True, ()),
    "orth_hh_wide": (lambda: nn.Linear(4, 3), orthogonal, True, ("0.base",)),
    "orth_hh_tall": (lambda: nn.Linear(2, 4), orthogonal, True, ("0.base",)),
    "orth_hh_notriv": (lambda: nn.Linear(3, 3),
                       lambda m: orthogonal(m, orthogonal_map="householder", use_trivialization=False), True, ()),
    "orth_conv": (lambda: nn.Conv1d(2, 4, 3), orthogonal, True, ("0.base",)),
}


@pytest.mark.parametrize("case", sorted(PARAMETRIZED))
def test_parametrizations_match_pytorch(case, golden, device):
    make, register, train, drawn = PARAMETRIZED[case]
    m = make().double().to(device)
    m.load_state_dict(_prefixed(golden, f"{case}.init.", device))
    register(m)
    want = _prefixed(golden, f"{case}.sd.", device)
    sd = m.state_dict()
    assert set(sd) == set(want)
    for k, v in sd.items():  # right_inverse from the same weight: the same originals (random draws aside)
        if not k.endswith(tuple(drawn)):
            _close(v, _np(want[k]), rtol=1e-9, atol=1e-12, msg=k)
    if case.startswith("orth"):  # the weight itself, whatever the random completion of base
        _close(m.weight, golden[f"{case}.weight"], rtol=1e-9, atol=1e-12)
    m.load_state_dict(want)
    m.train(train)
    out = m(flame.tensor(golden[f"{case}.input"], device=device))
    _close(out, golden[f"{case}.out"], rtol=1e-9, atol=1e-12)
    for k, b in m.named_buffers():
        _close(b, golden[f"{case}.after.{k}"], msg=k)
    (out * flame.tensor(golden[f"{case}.go"], device=device)).sum().backward()
    for k, p in m.named_parameters():
        _close(p.grad, golden[f"{case}.grad.{k}"], rtol=1e-8, atol=1e-11, msg=k)


def test_state_dict_keys_in_pytorch_order():
    assert list(weight_norm(nn.Linear(2, 3)).state_dict()) == [
        "bias", "parametrizations.weight.original0", "parametrizations.weight.original1"]
    assert list(spectral_norm(nn.Linear(2, 3)).state_dict()) == [
        "bias", "parametrizations.weight.original", "parametrizations.weight.0._u", "parametrizations.weight.0._v"]
    assert list(orthogonal(nn.Linear(2, 3)).state_dict()) == [
        "bias", "parametrizations.weight.original", "parametrizations.weight.0.base"]
    assert tuple(weight_norm(nn.Conv2d(2, 3, 3), dim=None).parametrizations.weight.original0.shape) == ()
    assert tuple(weight_norm(nn.Linear(2, 3), dim=1).parametrizations.weight.original0.shape) == (1, 2)
    m = nn.Linear(2, 3)
    m.register_buffer("buf", flame.ones(2))
    parametrize.register_parametrization(m, "buf", Symmetric(), unsafe=True)
    assert list(m.state_dict()) == ["weight", "bias", "parametrizations.buf.original"]
    assert [k for k, _ in m.named_buffers()] == ["parametrizations.buf.original"]


class Twice(nn.Module):
    def forward(self, x):
        return 2 * x

    def right_inverse(self, x):
        return x / 2


def test_register_right_inverse_cache_and_remove(device):
    m = nn.Linear(2, 3).to(device)
    w0, original = _np(m.weight), m.weight
    parametrize.register_parametrization(m, "weight", Twice())
    assert type(m).__name__ == "ParametrizedLinear" and parametrize.type_before_parametrizations(m) is nn.Linear
    assert m.parametrizations.weight.original is original and parametrize.is_parametrized(m, "weight")
    _close(m.weight, w0, rtol=1e-6)
    _close(original, w0 / 2, rtol=1e-6)
    parametrize.register_parametrization(m, "weight", Twice())  # appended: the originals stay
    _close(m.weight, 2 * w0, rtol=1e-6)
    m.weight = flame.ones(3, 2, device=device)  # right_inverse of every parametrization, last first
    _close(original, np.full((3, 2), 0.25))
    with pytest.raises(ValueError, match="dtype"):
        m.weight = flame.ones(3, 2, dtype=flame.float64, device=device)
    with pytest.raises(KeyError, match="already exists"):
        m.weight = nn.Parameter(flame.ones(3, 2))
    assert m.weight is not m.weight
    with parametrize.cached():
        assert m.weight is m.weight
    parametrize.register_parametrization(m, "bias", Twice())
    parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
    assert m.weight is original and type(m).__name__ == "ParametrizedLinear"
    assert list(m.state_dict()) == ["weight", "parametrizations.bias.original"]
    parametrize.remove_parametrizations(m, "bias")
    assert type(m) is nn.Linear and not hasattr(m, "parametrizations") and not parametrize.is_parametrized(m)
    with pytest.raises(ValueError, match="does not have a parametrization on weight"):
        parametrize.remove_parametrizations(m, "weight")
    wn = weight_norm(nn.Linear(2, 3).to(device))
    want = _np(wn.weight)
    with pytest.raises(ValueError, match="sequence of tensors"):
        parametrize.remove_parametrizations(wn, "weight", leave_parametrized=False)
    parametrize.remove_parametrizations(wn, "weight")
    assert isinstance(wn.weight, nn.Parameter) and wn.weight.requires_grad and list(wn.state_dict()) == ["bias",
                                                                                                      "weight"]
    _close(wn.weight, want)


class ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


class FirstRow(nn.Module):
    def forward(self, x):
        return x[0]


class NotATensor(nn.Module):
    def forward(self, x):
        return 5


class InverseTo(nn.Module):
    def __init__(self, inverse):
        super().__init__()
        self.inverse = inverse

    def forward(self, *x):
        return x[0]

    def right_inverse(self, x):
        return self.inverse(x)


@pytest.mark.parametrize("parametrization, match", [
    (ToDouble(), "may not change the dtype"),
    (FirstRow(), "may not change the shape"),
    (NotATensor(), "must return a tensor"),
    (InverseTo(lambda x: x.double()), "may not change the dtype"),
    (InverseTo(lambda x: 3), "Got int"),
    (InverseTo(lambda x: (x, 4)), "element 1"),
])
def test_register_checks(parametrization, match):
    with pytest.raises(ValueError, match=match):
        parametrize.register_parametrization(nn.Linear(2, 3), "weight", parametrization)
    m = parametrize.register_parametrization(nn.Linear(2, 3), "weight", InverseTo(lambda x: x))
    if not isinstance(parametrization, InverseTo):  # appended to an existing list: checked against module.weight
        with pytest.raises(ValueError, match=match):
            parametrize.register_parametrization(m, "weight", parametrization)


def test_register_errors_and_copies():
    with pytest.raises(ValueError, match="parametrized element with name 'nope'"):
        parametrize.register_parametrization(nn.Linear(2, 3), "nope", Symmetric())
    assert parametrize.register_parametrization(nn.Linear(2, 3), "weight", FirstRow(), unsafe=True).weight.shape == (2,)
    m = parametrize.register_parametrization(nn.Linear(3, 3), "weight", Symmetric())
    with pytest.raises(RuntimeError, match="does not implement right_inverse"):
        m.weight = flame.ones(3, 3)
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(m)
    twin = copy.deepcopy(m)
    assert type(twin) is type(m) and twin.parametrizations.weight.original is not m.parametrizations.weight.original
    _close(twin.weight, _np(m.weight))
    assert "ParametrizationList(" in repr(m)
    for make, match in ((lambda: spectral_norm(nn.Linear(2, 3), name="nope"), "no parameter or buffer"),
                        (lambda: orthogonal(nn.Linear(2, 3), orthogonal_map="foo"), "has to be one of"),
                        (lambda: orthogonal(nn.Linear(2, 3), name="bias"), "Got a tensor of 1 dimensions"),
                        (lambda: spectral_norm(nn.Linear(2, 3), n_power_iterations=0), "positive")):
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(IndexError, match="Dimension out of range"):
        spectral_norm(nn.Linear(2, 3), dim=2)


def test_orthogonal_maps_and_assignment(device):
    flame.manual_seed(0)
    for shape, orthogonal_map, want in (((3, 3), None, "matrix_exp"), ((3, 2), None, "householder"),
                                        ((2, 5), None, "householder"), ((3, 3), "cayley", "cayley")):
        m = orthogonal(nn.Linear(shape[1], shape[0]).double().to(device), orthogonal_map=orthogonal_map)
        assert m.parametrizations.weight[0].orthogonal_map == want
        w = m.weight.detach()
        gram = w @ w.mT if shape[0] <= shape[1] else w.mT @ w
        _close(gram, np.eye(min(shape)), atol=1e-12)
    q = flame.linalg.qr(flame.randn(3, 3, dtype=flame.float64, device=device))[0]
    m.weight = q  # an orthogonal weight is kept exactly (base = it, original = -I)
    _close(m.weight, _np(q), atol=1e-12)
    _close(m.parametrizations.weight.original, -np.eye(3))
    with pytest.raises(ValueError, match="Expected a matrix or batch of matrices of shape"):
        m.weight = flame.ones(2, 2, dtype=flame.float64, device=device)
    notriv = orthogonal(nn.Linear(3, 3), orthogonal_map="matrix_exp", use_trivialization=False)
    with pytest.raises(NotImplementedError, match="use_trivialization=False"):
        notriv.weight = flame.eye(3)


@given(n=st.integers(1, 4), k=st.integers(1, 4), batch=st.integers(0, 2),
       orthogonal_map=st.sampled_from(["matrix_exp", "cayley", "householder"]))
def test_orthogonal_gradcheck(n, k, batch, orthogonal_map):
    shape = (2,) * batch + (n, k)
    layer = nn.Linear(1, 1)
    layer.weight = nn.Parameter(flame.randn(*shape, dtype=flame.float64))
    orth = orthogonal(layer, orthogonal_map=orthogonal_map).parametrizations.weight[0]
    rng = np.random.default_rng(n * 100 + k * 10 + batch)
    x = rng.uniform(-0.9, 0.9, shape)
    idx = np.arange(min(n, k))
    x[..., idx, idx] = np.where(rng.random(shape[:-2] + (len(idx),)) < 0.5, -1.5, 1.5)  # away from trunc's steps
    assert gradcheck(orth, (flame.tensor(x, requires_grad=True),))


def test_weight_and_spectral_norm_gradcheck():
    rng = np.random.default_rng(0)
    g = flame.tensor(rng.uniform(0.5, 2, (4, 1)), requires_grad=True)
    v = flame.tensor(rng.standard_normal((4, 3)), requires_grad=True)
    assert gradcheck(weight_norm(nn.Linear(3, 4)).parametrizations.weight[0], (g, v))
    sn = spectral_norm(nn.Linear(3, 4).double()).parametrizations.weight[0].eval()
    assert gradcheck(sn, (flame.tensor(rng.standard_normal((4, 3)), requires_grad=True),))


# ------------------------------------------------------------------------------------------------------------- nn.utils
def test_total_norm_and_clipping_match_pytorch(golden, device):
    tensors = [flame.tensor(golden[f"norm.t{i}"], device=device) for i in range(3)]
    for p in (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0, -1.0):
        _close(nn.utils.get_total_norm(tensors, p), golden[f"norm.p{p}"], msg=str(p))
    _close(nn.utils.get_total_norm(tensors, "inf"), golden["norm.pinf"])
    assert float(nn.utils.get_total_norm([])) == 0.0
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.get_total_norm([flame.tensor([math.inf], device=device)], error_if_nonfinite=True)

    def params():
        ps = [nn.Parameter(flame.zeros_like(t)) for t in tensors]
        for p, t in zip(ps, tensors):
            p.grad = t.clone()
        return ps
    ps = params()
    nn.utils.clip_grads_with_norm_(ps, 0.5, nn.utils.get_total_norm([p.grad for p in ps]))
    for i, p in enumerate(ps):
        _close(p.grad, golden[f"clip.with_norm.{i}"])
    with pytest.raises(TypeError, match="total_norm must be a Tensor"):
        nn.utils.clip_grads_with_norm_(ps, 0.5, 4.0)
    ps = params()
    _close(nn.utils.clip_grad_norm_(ps, 1.0, norm_type="inf"), golden["clip.norm_inf"])
    for i, p in enumerate(ps):
        _close(p.grad, golden[f"clip.grad_inf.{i}"])
    ps = params()
    with pytest.warns(FutureWarning, match="clip_grad_norm_"):
        _close(nn.utils.clip_grad_norm(ps, 1.0, norm_type=0), golden["norm.p0.0"])


@pytest.mark.parametrize("case, transpose", [("fuse_conv", False), ("fuse_convt", True), ("fuse_linear", None)])
def test_fusion_matches_pytorch(case, transpose, golden, device):
    layer = {"fuse_conv": lambda: nn.Conv2d(2, 3, 3), "fuse_convt": lambda: nn.ConvTranspose2d(2, 3, 3),
             "fuse_linear": lambda: nn.Linear(3, 4)}[case]().double().to(device).eval()
    bn = (nn.BatchNorm1d(4) if transpose is None else nn.BatchNorm2d(3)).double().to(device).eval()
    layer.load_state_dict(_prefixed(golden, f"{case}.layer.", device))
    bn.load_state_dict(_prefixed(golden, f"{case}.bn.", device))
    fused = nn.utils.fuse_linear_bn_eval(layer, bn) if transpose is None else \
        nn.utils.fuse_conv_bn_eval(layer, bn, transpose=transpose)
    assert fused is not layer and isinstance(fused.weight, nn.Parameter)
    _close(fused.weight, golden[f"{case}.weight"])
    _close(fused.bias, golden[f"{case}.bias"])
    x = flame.randn(2, 3, dtype=flame.float64, device=device) if transpose is None else \
        flame.randn(1, 2, 5, 5, dtype=flame.float64, device=device)
    _close(fused(x), _np(bn(layer(x))), rtol=1e-9, atol=1e-12)


def test_fusion_errors():
    with pytest.raises(AssertionError, match="Fusion only for eval"):
        nn.utils.fuse_conv_bn_eval(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    with pytest.raises(AssertionError, match="must not be None"):
        nn.utils.fuse_conv_bn_eval(nn.Conv2d(2, 3, 1).eval(), nn.BatchNorm2d(3, track_running_stats=False).eval())
    with pytest.raises(AssertionError, match="bn.num_features=2"):
        nn.utils.fuse_linear_bn_eval(nn.Linear(2, 3).eval(), nn.BatchNorm1d(2).eval())
    fused = nn.utils.fuse_conv_bn_eval(nn.Conv2d(2, 3, 1, bias=False).eval(), nn.BatchNorm2d(3, affine=False).eval())
    assert not fused.bias.requires_grad and fused.bias.shape == (3,)


def test_skip_init(device):
    m = nn.utils.skip_init(nn.Linear, 3, 4, device=device)
    assert type(m) is nn.Linear and m.weight.shape == (4, 3) and not m.weight.is_meta and m.weight.device == device
    assert m(flame.ones(2, 3, device=device)).shape == (2, 4)
    with pytest.raises(RuntimeError, match="Expected a Module"):
        nn.utils.skip_init(int)
    with pytest.raises(RuntimeError, match="'device' arg"):
        nn.utils.skip_init(nn.ReLU)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.b.weight = self.a.weight
        self.register_buffer("buf", flame.zeros(2))

    def forward(self, x, y=0):
        return self.b(self.a(x)) + self.buf + y


def test_functional_call(device):
    m = Tied().to(device)
    x, eye = flame.ones(1, 2, device=device), flame.eye(2, device=device)
    before = {k: v for k, v in m.state_dict(keep_vars=True).items()}

    def manual(wa, wb, buf=None, y=0):
        h = x @ wa.mT + m.a.bias
        return h @ wb.mT + m.b.bias + (m.buf if buf is None else buf) + y
    _close(functional_call(m, {"a.weight": eye}, (x,)), _np(manual(eye, eye)), rtol=1e-6)
    _close(functional_call(m, {"a.weight": eye}, x, tie_weights=False), _np(manual(eye, m.a.weight)), rtol=1e-6)
    ones = flame.ones(2, device=device)
    _close(functional_call(m, ({"a.weight": eye}, {"buf": ones}), (x,), {"y": 10}),
           _np(manual(eye, eye, ones, 10)), rtol=1e-6)
    assert functional_call(m, {"a.weight": eye, "nope": eye}, x) is not None and not hasattr(m, "nope")
    assert m.state_dict(keep_vars=True) == before and m.a.weight is m.b.weight
    with pytest.raises(ValueError, match="which are tied"):
        functional_call(m, {"a.weight": eye, "b.weight": 2 * eye}, x)
    with pytest.raises(ValueError, match="multiple dictionaries"):
        functional_call(m, ({"a.weight": eye}, {"a.weight": eye}), x)
    with pytest.raises(RuntimeError, match="Unexpected key\\(s\\): 'nope'.\n\tMissing key\\(s\\): 'a.bias', "
                                           "'b.bias', 'buf'."):
        functional_call(m, {"a.weight": eye, "nope": eye}, x, strict=True)
    with pytest.raises(AttributeError, match="has no attribute `zz`"):
        functional_call(m, {"zz.nope": eye}, x)
    with pytest.raises(ValueError, match="parametrized"):
        functional_call(weight_norm(nn.Linear(2, 2).to(device)), {"weight": eye}, x)
    with pytest.raises(Exception):
        functional_call(m, {"a.weight": flame.ones(3, 3, device=device)}, x)  # the call fails: originals restored
    assert m.state_dict(keep_vars=True) == before
    w = flame.randn(2, 2, dtype=flame.float64, device=device, requires_grad=True)
    m64 = Tied().double().to(device)
    assert gradcheck(lambda w: functional_call(m64, {"a.weight": w}, x.double()), (w,))


def test_convert_conv2d_weight_memory_format(device):
    model = nn.Sequential(nn.Conv2d(8, 4, 3), nn.ReLU(), nn.Sequential(nn.ConvTranspose2d(4, 8, 3)), nn.Conv1d(2, 2, 1))
    weights = [model[0].weight, model[2][0].weight]
    values = [_np(w) for w in weights]
    assert nn.utils.convert_conv2d_weight_memory_format(model, flame.channels_last) is model
    for w, v, p in zip(weights, values, (model[0].weight, model[2][0].weight)):
        assert p is w and w.is_contiguous(memory_format=flame.channels_last) and not w.is_contiguous()
        _close(w, v)
    nn.utils.convert_conv2d_weight_memory_format(model, flame.contiguous_format)
    assert all(w.is_contiguous() for w in weights)
    with pytest.raises(ValueError, match="preserve_format"):
        nn.utils.convert_conv2d_weight_memory_format(model, flame.preserve_format)


# -------------------------------------------------------------------------------------------------------------- nn.init
def test_dirac_and_eye_match_pytorch(golden, device):
    for key in [k for k in golden if k.startswith("init.dirac.")]:
        shape, groups = key.split(".")[2], int(key.split(".")[3][1:])
        t = nn.init.dirac_(flame.empty(*map(int, shape.split("x")), device=device), groups)
        _close(t, golden[key], msg=key)
    _close(nn.init.eye_(flame.empty(3, 5, device=device)), golden["init.eye.3x5"])
    p = nn.Parameter(flame.ones(3, 3, device=device))
    assert nn.init.eye_(p) is p and p.requires_grad
    for call, match in ((lambda: nn.init.dirac_(flame.empty(2, 3)), "3, 4, or 5 dimensions"),
                        (lambda: nn.init.dirac_(flame.empty(5, 4, 3), groups=2), "divisible by groups"),
                        (lambda: nn.init.eye_(flame.empty(3)), "2 dimensions"),
                        (lambda: nn.init.sparse_(flame.empty(3, 3, 3), 0.5), "2 dimensions")):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("rows, cols, sparsity", [(5, 3, 0.5), (10, 4, 0.1), (4, 6, 0.0), (3, 2, 1.5)])
def test_sparse_structure(rows, cols, sparsity, device):
    draw = lambda: nn.init.sparse_(flame.empty(rows, cols, device=device), sparsity, std=0.5,  # noqa: E731
                                   generator=flame.Generator(device).manual_seed(3))
    t = _np(draw())
    assert ((t == 0).sum(0) == min(math.ceil(sparsity * rows), rows)).all()
    np.testing.assert_array_equal(t, _np(draw()))  # the generator's draws only
    assert np.abs(t).max() < 0.5 * 6


@pytest.mark.parametrize("name, args", [("normal", ()), ("uniform", ()), ("constant", (0.5,)),
                                        ("xavier_uniform", ()), ("xavier_normal", ()), ("kaiming_uniform", ()),
                                        ("kaiming_normal", ()), ("orthogonal", ()), ("eye", ()), ("dirac", ()),
                                        ("sparse", (0.5,))])
def test_deprecated_init_aliases(name, args):
    t = flame.empty(3, 3, 3) if name == "dirac" else flame.empty(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(nn.init, name)(t, *args) is t
    assert [(w.category, str(w.message), w.filename) for w in caught] == [
        (FutureWarning, f"`nn.init.{name}` is now deprecated in favor of `nn.init.{name}_`.", __file__)]
