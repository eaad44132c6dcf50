"""flame_nn's RNN (Elman) layer and RNNCell / LSTMCell / GRUCell against PyTorch (golden fixtures,
tests/fixtures/make_rnn_cell_fixtures.py): PyTorch's state_dict loads as it is, and the outputs and the gradients
of the input and of every parameter match in float64; plus the argument checks."""
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "rnn_cells.safetensors")

CASES = {
    "rnn": lambda: nn.RNN(3, 4, 2, nonlinearity="relu", bidirectional=True, batch_first=True),
    "rnn_tanh": lambda: nn.RNN(3, 4, bias=False),
    "rnn_cell": lambda: nn.RNNCell(3, 5),
    "rnn_cell_relu": lambda: nn.RNNCell(3, 5, nonlinearity="relu"),
    "lstm_cell": lambda: nn.LSTMCell(3, 4),
    "lstm_cell_unbatched": lambda: nn.LSTMCell(3, 4),
    "gru_cell": lambda: nn.GRUCell(3, 4),
    "gru_cell_nobias": lambda: nn.GRUCell(3, 4, bias=False),
}


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


def _np(t):
    return t.detach().cpu().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    m = CASES[case]().double().to(device)
    sd = {k[len(case) + 1:]: flame.tensor(v, device=device) for k, v in golden.items()
          if k.startswith(case + ".") and k.count(".") == 1 and not k.endswith(".input")}
    assert set(sd) == {k for k, _ in m.named_parameters()}
    m.load_state_dict(sd)
    x = flame.tensor(golden[f"{case}.input"], device=device, requires_grad=True)
    states = [flame.tensor(golden[f"{case}.state.{i}"], device=device) for i in range(2)
              if f"{case}.state.{i}" in golden]
    if not states:
        out = m(x)
    elif isinstance(m, nn.LSTMCell):
        out = m(x, tuple(states))
    else:
        out = m(x, states[0])
    flat = []
    for o in (out if isinstance(out, tuple) else (out,)):
        flat.extend(o if isinstance(o, tuple) else (o,))
    loss = 0
    for i, o in enumerate(flat):
        np.testing.assert_allclose(_np(o), golden[f"{case}.out.{i}"], rtol=1e-10, atol=1e-12, err_msg=f"out {i}")
        loss = loss + (o * flame.tensor(golden[f"{case}.go.{i}"], device=device)).sum()
    loss.backward()
    np.testing.assert_allclose(_np(x.grad), golden[f"{case}.grad.input"], rtol=1e-9, atol=1e-11)
    for k, p in m.named_parameters():
        np.testing.assert_allclose(_np(p.grad), golden[f"{case}.grad.{k}"], rtol=1e-9, atol=1e-11, err_msg=k)


def test_cell_arguments_and_state_checks():
    with pytest.raises(ValueError, match="nonlinearity"):
        nn.RNNCell(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="nonlinearity"):
        nn.RNN(3, 4, nonlinearity="gelu")
    cell = nn.GRUCell(3, 4)
    with pytest.raises(flame.ShapeError, match="input"):
        cell(flame.randn(2, 5))
    with pytest.raises(flame.ShapeError, match="hx"):
        cell(flame.randn(2, 3), flame.randn(3, 4))
    assert repr(nn.LSTMCell(3, 4, bias=False)) == "LSTMCell(3, 4, bias=False)"
    assert [k for k, _ in nn.LSTMCell(3, 4).named_parameters()] == ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    assert tuple(nn.LSTMCell(3, 4).weight_ih.shape) == (16, 3)
