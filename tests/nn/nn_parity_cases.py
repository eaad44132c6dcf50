"""The cases of the nn-parity golden test (tests/nn/test_nn_parity.py) and of its fixture script
(tests/fixtures/make_nn_parity_fixtures.py): each is `fn(lib, *inputs)` written against PyTorch's API, run once with
lib = torch (the fixture) and once with lib = flame_core whose `nn` is flame_nn (the test). No torch or flame import.

INPUTS: name -> (kind, spec) for the fixture script to draw:
  ("randn", shape, scale) / ("uniform", shape, lo, hi) / ("log_softmax", shape): float64;
  ("values", nested list): float64; ("longs", nested list) / ("ints", shape, high): int64
CASES: name -> (fn, input names, grad[, rtol]): grad True checks the gradient of sum(out * go) with respect to every
float input (out: the first output when fn returns several); rtol, where given, replaces the test's gradient tolerance
(celu: PyTorch's backward takes 1 / alpha as a float32, ~3e-8 relative, where FLAME's is exp(x / alpha) in float64)."""

INPUTS = {
    "table": ("randn", (7, 4), 1.0),
    "bag_idx": ("longs", [1, 2, 4, 5, 4, 3, 2, 0, 6, 6]),
    "bag_off": ("longs", [0, 2, 2, 5]),
    "bag_off_last": ("longs", [0, 3, 3, 10]),
    "bag_2d": ("longs", [[1, 2, 4], [5, 5, 0], [3, 2, 2]]),
    "bag_psw": ("randn", (10,), 1.0),
    "bag_psw_2d": ("randn", (3, 3), 1.0),
    "lp": ("log_softmax", (8, 3, 5)),
    "lp_one": ("log_softmax", (6, 4)),
    "ctc_tg": ("longs", [[1, 2, 2, 4], [3, 1, 0, 0], [4, 4, 1, 0]]),
    "ctc_tg_cat": ("longs", [1, 2, 2, 4, 3, 1, 4, 4, 1]),
    "ctc_il": ("longs", [8, 6, 5]),
    "ctc_il_short": ("longs", [8, 6, 2]),
    "ctc_tl": ("longs", [4, 2, 3]),
    "ctc_tg_one": ("longs", [2, 3, 3]),
    "x": ("randn", (2, 3, 5), 1.5),
    "x4": ("randn", (2, 3, 5, 6), 1.0),
    "x5": ("randn", (2, 2, 4, 6, 5), 1.0),
    "x5_pos": ("uniform", (1, 2, 4, 4, 6), 0.2, 2.0),
    "ml_x": ("randn", (3, 5), 1.0),
    "ml_tg": ("longs", [[3, 0, -1, 1, 2], [1, 4, 2, 0, 3], [-1, 2, 0, 0, 0]]),
    "ml_row": ("randn", (4,), 1.0),
    "ml_tg_row": ("longs", [2, 2, -1, 0]),
}


def _inplace(fn):
    """fn applied in place to a copy of the input (a leaf cannot be written in place)."""
    def case(L, x):
        y = x * 1.0
        out = fn(L, y)
        assert out is y
        return y
    return case


def _bn3d(L, x):
    bn = L.nn.BatchNorm3d(2, momentum=0.3, dtype=L.float64)
    y = bn(x)
    return y, bn.running_mean, bn.running_var, bn.num_batches_tracked


def _unpool3d(L, x):
    out, idx = L.nn.functional.max_pool3d(x, 2, return_indices=True)
    return L.nn.functional.max_unpool3d(out, idx, 2, output_size=(5, 7, 5)), idx


def _unpool1d(L, x):
    out, idx = L.nn.functional.max_pool1d(x, 2, stride=2, return_indices=True)
    return L.nn.functional.max_unpool1d(out, idx, 2), idx


def _renorm_bag(L, w, idx, off):
    table = w * 1.0                                        # the in-place renormalisation lands on this copy
    out = L.nn.functional.embedding_bag(idx, table, off, max_norm=1.2, mode="sum")
    return out, table


def _renorm_lookup(L, w, idx):
    table = w * 1.0                                        # the in-place renormalisation lands on this copy
    return L.nn.functional.embedding(idx, table, max_norm=1.0, norm_type=3.0) * 2.0, table


def _packed_rnn(kind, bidirectional, num_layers, with_h0):
    """A packed (T=2, N=3, F=5) batch (lengths 2, 1, 2: unsorted) through an RNN / LSTM / GRU whose weights are a
    fixed sine pattern (the same in both libraries): (packed output data, h_n[, c_n])."""
    def case(L, x):
        cls = {"rnn": L.nn.RNN, "lstm": L.nn.LSTM, "gru": L.nn.GRU}[kind]
        m = cls(5, 4, num_layers=num_layers, bidirectional=bidirectional, dtype=x.dtype)
        with L.no_grad():
            for k, (_, p) in enumerate(sorted(m.named_parameters())):
                p.copy_((L.arange(p.numel(), dtype=x.dtype) * 0.37 + k).sin().reshape(p.shape) * 0.5)
        packed = L.nn.utils.rnn.pack_padded_sequence(x, L.tensor([2, 1, 2]), enforce_sorted=False)
        dirs = 2 if bidirectional else 1
        h0 = (L.arange(num_layers * dirs * 3 * 4, dtype=x.dtype).reshape(num_layers * dirs, 3, 4) * 0.1).cos() \
            if with_h0 else None
        hx = (h0, h0 * 0.5) if kind == "lstm" and with_h0 else h0
        out, h = m(packed, hx)
        return (out.data,) + (h if isinstance(h, tuple) else (h,))
    return case


CASES = {
    # embedding_bag / EmbeddingBag
    "bag_sum": (lambda L, w, i, o: L.nn.functional.embedding_bag(i, w, o, mode="sum"),
                ["table", "bag_idx", "bag_off"], True),
    "bag_mean_padding": (lambda L, w, i, o: L.nn.functional.embedding_bag(i, w, o, padding_idx=2),
                         ["table", "bag_idx", "bag_off"], True),
    "bag_max_padding": (lambda L, w, i, o: L.nn.functional.embedding_bag(i, w, o, mode="max", padding_idx=6),
                        ["table", "bag_idx", "bag_off"], True),
    "bag_max_2d": (lambda L, w, i: L.nn.functional.embedding_bag(i, w, mode="max"), ["table", "bag_2d"], True),
    "bag_psw": (lambda L, w, i, o, p: L.nn.functional.embedding_bag(i, w, o, mode="sum", per_sample_weights=p,
                                                                    padding_idx=4),
                ["table", "bag_idx", "bag_off", "bag_psw"], True),
    "bag_psw_2d": (lambda L, w, i, p: L.nn.functional.embedding_bag(i, w, mode="sum", per_sample_weights=p),
                   ["table", "bag_2d", "bag_psw_2d"], True),
    "bag_last_offset": (lambda L, w, i, o: L.nn.functional.embedding_bag(i, w, o, include_last_offset=True),
                        ["table", "bag_idx", "bag_off_last"], True),
    "bag_max_norm": (_renorm_bag, ["table", "bag_idx", "bag_off"], True),
    "bag_module": (lambda L, w, i, o: L.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="max")(i, o),
                   ["table", "bag_idx", "bag_off"], True),
    # ctc_loss / CTCLoss (gradients with respect to log_probs: PyTorch's exp(log_probs) - occupancy)
    "ctc_none": (lambda L, lp, t, il, tl: L.nn.functional.ctc_loss(lp, t, il, tl, reduction="none"),
                 ["lp", "ctc_tg", "ctc_il", "ctc_tl"], True),
    "ctc_mean": (lambda L, lp, t, il, tl: L.nn.functional.ctc_loss(lp, t, il, tl),
                 ["lp", "ctc_tg", "ctc_il", "ctc_tl"], True),
    "ctc_sum_blank": (lambda L, lp, t, il, tl: L.nn.functional.ctc_loss(lp, t - 1, il, tl, blank=4,
                                                                         reduction="sum"),
                      ["lp", "ctc_tg", "ctc_il", "ctc_tl"], True),
    "ctc_concat": (lambda L, lp, t, il, tl: L.nn.functional.ctc_loss(lp, t, il, tl, reduction="none"),
                   ["lp", "ctc_tg_cat", "ctc_il", "ctc_tl"], True),
    "ctc_zero_infinity": (lambda L, lp, t, il, tl: L.nn.functional.ctc_loss(lp, t, il, tl, reduction="sum",
                                                                             zero_infinity=True),
                          ["lp", "ctc_tg", "ctc_il_short", "ctc_tl"], True),
    "ctc_unbatched": (lambda L, lp, t: L.nn.functional.ctc_loss(lp, t, [6], [3], reduction="none"),
                      ["lp_one", "ctc_tg_one"], True),
    "ctc_module": (lambda L, lp, t, il, tl: L.nn.CTCLoss(blank=0, reduction="mean")(lp.log_softmax(-1), t, il, tl),
                   ["lp", "ctc_tg", "ctc_il", "ctc_tl"], True),
    # activations: rrelu in eval, the in-place forms
    "rrelu_eval": (lambda L, x: L.nn.functional.rrelu(x, 0.1, 0.3), ["x"], True),
    "rrelu_module_eval": (lambda L, x: L.nn.RReLU(0.2, 0.4).eval()(x), ["x"], True),
    "relu_": (_inplace(lambda L, y: L.nn.functional.relu_(y)), ["x"], True),
    "elu_": (_inplace(lambda L, y: L.nn.functional.elu_(y, 0.7)), ["x"], True),
    "celu_": (_inplace(lambda L, y: L.nn.functional.celu_(y, 1.3)), ["x"], True, 1e-7),
    "selu_": (_inplace(lambda L, y: L.nn.functional.selu_(y)), ["x"], True),
    "leaky_relu_": (_inplace(lambda L, y: L.nn.functional.leaky_relu_(y, 0.2)), ["x"], True),
    "hardtanh_": (_inplace(lambda L, y: L.nn.functional.hardtanh_(y, -0.5, 0.8)), ["x"], True),
    "threshold_": (_inplace(lambda L, y: L.nn.functional.threshold_(y, 0.1, -2.0)), ["x"], True),
    "rrelu_": (_inplace(lambda L, y: L.nn.functional.rrelu_(y, 0.1, 0.5)), ["x"], True),
    # pooling with indices, unpooling, lp_pool3d
    "max_pool1d_with_indices": (lambda L, x: L.nn.functional.max_pool1d_with_indices(x, 2, 1, 1), ["x"], True),
    "max_pool2d_with_indices": (lambda L, x: L.nn.functional.max_pool2d_with_indices(x, (2, 3), 2), ["x4"], True),
    "max_pool3d_with_indices": (lambda L, x: L.nn.functional.max_pool3d_with_indices(x, 2, ceil_mode=True),
                                ["x5"], True),
    "adaptive_max_pool1d_with_indices": (lambda L, x: L.nn.functional.adaptive_max_pool1d_with_indices(x, 3),
                                         ["x"], True),
    "adaptive_max_pool2d_with_indices": (lambda L, x: L.nn.functional.adaptive_max_pool2d_with_indices(x, (2, 4)),
                                         ["x4"], True),
    "adaptive_max_pool3d_with_indices": (lambda L, x: L.nn.functional.adaptive_max_pool3d_with_indices(x, (3, 2, 4)),
                                         ["x5"], True),
    "adaptive_max_pool1d_module": (lambda L, x: L.nn.AdaptiveMaxPool1d(2, return_indices=True)(x), ["x"], True),
    "max_unpool1d": (_unpool1d, ["x"], True),
    "max_unpool3d": (_unpool3d, ["x5"], True),
    "max_unpool3d_module": (lambda L, x: L.nn.MaxUnpool3d((1, 2, 2))(
        *L.nn.functional.max_pool3d(x, (1, 2, 2), return_indices=True), output_size=(4, 6, 5)), ["x5"], True),
    "lp_pool3d": (lambda L, x: L.nn.functional.lp_pool3d(x, 2, (2, 2, 3), stride=(1, 2, 2)), ["x5"], True),
    "lp_pool3d_p3_ceil": (lambda L, x: L.nn.LPPool3d(3, 3, stride=2, ceil_mode=True)(x), ["x5_pos"], True),
    # multilabel_margin_loss, BatchNorm3d
    "multilabel_margin_none": (lambda L, x, t: L.nn.functional.multilabel_margin_loss(x, t, reduction="none"),
                               ["ml_x", "ml_tg"], True),
    "multilabel_margin_mean": (lambda L, x, t: L.nn.MultiLabelMarginLoss()(x, t), ["ml_x", "ml_tg"], True),
    "multilabel_margin_row": (lambda L, x, t: L.nn.functional.multilabel_margin_loss(x, t, reduction="sum"),
                              ["ml_row", "ml_tg_row"], True),
    "batch_norm3d": (_bn3d, ["x5"], True),
    # embedding's whole signature and Embedding.from_pretrained
    "embedding_max_norm": (_renorm_lookup, ["table", "bag_2d"], True),
    "embedding_freq_padding": (lambda L, w, i: L.nn.functional.embedding(i, w, padding_idx=-2, scale_grad_by_freq=True),
                               ["table", "bag_2d"], True),
    "embedding_from_pretrained": (lambda L, w, i: L.nn.Embedding.from_pretrained(w, freeze=False, padding_idx=4,
                                                                                 max_norm=1.5, norm_type=1.0)(i),
                                  ["table", "bag_2d"], True),
    # RNN / LSTM / GRU on a PackedSequence
    "packed_lstm_bidirectional": (_packed_rnn("lstm", True, 2, False), ["x"], True),
    "packed_lstm_h0": (_packed_rnn("lstm", False, 1, True), ["x"], True),
    "packed_gru_bidirectional_h0": (_packed_rnn("gru", True, 1, True), ["x"], True),
    "packed_rnn_two_layers": (_packed_rnn("rnn", False, 2, False), ["x"], True),
}
