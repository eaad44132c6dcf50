"""RNNCell, LSTMCell and GRUCell: one recurrent step, PyTorch's parameters (weight_ih, weight_hh, bias_ih, bias_hh),
initialisation (uniform in +-1/sqrt(hidden_size)) and call signatures; batched (N, input_size) or unbatched
(input_size,) inputs, a zero state when none is given. The step rules are the sequence layers' (rnn.py)."""
import math

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module
from .rnn import gru_step, lstm_step, rnn_step


class RNNCellBase(Module):
    _gates = 1

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size must be a positive integer, got {hidden_size}")
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        g = self._gates * hidden_size
        self.weight_ih = new_parameter((g, input_size), dtype, device)
        self.weight_hh = new_parameter((g, hidden_size), dtype, device)
        self.bias_ih = new_parameter((g,), dtype, device) if bias else None
        self.bias_hh = new_parameter((g,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for p in self.parameters():
            init.uniform_(p, -bound, bound)

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity}"
        return s

    def _batched(self, input):
        if input.ndim not in (1, 2) or input.shape[-1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: expected input (N, {self.input_size}) or ({self.input_size},), "
                             f"got {fmt_shape(input.shape)}")
        return (input.unsqueeze(0), True) if input.ndim == 1 else (input, False)

    def _state(self, h, name, x, unbatched):
        if h is None:
            return flame.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        h = h.unsqueeze(0) if unbatched else h
        if tuple(h.shape) != (x.shape[0], self.hidden_size):
            raise ShapeError(f"{type(self).__name__}: {name} must have shape ({x.shape[0]}, {self.hidden_size})"
                             f"{' (unbatched: (hidden_size,))' if unbatched else ''}, got {fmt_shape(h.shape)}")
        return h


class RNNCell(RNNCellBase):
    """h' = tanh (or relu) (x W_ih^T + b_ih + h W_hh^T + b_hh)."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: unknown nonlinearity {nonlinearity!r} (expected 'tanh' or 'relu')")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        x, unbatched = self._batched(input)
        h = self._state(hx, "hx", x, unbatched)
        h = rnn_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh, self.nonlinearity)
        return h.squeeze(0) if unbatched else h


class LSTMCell(RNNCellBase):
    """forward(input, (h, c)=None) -> (h', c'); gates i, f, g, o as LSTM's."""
    _gates = 4

    def forward(self, input, hx=None):
        x, unbatched = self._batched(input)
        h0, c0 = (None, None) if hx is None else hx
        h0, c0 = self._state(h0, "h", x, unbatched), self._state(c0, "c", x, unbatched)
        h, c = lstm_step(F.linear(x, self.weight_ih, self.bias_ih), h0, c0, self.weight_hh, self.bias_hh)
        return (h.squeeze(0), c.squeeze(0)) if unbatched else (h, c)


class GRUCell(RNNCellBase):
    """forward(input, hx=None) -> h'; gates r, z, n as GRU's."""
    _gates = 3

    def forward(self, input, hx=None):
        x, unbatched = self._batched(input)
        h = self._state(hx, "hx", x, unbatched)
        h = gru_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh)
        return h.squeeze(0) if unbatched else h
