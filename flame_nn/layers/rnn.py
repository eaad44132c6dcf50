"""RNN, LSTM and GRU: PyTorch's parameters (weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}, with the suffix
`_reverse` for the backward direction and weight_hr_l{k} for LSTM projections), gate order and call signatures.

A plain implementation: the input projections of a whole sequence are one matrix product per layer and direction,
the recurrence a loop over time steps of Tensor ops (autograd records each step).
    LSTM (gates i, f, g, o):  c' = sigmoid(f) * c + sigmoid(i) * tanh(g);  h' = sigmoid(o) * tanh(c')  (h' = W_hr h')
    GRU  (gates r, z, n):     n = tanh(x_n + sigmoid(r) * (W_hn h + b_hn));  h' = (1 - sigmoid(z)) * n + sigmoid(z) * h
    RNN:                      h' = tanh (or relu) (x W_ih^T + b_ih + h W_hh^T + b_hh)
The one-step rules (`lstm_step`, `gru_step`, `rnn_step`) are shared with the cells (rnn_cell.py).

A PackedSequence input (flame_nn.utils.rnn) runs padded with a mask per time step: a sequence's state stops at its
last step forward, and the reverse direction starts at it; the output is packed the same way and h_n holds each
sequence's own final states, in the batch's original order (hx too), as PyTorch's.
"""
import math
import warnings

import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module
from ..utils.rnn import PackedSequence


class _RNNBase(Module):
    _gates = 0

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size must be a positive integer, got {hidden_size}")
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"{type(self).__name__}: num_layers must be a positive integer, got {num_layers}")
        if not 0 <= dropout <= 1 or isinstance(dropout, bool):
            raise ValueError(f"{type(self).__name__}: dropout must be a number in [0, 1], got {dropout}")
        if proj_size < 0 or (proj_size and proj_size >= hidden_size):
            raise ValueError(f"{type(self).__name__}: proj_size must be 0 or in [1, hidden_size), got {proj_size}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                          f"expects num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                          UserWarning, stacklevel=3)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, proj_size
        dirs = 2 if bidirectional else 1
        out = proj_size if proj_size > 0 else hidden_size
        self._flat_weights_names = []
        for layer in range(num_layers):
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                in_size = input_size if layer == 0 else out * dirs
                shapes = [("weight_ih", (self._gates * hidden_size, in_size)),
                          ("weight_hh", (self._gates * hidden_size, out))]
                if bias:
                    shapes += [("bias_ih", (self._gates * hidden_size,)), ("bias_hh", (self._gates * hidden_size,))]
                if proj_size > 0:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                for name, shape in shapes:
                    setattr(self, name + sfx, new_parameter(shape, dtype, device))
                    self._flat_weights_names.append(name + sfx)
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name in self._flat_weights_names:
            init.uniform_(getattr(self, name), -bound, bound)

    def flatten_parameters(self):
        """PyTorch packs the weights into one buffer for cuDNN here; this implementation has no such buffer."""

    def _params(self, layer, d):
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        get = lambda n: getattr(self, n + sfx, None)  # noqa: E731
        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), get("weight_hr")

    def _check_input(self, input):
        if input.ndim not in (2, 3):
            raise ShapeError(f"{type(self).__name__}: expected a 2-D (unbatched) or 3-D input, got "
                             f"{fmt_shape(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: input {fmt_shape(input.shape)} must have "
                             f"input_size={self.input_size} features in its last dim")

    def _state(self, h, name, batch, size, like, unbatched):
        dirs = 2 if self.bidirectional else 1
        want = (self.num_layers * dirs, batch, size)
        if h is None:
            return flame.zeros(*want, dtype=like.dtype, device=like.device)
        if unbatched:
            if h.ndim != 2:
                raise ShapeError(f"{type(self).__name__}: for an unbatched input {name} must be 2-D, got "
                                 f"{fmt_shape(h.shape)}")
            h = h.unsqueeze(1)
        if tuple(h.shape) != want:
            raise ShapeError(f"{type(self).__name__}: expected {name} of shape {fmt_shape(want)}, got "
                             f"{fmt_shape(h.shape)}")
        return h

    def _run(self, input, states, masks=None):
        """Runs every layer and direction; `states` is a list (one per state kind) of (layers*dirs, N, size);
        `masks` (a packed input's): per time step, (N, 1) bools of the sequences still running."""
        unbatched = input.ndim == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)  # (L, N, F)
        dirs = 2 if self.bidirectional else 1
        finals = [[] for _ in states]
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                out, last = self._direction(x, [s[k] for s in states], self._params(layer, d), d == 1, masks)
                outs.append(out)
                for f, v in zip(finals, last):
                    f.append(v)
            x = outs[0] if dirs == 1 else flame.cat(outs, -1)             # (L, N, dirs * H_out)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, True)
        finals = [flame.stack(f, 0) for f in finals]                       # (layers * dirs, N, size)
        if unbatched:
            return x.squeeze(1), [f.squeeze(1) for f in finals]
        return (x.transpose(0, 1) if self.batch_first else x), finals

    def _packed(self, input, state_specs):
        """forward of a PackedSequence: (packed output, final states) from (name, size, given) state specs."""
        data, sizes = input.data, input.batch_sizes.cpu().numpy().astype(np.int64)
        if data.ndim != 2 or data.shape[-1] != self.input_size:
            raise ShapeError(f"{type(self).__name__}: packed data {fmt_shape(data.shape)} must be (steps, "
                             f"input_size={self.input_size})")
        order = (input.sorted_indices.cpu().numpy().astype(np.int64) if input.sorted_indices is not None else
                 np.arange(int(sizes[0]) if sizes.size else 0))
        n, steps = order.size, sizes.size
        ts = np.repeat(np.arange(steps), sizes)                            # each packed row's time step ...
        rows = np.concatenate([order[:b] for b in sizes]) if steps else np.zeros(0, np.int64)   # ... and sequence
        dev = data.device
        where = (flame.tensor(ts, device=dev), flame.tensor(rows, device=dev))
        padded = flame.zeros(steps, n, data.shape[-1], dtype=data.dtype, device=dev).index_put(where, data)
        lengths = np.zeros(n, np.int64)
        lengths[order] = (sizes[None, :] > np.arange(n)[:, None]).sum(1)
        masks = [flame.tensor((lengths > t)[:, None], device=dev) for t in range(steps)]
        states = [self._state(h, name, n, size, data, False) for name, size, h in state_specs]
        batch_first, self.batch_first = self.batch_first, False
        try:
            out, finals = self._run(padded, states, masks)
        finally:
            self.batch_first = batch_first
        return PackedSequence(out[where], input.batch_sizes, input.sorted_indices, input.unsorted_indices), finals

    def _forward_one_state(self, input, hx=None):
        """forward(input, h_0=None) -> output, h_n: RNN's and GRU's (one state, no projection)."""
        if isinstance(input, PackedSequence):
            output, (h_n,) = self._packed(input, [("h_0", self.hidden_size, hx)])
            return output, h_n
        self._check_input(input)
        unbatched = input.ndim == 2
        batch = 1 if unbatched else input.shape[0 if self.batch_first else 1]
        h0 = self._state(hx, "h_0", batch, self.hidden_size, input, unbatched)
        output, (h_n,) = self._run(input, [h0])
        return output, h_n

    def _direction(self, x, state, params, reverse, masks=None):
        w_ih, w_hh, b_ih, b_hh, w_hr = params
        L = x.shape[0]
        gx = F.linear(x, w_ih, b_ih)                                       # (L, N, gates * H)
        steps = range(L - 1, -1, -1) if reverse else range(L)
        outs = [None] * L
        for t in steps:
            new = self._cell(gx[t], state, w_hh, b_hh, w_hr)
            if masks is None:
                state = new
                outs[t] = state[0]
            else:   # finished sequences keep their state (reverse: not started yet) and output zeros
                state = [flame.where(masks[t], a, b) for a, b in zip(new, state)]
                outs[t] = flame.where(masks[t], new[0], 0.0)
        return flame.stack(outs, 0), state

def lstm_step(gx, h, c, w_hh, b_hh):
    """One LSTM step from the input projection gx (N, 4H) (its bias included): (h', c') before any projection."""
    g = gx + F.linear(h, w_hh, b_hh)                                       # (N, 4H)
    i, f, gg, o = g.chunk(4, -1)
    c = f.sigmoid() * c + i.sigmoid() * gg.tanh()
    return o.sigmoid() * c.tanh(), c


def gru_step(gx, h, w_hh, b_hh):
    """One GRU step from the input projection gx (N, 3H) (its bias included): h'."""
    gh = F.linear(h, w_hh, b_hh)                                           # (N, 3H)
    xr, xz, xn = gx.chunk(3, -1)
    hr, hz, hn = gh.chunk(3, -1)
    r = (xr + hr).sigmoid()
    z = (xz + hz).sigmoid()
    n = (xn + r * hn).tanh()
    return (1 - z) * n + z * h


def rnn_step(gx, h, w_hh, b_hh, nonlinearity):
    """One Elman RNN step: act(gx + h W_hh^T + b_hh), act tanh or relu."""
    pre = gx + F.linear(h, w_hh, b_hh)
    return pre.tanh() if nonlinearity == "tanh" else pre.relu()


class RNN(_RNNBase):
    """The Elman RNN: forward(input, h_0=None) -> output, h_n; nonlinearity 'tanh' (default) or 'relu'."""
    _gates = 1

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: unknown nonlinearity {nonlinearity!r} (expected 'tanh' or 'relu')")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0,
                         device=device, dtype=dtype)

    def _cell(self, gx, state, w_hh, b_hh, w_hr):
        return [rnn_step(gx, state[0], w_hh, b_hh, self.nonlinearity)]

    forward = _RNNBase._forward_one_state


class LSTM(_RNNBase):
    """forward(input, (h_0, c_0)=None) -> output, (h_n, c_n)."""
    _gates = 4

    def _cell(self, gx, state, w_hh, b_hh, w_hr):
        h, c = lstm_step(gx, state[0], state[1], w_hh, b_hh)
        if w_hr is not None:
            h = F.linear(h, w_hr)
        return [h, c]

    def forward(self, input, hx=None):
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        h0, c0 = (None, None) if hx is None else hx
        if isinstance(input, PackedSequence):
            output, (h_n, c_n) = self._packed(input, [("h_0", out_size, h0), ("c_0", self.hidden_size, c0)])
            return output, (h_n, c_n)
        self._check_input(input)
        unbatched = input.ndim == 2
        batch = 1 if unbatched else input.shape[0 if self.batch_first else 1]
        h0 = self._state(h0, "h_0", batch, out_size, input, unbatched)
        c0 = self._state(c0, "c_0", batch, self.hidden_size, input, unbatched)
        output, (h_n, c_n) = self._run(input, [h0, c0])
        return output, (h_n, c_n)


class GRU(_RNNBase):
    """forward(input, h_0=None) -> output, h_n."""
    _gates = 3

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, device=None, dtype=None):
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0,
                         device=device, dtype=dtype)

    def _cell(self, gx, state, w_hh, b_hh, w_hr):
        return [gru_step(gx, state[0], w_hh, b_hh)]

    forward = _RNNBase._forward_one_state
