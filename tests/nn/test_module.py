"""Module / Parameter / containers: registration, traversal, modes, device-dtype moves, hooks, repr, state_dict."""
import copy
from collections import OrderedDict

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core import grad_pool


def npa(t):
    return t.detach().numpy().astype(np.float64)


class Block(nn.Module):
    def __init__(self, device, fin=3):
        super().__init__()
        self.fc = nn.Linear(fin, 4, device=device)
        self.norm = nn.LayerNorm(4, device=device)
        self.register_buffer("running", flame.zeros(4, device=device))
        self.register_buffer("scratch", flame.ones(2, device=device), persistent=False)
        self.scale = nn.Parameter(flame.ones(1, device=device))

    def forward(self, x):
        return self.norm(self.fc(x)) * self.scale + self.running


class Net(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.blocks = nn.ModuleList([Block(device), Block(device, 4)])
        self.head = nn.Linear(4, 2, bias=False, device=device)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_parameter_is_a_cheap_leaf_sharing_storage(device):
    t = flame.randn(3, 2, device=device)
    p = nn.Parameter(t)
    assert isinstance(p, flame.Tensor) and p.is_leaf and p.requires_grad
    assert p._data is t._data  # no copy
    assert not nn.Parameter(t, requires_grad=False).requires_grad
    assert repr(p).startswith("Parameter containing:\ntensor(")
    y = (p * 2).sum()
    y.backward()
    np.testing.assert_allclose(npa(p.grad), 2.0)
    assert type(p * 2) is flame.Tensor  # results of ops are plain tensors
    with pytest.raises(TypeError):
        nn.Parameter(np.zeros(3))


def test_registration_and_traversal_names(device):
    net = Net(device)
    names = [n for n, _ in net.named_parameters()]
    assert names == ["blocks.0.scale", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight",
                     "blocks.0.norm.bias", "blocks.1.scale", "blocks.1.fc.weight", "blocks.1.fc.bias",
                     "blocks.1.norm.weight", "blocks.1.norm.bias", "head.weight"]
    assert [n for n, _ in net.named_buffers()] == ["blocks.0.running", "blocks.0.scratch", "blocks.1.running",
                                                    "blocks.1.scratch"]
    assert [n for n, _ in net.named_modules()] == ["", "blocks", "blocks.0", "blocks.0.fc", "blocks.0.norm",
                                                   "blocks.1", "blocks.1.fc", "blocks.1.norm", "head"]
    assert [n for n, _ in net.named_children()] == ["blocks", "head"]
    assert len(list(net.parameters(recurse=False))) == 0
    assert net.get_submodule("blocks.1.fc") is net.blocks[1].fc
    assert net.get_parameter("blocks.0.fc.bias") is net.blocks[0].fc.bias
    assert net.get_buffer("blocks.1.running") is net.blocks[1].running
    with pytest.raises(AttributeError, match="nope"):
        net.get_submodule("blocks.nope")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        net.missing


def test_shared_parameters_are_listed_once(device):
    lin = nn.Linear(2, 2, device=device)
    seq = nn.Sequential(lin, nn.ReLU(), lin)
    assert len(list(seq.parameters())) == 2
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_setattr_reassignment_rules(device):
    m = nn.Module()
    m.w = nn.Parameter(flame.ones(2, device=device))
    assert "w" in m._parameters
    m.w = None
    assert m._parameters["w"] is None and m.w is None
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'w'"):
        m.w = flame.ones(2, device=device)
    m.register_buffer("b", flame.zeros(2, device=device))
    m.b = flame.ones(3, device=device)
    assert tuple(m._buffers["b"].shape) == (3,)
    with pytest.raises(TypeError, match="buffer 'b'"):
        m.b = 3
    m.sub = nn.Linear(1, 1, device=device)
    del m.sub
    assert "sub" not in m._modules and not hasattr(m, "sub")
    with pytest.raises(KeyError, match="can't be empty or contain"):
        m.register_buffer("a.b", None)
    with pytest.raises(AttributeError, match="before Module.__init__"):
        class Bad(nn.Module):
            def __init__(self):
                self.p = nn.Parameter(flame.ones(1))
        Bad()


def test_train_eval_requires_grad_apply(device):
    net = Net(device)
    assert net.training and net.blocks[0].fc.training
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    net.requires_grad_(False)
    assert not any(p.requires_grad for p in net.parameters())
    seen = []
    net.apply(lambda m: seen.append(type(m).__name__))
    assert seen == ["Linear", "LayerNorm", "Block", "Linear", "LayerNorm", "Block", "ModuleList", "Linear", "Net"]


def test_to_dtype_converts_in_place_keeping_objects(device):
    net = Net(device)
    params = list(net.parameters())
    before = [npa(p) for p in params]
    net(flame.randn(5, 3, device=device)).sum().backward()
    net.to(flame.float64)
    assert [id(p) for p in net.parameters()] == [id(p) for p in params]
    assert all(p.dtype == flame.float64 for p in params)
    assert all(p.grad.dtype == flame.float64 for p in params)
    assert net.blocks[0].running.dtype == flame.float64
    for b, p in zip(before, params):
        np.testing.assert_allclose(npa(p), b, rtol=0, atol=0)
    net.half()
    assert all(p.dtype == flame.float16 for p in params)
    with pytest.raises(TypeError, match="floating point"):
        net.to(flame.int64)
    out = net.to(flame.float32)(flame.randn(2, 3, device=device))
    assert out.dtype == flame.float32


@pytest.mark.gpu
def test_to_device_roundtrip_keeps_optimizer_working():
    net = Net("cpu")
    opt = nn.optim.AdamW(net.parameters(), lr=1e-2)
    x = flame.randn(4, 3, device="cpu")
    net(x).sum().backward()
    opt.step()
    net.cuda()
    assert all(p.device.type == "cuda" for p in net.parameters())
    opt.zero_grad()
    net(x.cuda()).sum().backward()
    opt.step()  # state moved with the parameters
    assert all(st["exp_avg"].device.type == "cuda" for st in opt.state.values())
    net.cpu()
    assert all(p.device.type == "cpu" for p in net.parameters())


def test_zero_grad_uses_the_gradient_pool(device):
    net = Net(device)
    grad_pool.register(net.parameters())
    net(flame.randn(4, 3, device=device)).sum().backward()
    grads = [p.grad for p in net.parameters()]
    buf = grad_pool.flat_buffer_of(net.head.weight)
    assert float(np.abs(buf.numpy()).sum()) > 0
    net.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))  # same views
    assert float(np.abs(buf.numpy()).sum()) == 0.0
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_zero_grad_unpooled(device):
    lin = nn.Linear(2, 2, device=device)
    lin(flame.ones(1, 2, device=device)).sum().backward()
    lin.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(npa(lin.weight.grad), 0)
    lin.zero_grad()
    assert lin.weight.grad is None


def test_forward_hooks(device):
    lin = nn.Linear(2, 2, device=device)
    calls = []
    h1 = lin.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    h2 = lin.register_forward_hook(lambda m, args, out: calls.append(tuple(out.shape)) or out + 1)
    x = flame.ones(3, 2, device=device)
    y = lin(x)
    np.testing.assert_allclose(npa(y), npa(lin.bias).reshape(1, 2).repeat(3, 0) + 1, rtol=1e-6)
    assert calls == [(3, 2)]
    h1.remove()
    h2.remove()
    np.testing.assert_allclose(npa(lin(x)), npa(x) @ npa(lin.weight).T + npa(lin.bias), rtol=1e-5)
    assert calls == [(3, 2)]

    order = []
    lin.register_forward_hook(lambda m, a, o: order.append("second"))
    lin.register_forward_hook(lambda m, a, o: order.append("first"), prepend=True)
    lin.register_forward_pre_hook(lambda m, a, kw: (a, {}) if order.append("pre-kw") is None else None,
                                  with_kwargs=True)
    lin(x)
    assert order == ["pre-kw", "first", "second"]


def test_forward_hook_always_call_on_error(device):
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")
    m = Boom()
    seen = []
    m.register_forward_hook(lambda mod, a, out: seen.append(out), always_call=True)
    with pytest.raises(RuntimeError, match="boom"):
        m(1)
    assert seen == [None]
    with pytest.raises(NotImplementedError, match='missing the required "forward"'):
        nn.Module()(1)


def test_repr_matches_pytorch_style(device):
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, device=device), nn.GroupNorm(2, 8, device=device),
                        nn.SiLU(), nn.Flatten(), nn.Linear(8, 2, bias=False, device=device))
    assert repr(net) == (
        "Sequential(\n"
        "  (0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))\n"
        "  (1): GroupNorm(2, 8, eps=1e-05, affine=True)\n"
        "  (2): SiLU()\n"
        "  (3): Flatten(start_dim=1, end_dim=-1)\n"
        "  (4): Linear(in_features=8, out_features=2, bias=False)\n"
        ")")
    ml = nn.ModuleList([nn.Linear(2, 2, device=device) for _ in range(3)] + [nn.ReLU()])
    assert repr(ml) == ("ModuleList(\n"
                        "  (0-2): 3 x Linear(in_features=2, out_features=2, bias=True)\n"
                        "  (3): ReLU()\n"
                        ")")


def test_containers(device):
    a, b, c = (nn.Linear(2, 2, device=device) for _ in range(3))
    seq = nn.Sequential(a, nn.ReLU(), b)
    assert seq[0] is a and seq[-1] is b and len(seq) == 3
    assert isinstance(seq[1:], nn.Sequential) and len(seq[1:]) == 2
    seq.append(c)
    assert seq[3] is c
    named = nn.Sequential(OrderedDict([("first", a), ("act", nn.GELU())]))
    assert list(named.state_dict()) == ["first.weight", "first.bias"]
    x = flame.randn(4, 2, device=device)
    np.testing.assert_allclose(npa(seq(x)), npa(c(b(a(x).relu()))), rtol=1e-6)

    ml = nn.ModuleList([a, b])
    ml.insert(1, c)
    assert list(ml) == [a, c, b]
    del ml[0]
    assert list(ml) == [c, b] and list(ml._modules) == ["0", "1"]
    with pytest.raises(IndexError):
        ml[5]
    md = nn.ModuleDict({"x": a, "y": b})
    md["z"] = c
    assert list(md.keys()) == ["x", "y", "z"] and "y" in md
    assert md.pop("y") is b and list(md) == ["x", "z"]
    with pytest.raises(KeyError, match="keys"):
        md["nope"]


def test_state_dict_roundtrip_and_persistence(device):
    src, dst = Net(device), Net(device)
    sd = src.state_dict()
    assert "blocks.0.running" in sd and "blocks.0.scratch" not in sd
    assert not any(v.requires_grad for v in sd.values())
    res = dst.load_state_dict(sd)
    assert res.missing_keys == [] and res.unexpected_keys == []
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        np.testing.assert_array_equal(npa(a), npa(b))
    x = flame.randn(3, 3, device=device)
    np.testing.assert_array_equal(npa(src(x)), npa(dst(x)))
    # loading copies: changing the source afterwards leaves dst alone
    with flame.no_grad():
        src.head.weight.add_(1.0)
    assert not np.allclose(npa(src.head.weight), npa(dst.head.weight))
    # numpy arrays and other dtypes are accepted and converted to the parameter's dtype
    dst.load_state_dict({k: v.numpy().astype(np.float64) for k, v in sd.items()})
    assert dst.head.weight.dtype == flame.float32


def test_load_state_dict_errors_list_keys(device):
    net = Net(device)
    sd = dict(net.state_dict())
    sd.pop("head.weight")
    sd["blocks.0.fc.weight"] = flame.zeros(5, 3, device=device)
    sd["extra.thing"] = flame.zeros(1, device=device)
    with pytest.raises(nn.StateDictError) as e:
        net.load_state_dict(sd)
    msg = str(e.value)
    assert 'Missing key(s) in state_dict (1): "head.weight"' in msg
    assert 'Unexpected key(s) in state_dict (1): "extra.thing"' in msg
    assert ("size mismatch for blocks.0.fc.weight: copying a param with shape (5, 3) from checkpoint, the shape in "
            "current model is (4, 3)") in msg
    sd["blocks.0.fc.weight"] = net.blocks[0].fc.weight.detach()
    res = net.load_state_dict(sd, strict=False)
    assert res.missing_keys == ["head.weight"] and res.unexpected_keys == ["extra.thing"]


def test_load_state_dict_assign_takes_arrays(device):
    lin = nn.Linear(2, 3, device=device)
    w = flame.randn(3, 2, dtype=flame.float64, device=device)
    lin.load_state_dict({"weight": w, "bias": flame.zeros(3, device=device)}, assign=True)
    assert lin.weight._data is w._data and lin.weight.dtype == flame.float64
    assert isinstance(lin.weight, nn.Parameter)


def test_deepcopy_keeps_structure(device):
    net = Net(device)
    net2 = copy.deepcopy(net)
    assert [n for n, _ in net2.named_parameters()] == [n for n, _ in net.named_parameters()]
    for a, b in zip(net.parameters(), net2.parameters()):
        assert a is not b and isinstance(b, nn.Parameter)
        np.testing.assert_array_equal(npa(a), npa(b))
